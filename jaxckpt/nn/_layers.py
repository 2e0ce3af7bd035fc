"""Small layers: token embedding, RMSNorm, LayerNorm and the dense projection."""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxckpt.nn._choices import Norm
from jaxckpt.nn._config import TransformerConfig
from jaxckpt.nn._dense import dense_dot_general
from jaxckpt.nn._lora import LORA_RANK, LoraLinear
from jaxckpt.nn._quant import QuantizedLinear

EMBED_INIT = jax.nn.initializers.normal(stddev=0.02)

LOGICAL_AXES = "logical_axes"
"""Parameter metadata key: the logical name of each of the parameter's axes.

The names (``vocab``, ``positions``, ``embed``, ``heads``, ``kv_heads``, ``mlp``, ``head_dim``)
say what an axis means, not where it lives; ``jaxckpt.train``'s logical axis rules
map them to mesh axes. Stacked layers add leading axes, named ``layers`` (see
``logical_axes``).
"""

LAYERS = "layers"
"""The logical name of the stacked-layer (scan) axis."""


def logical_axes(variable: nnx.Variable) -> "tuple[str | None, ...]":
    """One logical name per axis of ``variable``: its ``logical_axes`` metadata, with
    ``layers`` for each leading axis a layer stack added; None for each axis of a
    variable that has no names (optimizer step counts) or fewer axes than names
    (Adafactor's factored moments inherit their parameter's names).

    Example:
        >>> from flax import nnx
        >>> from jaxckpt import nn
        >>> model = nn.Transformer(nn.TransformerConfig.preset("tiny", n_layers=2), rngs=nnx.Rngs(0))
        >>> logical_axes(model.blocks.mlp.up.kernel)
        ('layers', 'embed', 'mlp')
    """
    names = variable.get_metadata().get(LOGICAL_AXES)
    ndim = len(getattr(variable.get_value(), "shape", ()))
    if names is None or len(names) > ndim:  # no names, or a value of fewer axes (a factored moment)
        return (None,) * ndim
    return (LAYERS,) * (ndim - len(names)) + tuple(names)


def _named(initializer, *names: str):
    """``initializer`` whose parameter carries ``names`` as its logical axes."""
    return nnx.with_metadata(initializer, **{LOGICAL_AXES: names})


