"""Attention dropout whose mask is a pure function of (rng, b, n, q, k).

The blockwise backward pass regenerates, tile by tile, exactly the mask the
forward pass drew, whatever the block sizes, without storing anything of size
T x S. The hash is MurmurHash3's 32-bit finaliser applied to the rng words and
the four indices.
"""

import jax
import jax.numpy as jnp
import numpy as np

_GOLDEN = np.uint32(0x9E3779B9)
_K_MULT = np.uint32(0x85EBCA77)


def _fmix32(h: jax.Array) -> jax.Array:
    h = h ^ (h >> 16)
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def rng_seed(dropout_rng) -> jax.Array:
    """Folds a ``jax.random`` key (typed or raw uint32) into one uint32 seed."""
    if jnp.issubdtype(jnp.asarray(dropout_rng).dtype, jax.dtypes.prng_key):
        dropout_rng = jax.random.key_data(dropout_rng)
    words = jnp.asarray(dropout_rng).astype(jnp.uint32).reshape(-1)
    seed = np.uint32(0)
    for i in range(words.shape[0]):
        seed = _fmix32(seed ^ (words[i] + np.uint32((int(_GOLDEN) * (i + 1)) & 0xFFFFFFFF)))
    return seed


def keep(seed, b_idx, n_idx, q_idx, k_idx, num_heads: int, rate: float) -> jax.Array:
    """True where the attention probability at (b, n, q, k) is kept.

    All index arguments broadcast together (any integer dtype); the hash of one
    element does not depend on the others, so any tiling gives the same mask.
    """
    row = (b_idx * num_heads + n_idx).astype(jnp.uint32)
    h = _fmix32(seed ^ _fmix32(row + _GOLDEN))
    h = _fmix32(h + q_idx.astype(jnp.uint32) * _GOLDEN)
    h = _fmix32(h ^ (k_idx.astype(jnp.uint32) * _K_MULT))
    threshold = np.uint32(min(round(rate * 2.0**32), 2**32 - 1))
    return h >= threshold


def dropout_mask(dropout_rng, shape: tuple[int, int, int, int], rate: float) -> jax.Array:
    """The full boolean keep-mask ``[B, N, T, S]`` that flash_attention draws.

    Args:
        dropout_rng: a ``jax.random.key`` (or legacy uint32 key).
        shape: ``(B, N, T, S)``.
        rate: the dropout probability.

    Returns:
        bool ``[B, N, T, S]``; True where the probability is kept.

    Example:
        >>> import jax
        >>> from jaxckpt.attention import dropout_mask
        >>> m = dropout_mask(jax.random.key(0), (1, 2, 3, 5), 0.5)
        >>> m.shape
        (1, 2, 3, 5)
    """
    b, n, t, s = shape
    idx = jnp.ix_(jnp.arange(b), jnp.arange(n), jnp.arange(t), jnp.arange(s))
    return keep(rng_seed(dropout_rng), *idx, num_heads=n, rate=rate)
