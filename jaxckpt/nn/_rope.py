"""Rotary position embedding, rotate-half convention (as Hugging Face LLaMA)."""

import jax
import jax.numpy as jnp


def rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """``cos`` and ``sin`` tables ``[T, H]`` (fp32) for integer ``positions [T]``.

    Example:
        >>> import jax.numpy as jnp
        >>> cos, sin = rope_tables(jnp.arange(5), head_dim=4, theta=10000.0)
        >>> cos.shape, cos[0].tolist(), sin[0].tolist()  # position 0: no rotation
        ((5, 4), [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0])
    """
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates ``x [B, T, N, H]`` by the tables ``[T, H]``; fp32 math, result in ``x.dtype``.

    Example:
        >>> import jax.numpy as jnp
        >>> cos, sin = rope_tables(jnp.arange(3), 4, 10000.0)
        >>> x = jnp.ones((1, 3, 2, 4))
        >>> bool(jnp.allclose(apply_rope(x, cos, sin)[:, 0], x[:, 0]))  # position 0 is unrotated
        True
    """
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return (x32 * cos + rotated * sin).astype(x.dtype)
