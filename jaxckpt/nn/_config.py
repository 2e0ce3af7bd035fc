"""``TransformerConfig``: the sizes and choices of a decoder, with named presets."""

import dataclasses
from types import MappingProxyType

import jax.numpy as jnp

from jaxckpt._checks import require_positive_int
from jaxckpt._sizes import parse_size
from jaxckpt.remat import AUTO, RematSpec
from jaxckpt.remat import get as get_remat

FAMILY_DEFAULTS = MappingProxyType(
    {
        "llama": {"norm": "rms", "activation": "swiglu", "positions": "rope"},
        "gpt2": {"norm": "layer", "activation": "gelu_tanh", "positions": "learned"},
    }
)
"""Per family, the norm, MLP activation and position scheme it uses unless overridden."""

NORMS = ("rms", "layer")
ACTIVATIONS = ("swiglu", "gelu_tanh", "gelu")
POSITIONS = ("rope", "learned", "none")
DTYPES = ("float32", "bfloat16", "float16")
_DERIVED = ("n_kv_heads", "head_dim", "norm", "activation", "positions")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Sizes and choices of a pre-norm decoder-only transformer.

    ``norm``, ``activation`` and ``positions`` default to the family's
    (``FAMILY_DEFAULTS``); ``n_kv_heads`` defaults to ``n_heads`` and ``head_dim``
    to ``d_model // n_heads``.

    Attributes:
        family: ``"llama"`` (RMSNorm, SwiGLU, RoPE) or ``"gpt2"`` (LayerNorm, GELU-tanh,
            learned positions).
        vocab_size, d_model, n_layers, n_heads, n_kv_heads, head_dim, ffn_dim, max_len: sizes.
        norm_eps: epsilon of every norm. rope_theta: RoPE base.
        attention_bias: bias on the q, k, v and output projections. mlp_bias: on the MLP.
        tie_embeddings: the head reuses the token embedding.
        causal: causal self-attention (a decoder); False attends to every position (the
            seed article's block).
        dtype: compute dtype. param_dtype: storage dtype of the parameters.
        attention: ``flash_attention`` implementation (None = automatic).
        remat: a ``jaxckpt.remat`` preset name or ``RematSpec``, or ``"auto"``:
            ``jaxckpt.plan.resolve_auto`` picks the spec of least recompute that fits
            ``budget`` before training (it needs the batch and sequence length);
            ``train.train`` refuses an unresolved ``"auto"``.
        budget: device memory for ``remat="auto"``: bytes, or text such as ``"30GiB"``.

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
    attention: str | None = None
    remat: str | RematSpec = "full"
    budget: int | str | None = None
    norm: str | None = None
    activation: str | None = None
    positions: str | None = None
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
        if self.positions == "rope" and self.head_dim % 2:
            raise ValueError(f"TransformerConfig: RoPE needs an even head_dim, got {self.head_dim}")
        _choice("norm", self.norm, NORMS)
        _choice("activation", self.activation, ACTIVATIONS)
        _choice("positions", self.positions, POSITIONS)
        _choice("dtype", self.dtype, DTYPES)
        _choice("param_dtype", self.param_dtype, DTYPES)
        if not self.norm_eps > 0:
            raise ValueError(f"TransformerConfig: norm_eps must be > 0, got {self.norm_eps}")
        if self.budget is not None:
            object.__setattr__(self, "budget", parse_size(self.budget, "TransformerConfig: budget"))
        if self.remat == AUTO:
            if self.budget is None:
                raise ValueError("TransformerConfig: remat='auto' needs a budget (bytes, or e.g. '30GiB')")
        else:
            get_remat(self.remat)

    @property
    def remat_spec(self) -> RematSpec:
        """``remat`` as a ``RematSpec``."""
        return get_remat(self.remat)

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
        if isinstance(self.remat, RematSpec):
            out["remat"] = repr(self.remat)
        return out

    @classmethod
    def from_dict(cls, fields: dict) -> "TransformerConfig":
        """The config that ``to_dict`` wrote. A custom ``RematSpec`` (written as its repr)
        comes back as ``"full"``: remat does not change the numbers, only memory and time.

        Raises:
            ValueError: naming any field that ``TransformerConfig`` does not have.

        Example:
            >>> cfg = TransformerConfig.preset("tiny")
            >>> TransformerConfig.from_dict(cfg.to_dict()) == cfg
            True
        """
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(
                f"TransformerConfig: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        fields = dict(fields)
        if isinstance(fields.get("remat"), str) and fields["remat"].startswith("RematSpec("):
            fields["remat"] = "full"
        return cls(**fields)

    @classmethod
    def preset(cls, name: str, **overrides) -> "TransformerConfig":
        """A named configuration (see ``PRESETS``), with ``overrides`` applied.

        Raises:
            ValueError: for an unknown name (the message lists the presets).
        """
        if name not in PRESETS:
            raise ValueError(f"unknown config preset {name!r}; valid presets: {', '.join(PRESETS)}")
        return PRESETS[name].replace(**overrides)


def _choice(name: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"TransformerConfig: {name}={value!r} is not one of {', '.join(map(str, choices))}")


_LLAMA2 = dict(family="llama", vocab_size=32000, max_len=4096, dtype="bfloat16", norm_eps=1e-5)

PRESETS: MappingProxyType[str, TransformerConfig] = MappingProxyType(
    {
        "tiny": TransformerConfig(n_kv_heads=2),
        "small": TransformerConfig(d_model=512, n_layers=8, n_heads=8, ffn_dim=1376, max_len=2048),
        "gpt2": TransformerConfig(
            family="gpt2",
            vocab_size=50257,
            d_model=768,
            n_layers=12,
            n_heads=12,
            ffn_dim=3072,
            attention_bias=True,
            mlp_bias=True,
            tie_embeddings=True,
        ),
        "llama2-7b": TransformerConfig(**_LLAMA2, d_model=4096, n_layers=32, n_heads=32, ffn_dim=11008),
        "llama2-13b": TransformerConfig(**_LLAMA2, d_model=5120, n_layers=40, n_heads=40, ffn_dim=13824),
        "llama3-8b": TransformerConfig(
            family="llama",
            vocab_size=128256,
            d_model=4096,
            n_layers=32,
            n_heads=32,
            n_kv_heads=8,
            ffn_dim=14336,
            max_len=8192,
            rope_theta=500000.0,
            dtype="bfloat16",
        ),
    }
)
"""Named configurations. ``tiny`` and ``small`` use a 256-token byte vocabulary and
fp32; the published models compute in bf16 with fp32 parameters."""
