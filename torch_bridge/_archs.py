r"""The architectures torch_bridge converts: the families' table, one entry each.

``ARCHITECTURES`` is the registry, keyed by the architecture's name (``jaxckpt convert
--arch``), which is also the jaxckpt config's ``family``. An entry holds the Hugging Face
``model_type``\ s it reads, its ``config.json`` reader and writer (``hf._readers``,
``hf._writers``) and its weight rules (below); its defaults are the family's
``jaxckpt.nn.FAMILY_DEFAULTS``. ``"seed-block"`` is the seed article's
``FlashAttentionWithCheckpoint`` block, one pre-LN layer with non-causal attention and
exact GELU.
"""

import dataclasses
from collections.abc import Callable

from jaxckpt.nn import TransformerConfig
from torch_bridge._table import Rule, Table
from torch_bridge.hf import _readers as readers
from torch_bridge.hf import _writers as writers

B = "blocks."  # the scanned stack: every per-layer target has a leading layer axis
L = "model.layers.{i}."

_ATTENTION = tuple(
    Rule(f"{L}self_attn.{hf}_proj.{kind}", f"{B}attn.{ours}_proj.{p}", kind == "weight")
    for hf, ours in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "out"))
    for kind, p in (("weight", "kernel"), ("bias", "bias"))
)
_QK_NORM = (
    Rule(L + "self_attn.q_norm.weight", B + "attn.q_norm.scale"),
    Rule(L + "self_attn.k_norm.weight", B + "attn.k_norm.scale"),
)
_MLP = tuple(
    Rule(f"{L}mlp.{hf}_proj.{kind}", f"{B}mlp.{ours}.{param}", kind == "weight")
    for hf, ours in (("gate", "gate"), ("up", "up"), ("down", "down"))
    for kind, param in (("weight", "kernel"), ("bias", "bias"))
)
_EMBED, _FINAL_NORM = (
    Rule("model.embed_tokens.weight", "embed.embedding"),
    Rule("model.norm.weight", "final_norm.scale"),
)
_HEAD = Rule("lm_head.weight", "head.kernel", transpose=True)
_ROTARY = r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"

LLAMA = Table(
    rules=(
        _EMBED,
        Rule(L + "input_layernorm.weight", B + "attn_norm.scale"),
        *_ATTENTION,
        *_QK_NORM,
        Rule(L + "post_attention_layernorm.weight", B + "mlp_norm.scale"),
        *_MLP,
        _FINAL_NORM,
        _HEAD,
    ),
    ignore=(_ROTARY, r"lm_head\.weight"),
)
"""LLaMA, and the families laid out as it is (Mistral, Qwen2, Qwen3, SmolLM3): ``nn.Linear``
weights are transposed; RoPE needs no permutation (both sides use the rotate-half
convention). Biases (Qwen2's q/k/v) and q/k norms (Qwen3) bind only where the config has
them. A tied head saved anyway (``lm_head.weight``) is ignored."""

GEMMA = Table(
    rules=(
        _EMBED,
        Rule(L + "input_layernorm.weight", B + "attn_norm.scale"),
        *_ATTENTION,
        *_QK_NORM,
        Rule(L + "post_attention_layernorm.weight", B + "attn_post_norm.scale"),
        Rule(L + "pre_feedforward_layernorm.weight", B + "mlp_norm.scale"),
        *_MLP,
        Rule(L + "post_feedforward_layernorm.weight", B + "mlp_post_norm.scale"),
        _FINAL_NORM,
        _HEAD,
    ),
    ignore=(
        _ROTARY,
        r"lm_head\.weight",
        r"(model\.)?(vision_tower|multi_modal_projector)\..*",  # Gemma 3's image side: not read
    ),
    aliases=(("model.language_model.", "model."), ("language_model.model.", "model.")),
)
"""Gemma 2 and 3: four norms per layer, so ``post_attention_layernorm`` is the norm *after*
attention here (LLaMA's pre-MLP norm is Gemma's ``pre_feedforward_layernorm``). The norm
weights are stored as Gemma stores them (the ``w`` of ``1 + w``). Gemma 3's multimodal
checkpoints keep the language model under ``model.language_model.`` (transformers 5) or
``language_model.model.`` (the released files); both are read, and the vision tower is
ignored. Written back as a text-only ``Gemma3ForCausalLM`` layout."""

