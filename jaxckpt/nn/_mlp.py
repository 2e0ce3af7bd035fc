"""The feed-forward block: SwiGLU, GeGLU-tanh, GELU-tanh or exact GELU, with every tensor tagged;
optionally tiled over the sequence (``TransformerConfig.mlp_chunk``).

Tiling (DeepSpeed ALST's TiledMLP): the MLP acts on each token alone, so it can run over
chunks of the tokens, a ``lax.map`` whose body is a ``jax.checkpoint``. Its backward pass
then recomputes each chunk and holds one chunk's intermediates (gate, up, the activation
and their cotangents, ``[B, chunk, F]`` each) instead of T's. The tags keep their
meaning: the remat policy of the layer around it also decides for the chunk's tagged
values (JAX partially evaluates a checkpoint nested in another by the outer policy), so a
spec that saves ``mlp_up`` saves it, stacked over the chunks ``[n, B, chunk, F]``, and
one that saves none recomputes them chunk by chunk. Without an outer remat (the ``none``
preset) the chunks are still recomputed: that is what tiling is for.
"""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxckpt._tags import tag
from jaxckpt.nn._activation_sharding import constrain
from jaxckpt.nn._choices import GATED, Activation
from jaxckpt.nn._config import TransformerConfig
from jaxckpt.nn._layers import make_dense
from jaxckpt.nn._lora import project
from jaxckpt.remat import Tag

ACTIVATIONS = {
    Activation.SWIGLU: jax.nn.silu,
    Activation.GEGLU_TANH: lambda x: jax.nn.gelu(x, approximate=True),
    Activation.GELU_TANH: lambda x: jax.nn.gelu(x, approximate=True),
    Activation.GELU: lambda x: jax.nn.gelu(x, approximate=False),
}
"""``Activation`` -> its nonlinearity (applied to the gate when the activation is in ``GATED``)."""

TOKENS = ("batch", "seq", "embed")
"""The logical names of the MLP's input and output axes ``[B, T, D]``."""


def tiled_tokens(fn: Callable[[jax.Array], jax.Array], x: jax.Array, chunk: int) -> jax.Array:
    """``fn(x)`` for a token-wise ``fn`` (``[B, c, D] -> [B, c, E]``), run over chunks of
    ``chunk`` tokens of ``x [B, T, D]``, each chunk a ``jax.checkpoint``: the backward pass
    recomputes one chunk at a time and holds only its intermediates.

    Chunk ``j`` holds the tokens ``j, j + n, j + 2n, ...`` (n chunks, strided): when T is
    split over devices (context parallelism), every chunk then spans every device's
    share alike. T that ``chunk`` does not divide is padded with zero tokens, whose
    outputs are dropped (their gradient is zero). Each chunk's input is pinned to
    ``("batch", "seq", "embed")`` (``constrain``), as the untiled input is.

    Args:
        fn: acts on each token alone (an MLP); it may read arrays it closes over.
        x: ``[B, T, D]``.
        chunk: tokens per chunk, a positive int.

    Returns:
        ``[B, T, E]``, equal to ``fn(x)`` up to the rounding of a matmul over fewer rows.

    Raises:
        ValueError: when ``x`` is not ``[B, T, D]`` or ``chunk`` is not a positive int.

    Example:
        >>> import jax.numpy as jnp
        >>> x = jnp.arange(14.0).reshape(1, 7, 2)
        >>> bool(jnp.array_equal(tiled_tokens(lambda c: 2 * c, x, 3), 2 * x))
        True
    """
    if x.ndim != 3:
        raise ValueError(f"tiled_tokens: x must be [B, T, D], got {x.shape=}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"tiled_tokens: chunk={chunk!r} must be a positive int")
    b, t, d = x.shape
    n = -(-t // chunk)
    padded = jnp.pad(x, ((0, 0), (0, n * chunk - t), (0, 0)))
    chunks = jnp.moveaxis(padded.reshape(b, chunk, n, d), 2, 0)  # [n, B, chunk, D], strided
    body = jax.checkpoint(lambda c: fn(constrain(c, *TOKENS)), prevent_cse=False)
    out = jax.lax.map(body, chunks)  # [n, B, chunk, E]
    return jnp.moveaxis(out, 0, 2).reshape(b, n * chunk, out.shape[-1])[:, :t]


class MLP(nnx.Module):
    """``down(act(gate(x)) * up(x))`` for a gated activation (SwiGLU, GeGLU), else ``down(act(up(x)))``.

    With ``cfg.mlp_chunk`` it runs over chunks of that many tokens (``tiled_tokens``; see
    the module) when T exceeds it, with the untiled numbers (fp32: within 1e-6).

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from jaxckpt.nn import MLP, TransformerConfig
        >>> cfg = TransformerConfig(d_model=6, n_heads=3, ffn_dim=10)
        >>> MLP(cfg, rngs=nnx.Rngs(0))(jnp.ones((1, 3, 6))).shape
        (1, 3, 6)
        >>> tiled = MLP(cfg.replace(mlp_chunk=2), rngs=nnx.Rngs(0))
        >>> x = jnp.linspace(-1, 1, 42).reshape(1, 7, 6)
        >>> bool(jnp.allclose(tiled(x), MLP(cfg, rngs=nnx.Rngs(0))(x), rtol=1e-6, atol=1e-7))
        True
    """

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        self.gated = cfg.activation in GATED
        d, f, bias = cfg.d_model, cfg.ffn_dim, cfg.mlp_bias
        self.gate = (
            make_dense(cfg, d, f, bias=bias, rngs=rngs, axes=("embed", "mlp"), target="gate")
            if self.gated
            else None
        )
        self.up = make_dense(cfg, d, f, bias=bias, rngs=rngs, axes=("embed", "mlp"), target="up")
        self.down = make_dense(cfg, f, d, bias=bias, rngs=rngs, axes=("mlp", "embed"), target="down")
        self.activation = cfg.activation
        self.chunk = cfg.mlp_chunk

    def __call__(self, x: jax.Array, *, dropout_key: "jax.Array | None" = None) -> jax.Array:
        """``[B, T, D] -> [B, T, D]``; ``dropout_key``: for the LoRA adapters' dropout (training).

        A tiled MLP has no adapter dropout (``TransformerConfig`` refuses ``mlp_chunk`` with
        it), so the key changes nothing there.
        """
        if self.chunk is None or x.shape[1] <= self.chunk:
            return self._tokens(x, dropout_key)
        return tiled_tokens(functools.partial(self._tokens, dropout_key=None), x, self.chunk)

    def _tokens(self, x: jax.Array, dropout_key: "jax.Array | None") -> jax.Array:
        """The MLP over the tokens of ``x [B, T, D]``, every tensor tagged."""
        hidden_axes = ("batch", "seq", "mlp")
        up = tag(constrain(project(self.up, x, dropout_key, 0), *hidden_axes), Tag.MLP_UP)
        if self.gated:
            gate = tag(constrain(project(self.gate, x, dropout_key, 1), *hidden_axes), Tag.MLP_GATE)
            hidden = ACTIVATIONS[self.activation](gate) * up
        else:
            hidden = ACTIVATIONS[self.activation](up)
        hidden = tag(hidden, Tag.MLP_ACT)
        return tag(project(self.down, hidden, dropout_key, 2), Tag.MLP_DOWN)