class Embedding(nnx.Module):
    """Token (or position) embedding table ``[V, D]``; ``attend`` is the tied head.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from jaxckpt.nn import Embedding
        >>> emb = Embedding(11, 6, rngs=nnx.Rngs(0))
        >>> emb(jnp.array([[1, 2, 3]])).shape
        (1, 3, 6)
    """

    def __init__(
        self,
        num: int,
        features: int,
        *,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
        axes: tuple[str, str] = ("vocab", "embed"),
    ):
        value = EMBED_INIT(rngs.params(), (num, features), param_dtype)
        self.embedding = nnx.Param(value, **{LOGICAL_AXES: axes})
        self.dtype = dtype

    def __call__(self, ids: jax.Array) -> jax.Array:
        """Looks up ``ids`` (any integer shape) -> ``ids.shape + (D,)``."""
        return jnp.take(self.embedding[...].astype(self.dtype), ids, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        """``x [..., D] @ embedding.T`` -> ``[..., V]`` (the tied output head)."""
        return x @ self.embedding[...].astype(self.dtype).T


def _along_last(v: jax.Array, ndim: int) -> jax.Array:
    """``v [D]`` reshaped to broadcast against the last axis of an ``ndim``-rank array."""
    return v.reshape((1,) * (ndim - 1) + v.shape)


class RMSNorm(nnx.Module):
    """``x / rms(x) * scale``, computed in fp32 and cast back (as Hugging Face LLaMA).

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxckpt.nn import RMSNorm
        >>> RMSNorm(2, eps=0.0)(jnp.array([[3.0, -3.0]])).tolist()  # rms 3
        [[1.0, -1.0]]
    """

    SCALE_INIT = staticmethod(jnp.ones)
    """The scale's initialiser (the identity)."""

    def __init__(
        self, features: int, *, eps: float, dtype=jnp.float32, param_dtype=jnp.float32, axis: str = "embed"
    ):
        self.scale = nnx.Param(self.SCALE_INIT((features,), param_dtype), **{LOGICAL_AXES: (axis,)})
        self.eps = eps
        self.dtype = dtype

    def normalized(self, x: jax.Array) -> jax.Array:
        """``x / rms(x)`` over the last axis, in fp32."""
        x32 = x.astype(jnp.float32)
        return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Normalizes the last axis of ``x``."""
        return self.normalized(x).astype(self.dtype) * _along_last(self.scale[...].astype(self.dtype), x.ndim)


class LayerNorm(nnx.Module):
    """``(x - mean) / std * scale + bias``, computed in fp32 and cast back.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxckpt.nn import LayerNorm
        >>> LayerNorm(2, eps=0.0)(jnp.array([[1.0, 5.0]])).tolist()  # mean 3, std 2
        [[-1.0, 1.0]]
    """

    def __init__(
        self, features: int, *, eps: float, dtype=jnp.float32, param_dtype=jnp.float32, axis: str = "embed"
    ):
        self.scale = nnx.Param(jnp.ones((features,), param_dtype), **{LOGICAL_AXES: (axis,)})
        self.bias = nnx.Param(jnp.zeros((features,), param_dtype), **{LOGICAL_AXES: (axis,)})
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        """Normalizes the last axis of ``x``."""
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = ((x32 - mean) * jax.lax.rsqrt(var + self.eps)).astype(self.dtype)
        scale, bias = (_along_last(p[...].astype(self.dtype), x.ndim) for p in (self.scale, self.bias))
        return y * scale + bias


class GemmaRMSNorm(RMSNorm):
    """``x / rms(x) * (1 + scale)``, all in fp32 and cast back (as Hugging Face Gemma 2 and 3).

    The scale starts at zero (the identity), as Gemma stores it.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxckpt.nn import GemmaRMSNorm
        >>> GemmaRMSNorm(2, eps=0.0)(jnp.array([[3.0, -3.0]])).tolist()  # rms 3, scale 1 + 0
        [[1.0, -1.0]]
    """

    SCALE_INIT = staticmethod(jnp.zeros)
    """The scale's initialiser (``1 + 0``: the identity)."""

    def __call__(self, x: jax.Array) -> jax.Array:
        """Normalizes the last axis of ``x``."""
        scale = 1.0 + _along_last(self.scale[...].astype(jnp.float32), x.ndim)
        return (self.normalized(x) * scale).astype(self.dtype)


NORMS = {Norm.RMS: RMSNorm, Norm.LAYER: LayerNorm, Norm.GEMMA_RMS: GemmaRMSNorm}
"""``Norm`` -> its module."""


def make_norm(cfg: TransformerConfig, axis: str = "embed") -> RMSNorm | LayerNorm | GemmaRMSNorm:
    """The config's norm over ``d_model`` (``axis="embed"``) or ``head_dim`` (the q/k norms)."""
    features = {"embed": cfg.d_model, "head_dim": cfg.head_dim}[axis]
    return NORMS[cfg.norm](
        features, eps=cfg.norm_eps, dtype=cfg.compute_dtype, param_dtype=cfg.storage_dtype, axis=axis
    )


def make_dense(
    cfg: TransformerConfig,
    d_in: int,
    d_out: int,
    *,
    bias: bool,
    rngs: nnx.Rngs,
    axes: tuple[str, str],
    target: str | None = None,
) -> "nnx.Linear | QuantizedLinear":
    """A ``[d_in, d_out]`` projection in the config's dtypes (kernel init normal(0.02)),
    its axes named ``axes`` (the bias: ``axes[1]``); its matmul is ``dense_dot_general``.
    A ``LoraLinear`` when ``target`` (a ``LORA_TARGETS`` name) is one of ``cfg.lora``'s.
    With ``cfg.quantize_base``, every block projection (``target`` given; not the output
    head) is a ``QuantizedLinear`` of that kind, with an adapter if it is a target."""
    adapted = cfg.lora is not None and target in cfg.lora.targets
    lora_axes = dict(
        a_metadata={LOGICAL_AXES: (axes[0], LORA_RANK)}, b_metadata={LOGICAL_AXES: (LORA_RANK, axes[1])}
    )
    if cfg.quantize_base is not None and target is not None:
        return QuantizedLinear(
            d_in,
            d_out,
            kind=cfg.quantize_base,
            rngs=rngs,
            use_bias=bias,
            dtype=cfg.compute_dtype,
            param_dtype=cfg.storage_dtype,
            kernel_init=EMBED_INIT,
            kernel_metadata={LOGICAL_AXES: axes},
            bias_metadata={LOGICAL_AXES: (axes[1],)},
            lora=cfg.lora if adapted else None,
            **lora_axes,
        )
    linear = dict(
        use_bias=bias,
        dtype=cfg.compute_dtype,
        param_dtype=cfg.storage_dtype,
        kernel_init=_named(EMBED_INIT, *axes),
        bias_init=_named(jax.nn.initializers.zeros, axes[1]),
        dot_general=dense_dot_general,
        rngs=rngs,
    )
    if not adapted:
        return nnx.Linear(d_in, d_out, **linear)
    return LoraLinear(d_in, d_out, lora=cfg.lora, **lora_axes, **linear)