PHI3 = Table(
    rules=(
        _EMBED,
        Rule(L + "input_layernorm.weight", B + "attn_norm.scale"),
        Rule(
            L + "self_attn.qkv_proj.weight", tuple(f"{B}attn.{x}_proj.kernel" for x in "qkv"), transpose=True
        ),
        Rule(L + "self_attn.o_proj.weight", B + "attn.out_proj.kernel", transpose=True),
        Rule(L + "post_attention_layernorm.weight", B + "mlp_norm.scale"),
        Rule(L + "mlp.gate_up_proj.weight", (B + "mlp.gate.kernel", B + "mlp.up.kernel"), transpose=True),
        Rule(L + "mlp.down_proj.weight", B + "mlp.down.kernel", transpose=True),
        _FINAL_NORM,
        _HEAD,
    ),
    ignore=(_ROTARY, r"lm_head\.weight"),
)
"""Phi-3: the fused ``qkv_proj`` ``[(N + 2K) H, D]`` splits, after the transpose, into q, k
and v along its last axis (as GPT-2's ``c_attn``), and ``gate_up_proj`` ``[2F, D]`` into
gate then up (``chunk(2)`` order); the reverse concatenates them."""

_QKV = tuple(f"{B}attn.{x}_proj" for x in "qkv")
GPT2 = Table(
    rules=(
        Rule("transformer.wte.weight", "embed.embedding"),
        Rule("transformer.wpe.weight", "pos_embed.embedding"),
        Rule("transformer.h.{i}.ln_1.weight", B + "attn_norm.scale"),
        Rule("transformer.h.{i}.ln_1.bias", B + "attn_norm.bias"),
        Rule("transformer.h.{i}.attn.c_attn.weight", tuple(p + ".kernel" for p in _QKV)),
        Rule("transformer.h.{i}.attn.c_attn.bias", tuple(p + ".bias" for p in _QKV)),
        Rule("transformer.h.{i}.attn.c_proj.weight", B + "attn.out_proj.kernel"),
        Rule("transformer.h.{i}.attn.c_proj.bias", B + "attn.out_proj.bias"),
        Rule("transformer.h.{i}.ln_2.weight", B + "mlp_norm.scale"),
        Rule("transformer.h.{i}.ln_2.bias", B + "mlp_norm.bias"),
        Rule("transformer.h.{i}.mlp.c_fc.weight", B + "mlp.up.kernel"),
        Rule("transformer.h.{i}.mlp.c_fc.bias", B + "mlp.up.bias"),
        Rule("transformer.h.{i}.mlp.c_proj.weight", B + "mlp.down.kernel"),
        Rule("transformer.h.{i}.mlp.c_proj.bias", B + "mlp.down.bias"),
        Rule("transformer.ln_f.weight", "final_norm.scale"),
        Rule("transformer.ln_f.bias", "final_norm.bias"),
        Rule("lm_head.weight", "head.kernel", transpose=True),
    ),
    ignore=(r"(transformer\.)?h\.\d+\.attn\.(masked_)?bias", r"lm_head\.weight"),
    optional_prefix="transformer.",
)
"""GPT-2: ``Conv1D`` weights are already ``[in, out]`` (no transpose); the fused ``c_attn``
splits into q, k and v; the causal-mask buffers ``attn.bias``/``attn.masked_bias`` of
older checkpoints are ignored, as is the tied head."""

SEED_BLOCK = Table(
    rules=(
        Rule("ln1.weight", "attn_norm.scale"),
        Rule("ln1.bias", "attn_norm.bias"),
        *(
            Rule(f"{name}.{kind}", f"attn.{name}.{param}", kind == "weight")
            for name in ("q_proj", "k_proj", "v_proj", "out_proj")
            for kind, param in (("weight", "kernel"), ("bias", "bias"))
        ),
        Rule("ln2.weight", "mlp_norm.scale"),
        Rule("ln2.bias", "mlp_norm.bias"),
        Rule("ffn.0.weight", "mlp.up.kernel", transpose=True),
        Rule("ffn.0.bias", "mlp.up.bias"),
        Rule("ffn.2.weight", "mlp.down.kernel", transpose=True),
        Rule("ffn.2.bias", "mlp.down.bias"),
    )
)
"""The seed block: ``ln1`` -> attention -> ``out_proj`` -> residual, ``ln2`` -> ``ffn.0`` ->
GELU -> ``ffn.2`` -> residual (``_forward_impl``). Its target is one ``nn.Block``."""


