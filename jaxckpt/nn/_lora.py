"""LoRA: low-rank adapters on chosen projections, over a frozen base.

An adapted projection is ``nnx.Linear`` plus flax's ``nnx.LoRA`` (``x @ a @ b``, its
two matrices ``nnx.LoRAParam``), scaled by ``alpha / rank``, with dropout on the
adapter's input. ``b`` starts at zero, so a fresh adapter leaves the model's output
unchanged. Training then differentiates and optimises ``nnx.LoRAParam`` only
(``trainable``): the base is part of the frozen state, with no gradient and no optimizer
state.
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxckpt._checks import require_positive_int

LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
"""The projections an adapter may go on: attention's q, k, v and output, the MLP's gate, up, down."""

HF_MODULES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj"}
HF_MODULES = {**HF_MODULES, "up": "up_proj", "down": "down_proj"}
"""Each target's module name in Hugging Face LLaMA-family models (PEFT's ``target_modules``)."""

LORA_RANK = "lora_rank"
"""The logical name of an adapter's rank axis (never split: it is small)."""


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Adapters of rank ``rank`` on the projections ``targets``.

    Attributes:
        rank: r, the inner size of each adapter ``a [d_in, r] @ b [r, d_out]``.
        alpha: the adapter's output is scaled by ``alpha / rank``; None: ``alpha = rank``
            (scale 1).
        targets: names from ``LORA_TARGETS`` (a comma-separated string is accepted).
        dropout: dropout rate on each adapter's input while training (0: none).
        dtype: the adapters' storage dtype, whatever the base's.

    Example:
        >>> from jaxckpt.nn import LoraConfig
        >>> lora = LoraConfig(rank=8, alpha=16, targets="q,v")
        >>> lora.targets, lora.scale
        (('q', 'v'), 2.0)
    """

    rank: int
    alpha: float | None = None
    targets: tuple[str, ...] = ("q", "k", "v", "o")
    dropout: float = 0.0
    dtype: str = "float32"

    def __post_init__(self):
        require_positive_int("rank", self.rank, "LoraConfig: ")
        targets = self.targets.split(",") if isinstance(self.targets, str) else self.targets
        targets = tuple(t.strip() for t in targets)
        bad = [t for t in targets if t not in LORA_TARGETS]
        if not targets or bad or len(set(targets)) != len(targets):
            raise ValueError(
                f"LoraConfig: targets={self.targets!r} must be distinct names from {', '.join(LORA_TARGETS)}"
            )
        object.__setattr__(self, "targets", targets)
        if self.alpha is None:
            object.__setattr__(self, "alpha", float(self.rank))
        if not (isinstance(self.alpha, int | float) and self.alpha > 0):
            raise ValueError(f"LoraConfig: alpha={self.alpha!r} must be a positive number")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"LoraConfig: dropout={self.dropout!r} must be in [0, 1)")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"LoraConfig: dtype={self.dtype!r} is not one of float32, bfloat16, float16")

    @property
    def scale(self) -> float:
        """``alpha / rank``, the factor on every adapter's output."""
        return self.alpha / self.rank

    def to_dict(self) -> dict:
        """The fields as JSON values (``LoraConfig(**d)`` reads them back)."""
        return {**dataclasses.asdict(self), "targets": list(self.targets)}

    @classmethod
    def of(cls, value: "LoraConfig | dict | int | None") -> "LoraConfig | None":
        """``value`` as a config: a config, its dict, a rank, or None (no adapters)."""
        if value is None or isinstance(value, LoraConfig):
            return value
        if isinstance(value, dict):
            return cls(**value)
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(rank=value)
        raise TypeError(f"lora={value!r} must be a LoraConfig, its dict, a rank (int) or None")


class LoraLinear(nnx.Linear):
    """``nnx.Linear`` plus ``scale * nnx.LoRA(dropout(x))``: ``a`` He-uniform, ``b`` zeros.

    Its state is ``nnx.LoRALinear``'s (``kernel``, ``bias``, ``lora.lora_a``,
    ``lora.lora_b``). ``a_metadata`` / ``b_metadata`` go on the adapter's matrices (their
    logical axes: the kernel's, with ``lora_rank`` for the rank axis).

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> layer = LoraLinear(3, 4, lora=LoraConfig(rank=2), rngs=nnx.Rngs(0))
        >>> bool(jnp.allclose(layer(jnp.ones((1, 3))), jnp.ones((1, 3)) @ layer.kernel[...]))  # b = 0
        True
    """

    def __init__(
        self, d_in: int, d_out: int, *, lora: LoraConfig, rngs, a_metadata=None, b_metadata=None, **linear
    ):
        super().__init__(d_in, d_out, rngs=rngs, **linear)
        self.lora = adapter(d_in, d_out, lora, linear.get("dtype"), rngs, a_metadata, b_metadata)
        self.scale = lora.scale
        self.rate = lora.dropout

    def __call__(self, x: jax.Array, *, dropout_key: jax.Array | None = None) -> jax.Array:
        """``x [..., d_in] -> [..., d_out]``; dropout on the adapter's input only when a
        ``dropout_key`` is given (training) and the rate is positive."""
        return add_adapter(self, x, super().__call__(x), dropout_key)


def adapter(
    d_in: int, d_out: int, lora: LoraConfig, dtype, rngs, a_metadata=None, b_metadata=None
) -> nnx.LoRA:
    """The ``nnx.LoRA`` of a ``[d_in, d_out]`` projection: ``a`` He-uniform, ``b`` zeros,
    stored in ``lora.dtype``, computing in ``dtype``."""
    return nnx.LoRA(
        d_in,
        lora.rank,
        d_out,
        dtype=dtype,
        param_dtype=jnp.dtype(lora.dtype),
        rngs=rngs,
        a_metadata=a_metadata or {},
        b_metadata=b_metadata or {},
    )


def add_adapter(layer: nnx.Module, x: jax.Array, y: jax.Array, dropout_key: "jax.Array | None") -> jax.Array:
    """``y + layer.scale * layer.lora(dropout(x))``: the adapter's output added to the base
    projection's ``y``; dropout (rate ``layer.rate``) only when a ``dropout_key`` is given."""
    if dropout_key is not None and layer.rate > 0:
        keep = jax.random.bernoulli(dropout_key, 1.0 - layer.rate, x.shape)
        x = jnp.where(keep, x / (1.0 - layer.rate), 0).astype(x.dtype)
    return y + (layer.lora(x) * layer.scale).astype(y.dtype)


def project(layer: nnx.Linear, x: jax.Array, dropout_key: "jax.Array | None", salt: int) -> jax.Array:
    """``layer(x)``; an adapted layer (one with a ``lora`` adapter: ``LoraLinear``, or a
    quantized base's ``QuantizedLinear``) also gets ``fold_in(dropout_key, salt)`` for its
    dropout (each projection of a layer its own ``salt``), when there is a key."""
    if dropout_key is None or getattr(layer, "lora", None) is None:
        return layer(x)
    return layer(x, dropout_key=jax.random.fold_in(dropout_key, salt))


def trainable(config) -> type[nnx.Variable]:
    """The variable type that training differentiates and optimises: ``nnx.LoRAParam``
    when ``config.lora`` is set (the base is frozen), else ``nnx.Param``.

    Example:
        >>> from flax import nnx
        >>> from jaxckpt import nn
        >>> nn.trainable(nn.TransformerConfig.preset("tiny", lora=8)) is nnx.LoRAParam
        True
    """
    return nnx.LoRAParam if config.lora is not None else nnx.Param
