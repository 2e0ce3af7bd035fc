"""The key/value cache of decoding: one preallocated buffer per layer, written in place.

``KVCache`` holds every layer's keys and values stacked on a leading layer axis (the
stack is scanned, so the cache is scanned with it); ``LayerCache`` is one layer's slice.
A call with ``T`` new tokens writes their keys and values at ``start`` and attends to the
cached keys ``[0, start + T)`` only, through a mask: a decode step costs O(cache length)
and never recomputes the prefix.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp


class LayerCache(NamedTuple):
    """One layer's cache: ``key`` / ``value`` ``[B, S, K, H]``, and ``start``, the int32
    number of tokens already written (the position of the next one)."""

    key: jax.Array
    value: jax.Array
    start: jax.Array

    def write(self, key: jax.Array, value: jax.Array) -> "LayerCache":
        """The cache with ``key`` / ``value`` ``[B, T, K, H]`` written at ``start``
        (``start`` itself is advanced by ``KVCache``, once for all layers)."""
        at = (0, self.start, 0, 0)
        return self._replace(
            key=jax.lax.dynamic_update_slice(self.key, key.astype(self.key.dtype), at),
            value=jax.lax.dynamic_update_slice(self.value, value.astype(self.value.dtype), at),
        )

    def mask(self, t: int, windows: list, index=None, *, causal: bool = True) -> jax.Array:
        """``[1, 1, T, S]``: query ``i`` (at position ``start + i``) sees key ``j`` when
        ``j <= start + i`` (causal; else ``j < start + T``) and, for a layer with a
        sliding window ``(left, _)``, ``j >= start + i - left``. ``windows`` holds one
        window (or None) per layer kind; ``index`` picks the layer's."""
        s = self.key.shape[1]
        q = self.start + jnp.arange(t)[:, None]
        k = jnp.arange(s)[None, :]
        seen = k <= q if causal else k < self.start + t
        lefts = jnp.asarray([s if w is None else w[0] for w in windows], jnp.int32)
        left = lefts[0] if len(windows) == 1 else lefts[index]
        return (seen & (k >= q - left))[None, None]


class KVCache(NamedTuple):
    """Every layer's cache: ``key`` / ``value`` ``[L, B, S, K, H]`` and the int32 ``start``.

    Example:
        >>> import jax.numpy as jnp
        >>> cache = KVCache.empty(n_layers=2, batch=1, max_len=7, kv_heads=3, head_dim=5, dtype=jnp.float32)
        >>> cache.key.shape, int(cache.start)
        ((2, 1, 7, 3, 5), 0)
    """

    key: jax.Array
    value: jax.Array
    start: jax.Array

    @classmethod
    def empty(cls, *, n_layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int, dtype):
        """A zero cache of ``max_len`` positions."""
        shape = (n_layers, batch, max_len, kv_heads, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((), jnp.int32))

    @property
    def max_len(self) -> int:
        """How many positions the cache holds."""
        return self.key.shape[2]