def seed_block_config(hidden_dim: int, num_heads: int, **overrides) -> TransformerConfig:
    """The ``TransformerConfig`` of ``FlashAttentionWithCheckpoint(hidden_dim, num_heads)``.

    One layer, LayerNorm (eps 1e-5), biased projections, exact GELU, a 4x MLP, no
    positions and non-causal attention.

    Example:
        >>> cfg = seed_block_config(12, 3)
        >>> cfg.ffn_dim, cfg.activation, cfg.causal
        (48, 'gelu', False)
    """
    fields = dict(
        family="gpt2",
        vocab_size=1,
        d_model=hidden_dim,
        n_layers=1,
        n_heads=num_heads,
        ffn_dim=4 * hidden_dim,
        norm_eps=1e-5,
        activation="gelu",
        positions="none",
        causal=False,
        attention_bias=True,
        mlp_bias=True,
    )
    return TransformerConfig(**{**fields, **overrides})


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One convertible architecture.

    Attributes:
        name: its key in ``ARCHITECTURES`` and the config's ``family``. table: its rules.
        model_type: the Hugging Face ``model_type`` it writes (None for the seed block,
            which has no config.json). model_types: every ``model_type`` it reads.
        block: the model is one ``nn.Block`` (the seed) rather than an ``nn.Transformer``.
        hf_config: ``TransformerConfig -> config.json`` dict (None: no HF layout).
        read: ``(config.json dict, notes) -> TransformerConfig fields`` (None: no HF layout).

    Example:
        >>> import torch_bridge
        >>> arch = torch_bridge.architecture("gpt2")
        >>> arch.name, arch.model_type, arch.block
        ('gpt2', 'gpt2', False)
    """

    name: str
    table: Table
    model_type: str | None = None
    block: bool = False
    hf_config: Callable[[TransformerConfig], dict] | None = None
    read: Callable[[dict, list], dict] | None = None
    model_types: tuple[str, ...] = ()

    def __post_init__(self):
        if self.model_type is not None and not self.model_types:
            object.__setattr__(self, "model_types", (self.model_type,))


def _family(name: str, table: Table, *also: str) -> Architecture:
    """The entry of the Hugging Face family ``name``: its model_type is its name, it reads
    ``also`` too, and its reader and writer are ``hf._readers.<name>_config`` and
    ``hf._writers.<name>_hf_config``."""
    read, write = getattr(readers, f"{name}_config"), getattr(writers, f"{name}_hf_config")
    return Architecture(name, table, name, hf_config=write, read=read, model_types=(name, *also))


ARCHITECTURES = {
    "llama": _family("llama", LLAMA),  # Llama 2 and 3.x, SmolLM2
    "mistral": _family("mistral", LLAMA),
    "qwen2": _family("qwen2", LLAMA),
    "qwen3": _family("qwen3", LLAMA),
    "smollm3": _family("smollm3", LLAMA),
    "gemma2": _family("gemma2", GEMMA),
    "gemma3": _family("gemma3", GEMMA, "gemma3_text"),
    "phi3": _family("phi3", PHI3),
    "gpt2": _family("gpt2", GPT2),
    "seed-block": Architecture("seed-block", SEED_BLOCK, block=True),
}
"""The registry: name (``jaxckpt convert --arch``, the config's ``family``) -> ``Architecture``.
A new family is one entry here (its model_types, reader, writer and rule table) and, only
if it brings a new op, a change to ``jaxckpt.nn``."""


def architecture(name: str) -> Architecture:
    """The architecture called ``name`` (a key of ``ARCHITECTURES``).

    Raises:
        ValueError: for an unknown name, listing the known ones.

    Example:
        >>> architecture("llama").model_type
        'llama'
        >>> architecture("bert")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: unknown architecture 'bert'; torch_bridge converts llama, mistral, ..., gpt2, seed-block
    """
    if name not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {name!r}; torch_bridge converts {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[name]


def architecture_of(hf_config: dict, source: str = "config.json") -> Architecture:
    """The architecture of a Hugging Face config dict, from its ``model_type``.

    Raises:
        ValueError: naming ``source`` and the model_type when it is not supported.

    Example:
        >>> architecture_of({"model_type": "gemma3_text"}).name
        'gemma3'
    """
    model_type = hf_config.get("model_type")
    for arch in ARCHITECTURES.values():
        if model_type in arch.model_types:
            return arch
    known = ", ".join(t for a in ARCHITECTURES.values() for t in a.model_types)
    raise ValueError(
        f"{source}: unknown architecture model_type={model_type!r}: no jaxckpt family reads it; "
        f"torch_bridge reads {known}"
    )
