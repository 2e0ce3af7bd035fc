"""``TransformerConfig``: the sizes and choices of a decoder, with named presets."""

import dataclasses
from types import MappingProxyType

import jax.numpy as jnp

from jaxckpt._checks import known_fields, require_positive_int
from jaxckpt.nn._choices import LAYER_KINDS, Activation, LayerKind, Norm, Positions
from jaxckpt.nn._lora import LoraConfig
from jaxckpt.nn._presets import PRESET_FIELDS
from jaxckpt.nn._rope_scaling import RopeScaling

FAMILY_DEFAULTS = MappingProxyType(
    {
        "llama": {"norm": Norm.RMS, "activation": Activation.SWIGLU, "positions": Positions.ROPE},
        "gpt2": {"norm": Norm.LAYER, "activation": Activation.GELU_TANH, "positions": Positions.LEARNED},
        "qwen2": {"norm": Norm.RMS, "activation": Activation.SWIGLU, "positions": Positions.ROPE},
        "qwen3": {"norm": Norm.RMS, "activation": Activation.SWIGLU, "positions": Positions.ROPE},
        "mistral": {"norm": Norm.RMS, "activation": Activation.SWIGLU, "positions": Positions.ROPE},
        "gemma2": {"norm": Norm.GEMMA_RMS, "activation": Activation.GEGLU_TANH, "positions": Positions.ROPE},
        "gemma3": {"norm": Norm.GEMMA_RMS, "activation": Activation.GEGLU_TANH, "positions": Positions.ROPE},
        "phi3": {"norm": Norm.RMS, "activation": Activation.SWIGLU, "positions": Positions.ROPE},
        "smollm3": {"norm": Norm.RMS, "activation": Activation.SWIGLU, "positions": Positions.ROPE},
    }
)
"""Per family (the Hugging Face layout ``torch_bridge`` reads and writes), the norm, MLP
activation and position scheme it uses unless overridden. Everything else a family
needs (q/k norm, soft caps, the layer pattern...) is a field of its own."""

DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes a config computes (``dtype``) and stores (``param_dtype``) in."""
QUANTIZATIONS = ("nf4", "int8")
"""``quantize_base`` choices: 4-bit NormalFloat (QLoRA's) and 8-bit integers, per-block scales."""
RUN_FIELDS = ("remat", "attention", "budget")
"""Fields of configs written before the memory choices moved to ``train.RunConfig``."""
_MLP_TARGETS = ("gate", "up", "down")
"""The LoRA targets inside the MLP (``LORA_TARGETS``), whose dropout ``mlp_chunk`` refuses."""
_DERIVED = ("n_kv_heads", "head_dim", "norm", "activation", "positions", "attention_out_bias")
_ENUMS = {"norm": Norm, "activation": Activation, "positions": Positions}


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Sizes and choices of a pre-norm decoder-only transformer.

    ``norm``, ``activation`` and ``positions`` default to the family's
    (``FAMILY_DEFAULTS``); ``n_kv_heads`` defaults to ``n_heads``, ``head_dim``
    to ``d_model // n_heads`` and ``attention_out_bias`` to ``attention_bias``.

    Attributes:
        family: the Hugging Face layout (``FAMILY_DEFAULTS``): ``"llama"``, ``"gpt2"``,
            ``"qwen2"``, ``"qwen3"``, ``"mistral"``, ``"gemma2"``, ``"gemma3"``, ``"phi3"``,
            ``"smollm3"``.
        vocab_size, d_model, n_layers, n_heads, n_kv_heads, head_dim, ffn_dim, max_len: sizes.
        norm_eps: epsilon of every norm. rope_theta: RoPE base.
        attention_bias: bias on the q, k, v (and, unless ``attention_out_bias`` says
            otherwise, output) projections. mlp_bias: on the MLP.
        tie_embeddings: the head reuses the token embedding.
        causal: causal self-attention (a decoder); False attends to every position (the
            seed article's block).
        dtype: compute dtype. param_dtype: storage dtype of the parameters.
        norm, activation, positions: ``Norm``, ``Activation``, ``Positions`` (strings accepted).
        rope_scaling: a ``RopeScaling`` (or its dict) of the full-attention layers; None: plain RoPE.
        rotary_fraction: the fraction of each head's dims that RoPE rotates (Phi-3's
            ``partial_rotary_factor``); the rest passes through.
        local_rope_theta: the RoPE base of sliding layers, unscaled (Gemma 3); None:
            ``rope_theta`` and ``rope_scaling`` as every other layer.
        sliding_window: the keys a sliding layer sees, itself included (Hugging Face's
            ``sliding_window``); None: sliding layers see every key.
        layer_pattern: ``LAYER_KINDS`` names, cycled over the stack: ``("sliding", "full")``
            alternates (Gemma 2). The stack stays one scan over repeats of the pattern.
        qk_norm: a norm over ``head_dim`` on each query and key head, before RoPE (Qwen3, Gemma 3).
        post_norms: two more norms per layer, on the attention and MLP outputs before their
            residual adds (Gemma 2 and 3).
        embed_scale: the embeddings are multiplied by ``sqrt(d_model)`` (Gemma).
        attention_scale: the scale of ``q.k``; None: ``head_dim ** -0.5``.
        attention_softcap: ``cap * tanh(logits / cap)`` on the attention logits (Gemma 2).
        logits_softcap: the same on the output logits (Gemma 2).
        lora: a ``LoraConfig`` (or its dict, or a rank): adapters on its target
            projections, and only they train; None: every parameter trains.
        quantize_base: ``"nf4"`` or ``"int8"``: the frozen base's projection kernels are
            stored quantized, with per-block scales (QLoRA; needs ``lora``); None: stored
            in ``param_dtype``.
        mlp_chunk: the MLP runs over chunks of this many tokens of each sequence, each
            chunk recomputed in the backward pass, which then holds one chunk's
            intermediates instead of T's (see ``MLP``; the numbers are the
            untiled MLP's); None: untiled. It cannot be combined with LoRA dropout on an
            MLP projection (``lora.dropout`` with a ``gate``, ``up`` or ``down`` target).

    Example:
        >>> from jaxckpt.nn import TransformerConfig
        >>> cfg = TransformerConfig.preset("tiny", n_layers=2)
        >>> cfg.n_layers, cfg.norm, cfg.head_dim
        (2, 'rms', 32)
    """

    family: str = "llama"
    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    head_dim: int | None = None
    ffn_dim: int = 344
    max_len: int = 1024
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_embeddings: bool = False
    causal: bool = True
    dtype: str = "float32"
    param_dtype: str = "float32"
    norm: str | None = None
    activation: str | None = None
    positions: str | None = None
    attention_out_bias: bool | None = None
    rope_scaling: RopeScaling | dict | None = None
    rotary_fraction: float = 1.0
    local_rope_theta: float | None = None
    sliding_window: int | None = None
    layer_pattern: tuple[str, ...] = ("full",)
    qk_norm: bool = False
    post_norms: bool = False
    embed_scale: bool = False
    attention_scale: float | None = None
    attention_softcap: float | None = None
    logits_softcap: float | None = None
    lora: LoraConfig | dict | int | None = None
    quantize_base: str | None = None
    mlp_chunk: int | None = None
    _derived: frozenset = dataclasses.field(default=frozenset(), init=False, repr=False, compare=False)
    """The fields given as None and filled in here; ``replace`` derives them afresh."""

    def __post_init__(self):
        _choice("family", self.family, tuple(FAMILY_DEFAULTS))
        derived = {name for name in _DERIVED if getattr(self, name) is None}
        object.__setattr__(self, "_derived", frozenset(derived))
        for name, value in FAMILY_DEFAULTS[self.family].items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.attention_out_bias is None:
            object.__setattr__(self, "attention_out_bias", self.attention_bias)
        for name, enum in _ENUMS.items():
            _set_choice(self, name, enum)
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_len"):
            require_positive_int(name, getattr(self, name), "TransformerConfig: ")
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ValueError(
                    f"TransformerConfig: d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                    "set head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        require_positive_int("head_dim", self.head_dim, "TransformerConfig: ")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"TransformerConfig: n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads} (GQA)"
            )
        self._check_positions()
        self._check_attention()
        object.__setattr__(self, "lora", LoraConfig.of(self.lora))
        if self.quantize_base is not None:
            _choice("quantize_base", self.quantize_base, QUANTIZATIONS)
            if self.lora is None:
                raise ValueError(
                    f"TransformerConfig: quantize_base={self.quantize_base!r} freezes a quantized base, "
                    "which needs LoRA adapters to train: set lora"
                )
        _choice("dtype", self.dtype, DTYPES)
        _choice("param_dtype", self.param_dtype, DTYPES)
        self._check_mlp_chunk()
        if not self.norm_eps > 0:
            raise ValueError(f"TransformerConfig: norm_eps must be > 0, got {self.norm_eps}")

    def _check_positions(self) -> None:
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling.from_dict(self.rope_scaling))
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise TypeError(
                f"TransformerConfig: rope_scaling={self.rope_scaling!r} must be a RopeScaling or dict"
            )
        if not 0 < self.rotary_fraction <= 1:
            raise ValueError(f"TransformerConfig: rotary_fraction={self.rotary_fraction} must be in (0, 1]")
        if self.positions == Positions.ROPE and self.rotary_dim % 2:
            raise ValueError(
                f"TransformerConfig: RoPE needs an even rotary dim, got {self.rotary_dim} "
                f"(head_dim={self.head_dim} x rotary_fraction={self.rotary_fraction})"
            )
        pattern = (self.layer_pattern,) if isinstance(self.layer_pattern, str) else tuple(self.layer_pattern)
        object.__setattr__(self, "layer_pattern", pattern)
        bad = [kind for kind in pattern if kind not in LAYER_KINDS]
        if not pattern or bad:
            raise ValueError(
                f"TransformerConfig: layer_pattern={pattern!r}: each entry must be one of "
                + ", ".join(LAYER_KINDS)
            )

    def _check_attention(self) -> None:
        if self.sliding_window is not None:
            require_positive_int("sliding_window", self.sliding_window, "TransformerConfig: ")
        for name in ("attention_scale", "attention_softcap", "logits_softcap", "local_rope_theta"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int | float) and value > 0):
                raise ValueError(f"TransformerConfig: {name}={value!r} must be a positive number or None")

    def _check_mlp_chunk(self) -> None:
        if self.mlp_chunk is None:
            return
        require_positive_int("mlp_chunk", self.mlp_chunk, "TransformerConfig: ")
        lora = self.lora
        adapted = () if lora is None else [t for t in lora.targets if t in _MLP_TARGETS]
        if adapted and lora.dropout > 0:
            raise ValueError(
                f"TransformerConfig: mlp_chunk={self.mlp_chunk} tiles the MLP, and lora.dropout="
                f"{lora.dropout} would draw other dropout masks per chunk on its adapted projections "
                f"{adapted}: set lora.dropout=0, drop {', '.join(adapted)} from lora.targets, or "
                "leave the MLP untiled"
            )

    @property
    def rotary_dim(self) -> int:
        """The dims of each head that RoPE rotates: ``head_dim * rotary_fraction``."""
        return int(self.head_dim * self.rotary_fraction)

    @property
    def layer_kinds(self) -> "tuple[LayerKind, ...]":
        """One ``LayerKind`` per layer: ``layer_pattern`` cycled over ``n_layers``."""
        pattern = self.layer_pattern
        return tuple(LAYER_KINDS[pattern[i % len(pattern)]] for i in range(self.n_layers))

    @property
    def compute_dtype(self) -> jnp.dtype:
        """``dtype`` as a numpy dtype."""
        return jnp.dtype(self.dtype)

    @property
    def storage_dtype(self) -> jnp.dtype:
        """``param_dtype`` as a numpy dtype."""
        return jnp.dtype(self.param_dtype)

    def replace(self, **changes) -> "TransformerConfig":
        """A copy with ``changes`` applied (and validated).

        Fields that were derived (``n_kv_heads``, ``head_dim``, and the family's
        ``norm``/``activation``/``positions``) are derived again from the new values
        unless ``changes`` sets them.
        """
        kwargs = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        kwargs.update(dict.fromkeys(self._derived))
        return TransformerConfig(**{**kwargs, **changes})

    def to_dict(self) -> dict:
        """The fields as plain JSON-friendly values (a spec is shown by its repr)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        for name in _ENUMS:
            out[name] = out[name].value
        if self.rope_scaling is not None:
            out["rope_scaling"] = self.rope_scaling.to_dict()
        out["layer_pattern"] = list(self.layer_pattern)
        if self.lora is not None:
            out["lora"] = self.lora.to_dict()
        return out

    @classmethod
    def from_dict(cls, fields: dict) -> "TransformerConfig":
        """The config that ``to_dict`` wrote. ``remat``, ``attention`` and ``budget``, which
        configs written before they moved to ``train.RunConfig`` hold, are run settings now
        (they change memory and time, never the numbers) and are not read here.

        Raises:
            ValueError: naming any field that ``TransformerConfig`` does not have.

        Example:
            >>> cfg = TransformerConfig.preset("tiny")
            >>> TransformerConfig.from_dict(cfg.to_dict()) == cfg
            True
        """
        fields = {k: v for k, v in fields.items() if k not in RUN_FIELDS}
        return cls(**known_fields(cls, fields, "TransformerConfig"))

    @classmethod
    def preset(cls, name: str, **overrides) -> "TransformerConfig":
        """A named configuration (see ``PRESETS``), with ``overrides`` applied.

        Raises:
            ValueError: for an unknown name (the message lists the presets).
        """
        if name not in PRESETS:
            raise ValueError(f"unknown config preset {name!r}; valid presets: {', '.join(PRESETS)}")
        return PRESETS[name].replace(**overrides)


def _set_choice(cfg: TransformerConfig, name: str, enum: type) -> None:
    """Turns the string field ``name`` into its ``enum`` member, or raises naming it."""
    try:
        object.__setattr__(cfg, name, enum(getattr(cfg, name)))
    except ValueError:
        known = ", ".join(e.value for e in enum)
        raise ValueError(f"TransformerConfig: {name}={getattr(cfg, name)!r} is not one of {known}") from None


def _choice(name: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"TransformerConfig: {name}={value!r} is not one of {', '.join(map(str, choices))}")


PRESETS: MappingProxyType[str, TransformerConfig] = MappingProxyType(
    {name: TransformerConfig(**fields) for name, fields in PRESET_FIELDS.items()}
)
"""Named configurations (their fields: ``jaxckpt.nn._presets``). ``tiny`` and ``small`` use
a 256-token byte vocabulary and fp32; the published models compute in bf16 with fp32
parameters, and their parameter counts equal the published ones."""
