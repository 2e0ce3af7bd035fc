"""The architectures torch_bridge converts: a rule table and a config translation each.

``ARCHITECTURES`` is the registry, keyed by the architecture's name (``jaxckpt convert --arch``):
``"llama"`` (``LlamaForCausalLM``), ``"gpt2"`` (``GPT2LMHeadModel``) and ``"seed-block"``
(the seed article's ``FlashAttentionWithCheckpoint`` block, one pre-LN layer with
non-causal attention and exact GELU).
"""

import dataclasses
from collections.abc import Callable

from jaxckpt.nn import TransformerConfig
from torch_bridge._hf_config import gpt2_hf_config, llama_hf_config
from torch_bridge._table import Rule, Table

B = "blocks."  # the scanned stack: every per-layer target has a leading layer axis
L = "model.layers.{i}."

LLAMA = Table(
    rules=(
        Rule("model.embed_tokens.weight", "embed.embedding"),
        Rule(L + "input_layernorm.weight", B + "attn_norm.scale"),
        *(
            Rule(f"{L}self_attn.{hf}_proj.{kind}", f"{B}attn.{ours}_proj.{p}", kind == "weight")
            for hf, ours in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "out"))
            for kind, p in (("weight", "kernel"), ("bias", "bias"))
        ),
        Rule(L + "post_attention_layernorm.weight", B + "mlp_norm.scale"),
        *(
            Rule(f"{L}mlp.{hf}_proj.{kind}", f"{B}mlp.{ours}.{param}", kind == "weight")
            for hf, ours in (("gate", "gate"), ("up", "up"), ("down", "down"))
            for kind, param in (("weight", "kernel"), ("bias", "bias"))
        ),
        Rule("model.norm.weight", "final_norm.scale"),
        Rule("lm_head.weight", "head.kernel", transpose=True),
    ),
    ignore=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq", r"lm_head\.weight"),
)
"""LLaMA: ``nn.Linear`` weights are transposed; RoPE needs no permutation (both sides use
the rotate-half convention). A tied head saved anyway (``lm_head.weight``) is ignored."""

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
        name: its key in ``ARCHITECTURES``. table: its rules. model_type: Hugging Face's
            ``model_type`` (None for the seed block, which has no config.json).
        block: the model is one ``nn.Block`` (the seed) rather than an ``nn.Transformer``.
        hf_config: ``TransformerConfig -> config.json`` dict (None: no HF layout).

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


ARCHITECTURES = {
    "llama": Architecture("llama", LLAMA, "llama", hf_config=llama_hf_config),
    "gpt2": Architecture("gpt2", GPT2, "gpt2", hf_config=gpt2_hf_config),
    "seed-block": Architecture("seed-block", SEED_BLOCK, block=True),
}
"""The registry: name (``jaxckpt convert --arch``) -> ``Architecture``. A new architecture is one entry (its
rule table, and its config translation in ``_hf_config``)."""


def architecture(name: str) -> Architecture:
    """The architecture called ``name`` (a key of ``ARCHITECTURES``).

    Raises:
        ValueError: for an unknown name, listing the known ones.

    Example:
        >>> architecture("llama").model_type
        'llama'
        >>> architecture("bert")
        Traceback (most recent call last):
        ...
        ValueError: unknown architecture 'bert'; torch_bridge converts llama, gpt2, seed-block
    """
    if name not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {name!r}; torch_bridge converts {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[name]


def architecture_of(hf_config: dict, source: str = "config.json") -> Architecture:
    """The architecture of a Hugging Face config dict, from its ``model_type``.

    Raises:
        ValueError: naming ``source`` and the model_type when it is not supported.
    """
    model_type = hf_config.get("model_type")
    for arch in ARCHITECTURES.values():
        if arch.model_type is not None and arch.model_type == model_type:
            return arch
    known = ", ".join(a.model_type for a in ARCHITECTURES.values() if a.model_type)
    raise ValueError(f"{source}: unknown architecture model_type={model_type!r}; torch_bridge reads {known}")
