"""Rotary position embedding, rotate-half convention (as Hugging Face LLaMA), with the
frequency scalings of ``RopeScaling`` and partial rotary (as Phi-3: the first ``rotary_dim``
dims of each head are rotated, the rest pass through)."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxckpt.nn._rope_scaling import RopeScaling, inv_frequencies


def rope_tables(
    positions: jax.Array,
    rotary_dim: int,
    theta: float,
    scaling: RopeScaling | None = None,
    *,
    max_len: int | None = None,
    seq_len: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``cos`` and ``sin`` tables ``[T, rotary_dim]`` (fp32) for integer ``positions [T]``.

    The frequencies are static (``inv_frequencies``); ``positions`` may be traced. As in
    Hugging Face, the attention factor of yarn and longrope multiplies cos and sin.

    Args:
        positions: ``[T]`` integer positions (any leading dims give tables ``[..., T, R]``).
        rotary_dim: the rotated dims of each head (``head_dim`` for full rotary; even).
        theta: the RoPE base (``rope_theta``).
        scaling: the frequency scaling; None: plain RoPE.
        max_len: ``max_position_embeddings`` (read by yarn and longrope).
        seq_len: the static sequence length by which longrope picks its factors;
            None: ``positions.shape[-1]``. Pass it for packed sequences, whose positions
            restart at 0 in every document.

    Returns:
        ``(cos, sin)``, each ``[T, rotary_dim]`` float32.

    Example:
        >>> import jax.numpy as jnp
        >>> cos, sin = rope_tables(jnp.arange(5), 4, theta=10000.0)
        >>> cos.shape, cos[0].tolist(), sin[0].tolist()  # position 0: no rotation
        ((5, 4), [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0])
        >>> yarn = RopeScaling(kind="yarn", factor=4.0, original_max_len=32)
        >>> cos, _ = rope_tables(jnp.arange(5), 4, 10000.0, yarn)
        >>> round(float(cos[0, 0]), 4)  # yarn's attention factor, 0.1 ln(4) + 1
        1.1386
    """
    seq_len = positions.shape[-1] if seq_len is None else seq_len
    inv_freq, attention_factor = inv_frequencies(rotary_dim, theta, scaling, max_len=max_len, seq_len=seq_len)
    positions = jnp.asarray(positions)
    inv_freq = jnp.asarray(inv_freq).reshape((1,) * positions.ndim + inv_freq.shape)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if attention_factor != 1.0:
        cos, sin = cos * np.float32(attention_factor), sin * np.float32(attention_factor)
    return cos, sin


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates the first ``R = cos.shape[-1]`` dims of ``x [B, T, N, H]``; the other
    ``H - R`` pass through (partial rotary). fp32 math, result in ``x.dtype``.

    Args:
        x: ``[B, T, N, H]`` queries or keys.
        cos, sin: ``[T, R]`` (or ``[B, T, R]``) tables from ``rope_tables``, ``R <= H`` even.

    Returns:
        ``[B, T, N, H]`` in ``x.dtype``.

    Raises:
        ValueError: for tables whose shape does not fit ``x``.

    Example:
        >>> import jax.numpy as jnp
        >>> cos, sin = rope_tables(jnp.arange(3), 4, 10000.0)
        >>> x = jnp.ones((1, 3, 2, 4))
        >>> bool(jnp.allclose(apply_rope(x, cos, sin)[:, 0], x[:, 0]))  # position 0 is unrotated
        True
        >>> y = jnp.ones((1, 3, 2, 6))  # partial rotary: dims 4 and 5 pass through
        >>> bool((apply_rope(y, cos, sin)[..., 4:] == 1).all())
        True
    """
    _check_tables(x, cos, sin)
    rotary_dim, half = cos.shape[-1], cos.shape[-1] // 2
    x32 = x[..., :rotary_dim].astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    cos, sin = (
        (cos[None, :, None, :], sin[None, :, None, :])
        if cos.ndim == 2
        else (cos[:, :, None], sin[:, :, None])
    )
    out = (x32 * cos + rotated * sin).astype(x.dtype)
    if rotary_dim == x.shape[-1]:
        return out
    return jnp.concatenate([out, x[..., rotary_dim:]], axis=-1)


def _check_tables(x: jax.Array, cos: jax.Array, sin: jax.Array) -> None:
    if x.ndim != 4:
        raise ValueError(f"apply_rope: x must be [B, T, N, H], got {x.shape=}")
    if cos.shape != sin.shape or cos.ndim not in (2, 3):
        raise ValueError(
            f"apply_rope: cos and sin must be [T, R] or [B, T, R], got {cos.shape=}, {sin.shape=}"
        )
    b, t, _, h = x.shape
    rotary_dim = cos.shape[-1]
    if cos.shape[-2] != t or (cos.ndim == 3 and cos.shape[0] not in (1, b)):
        raise ValueError(f"apply_rope: tables {cos.shape=} do not match {x.shape=} (T and B must agree)")
    if rotary_dim % 2 or not 0 < rotary_dim <= h:
        raise ValueError(
            f"apply_rope: the rotated dims cos.shape[-1]={rotary_dim} must be even and in (0, H={h}]"
        )
