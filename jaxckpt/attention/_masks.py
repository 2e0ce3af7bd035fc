"""The attention mask, written once as a predicate on (query index, key index).

:func:`visible` is the single definition of which key a query row may attend.
The reference evaluates it on the full ``[B, N, T, S]`` grid; the blockwise
forward and backward evaluate it on one ``[bq, bk]`` tile at a time. The same
rules, lifted to whole tiles, give :func:`classify_tiles`: the blockwise loops
take their bounds from it, so fully masked tiles are never computed, and skip
the mask entirely on tiles that are fully visible.
"""

import jax
import jax.numpy as jnp

from jaxckpt.attention._validate import MaskArrays, MaskConfig


def visible(
    cfg: MaskConfig,
    q_idx,
    k_idx,
    *,
    q_len=None,
    kv_len=None,
    q_seg=None,
    kv_seg=None,
    mask=None,
) -> jax.Array:
    """True where query ``q_idx`` may attend key ``k_idx``.

    Every argument is an array already shaped to broadcast against the others
    (the caller chooses the layout). Padding beyond T and S is always masked.

    Args:
        cfg: the static mask (lengths, causal, window).
        q_idx: absolute query positions.
        k_idx: absolute key positions.
        q_len, kv_len: per-batch valid lengths, or None.
        q_seg, kv_seg: segment ids of the rows and columns, or None.
        mask: a boolean tile of the user mask (True = attend), or None.

    Returns:
        A boolean array, the broadcast of all inputs.
    """
    ok = (q_idx < cfg.t) & (k_idx < cfg.s)
    if cfg.is_causal:
        ok &= k_idx <= q_idx
    if cfg.window is not None:
        left, right = cfg.window
        ok &= (k_idx >= q_idx - left) & (k_idx <= q_idx + right)
    if q_len is not None:
        ok &= q_idx < q_len
    if kv_len is not None:
        ok &= k_idx < kv_len
    if q_seg is not None:
        ok &= q_seg == kv_seg
    if mask is not None:
        ok &= mask
    return ok


def row_sees_a_key(cfg: MaskConfig, q_idx, *, q_len=None, kv_len=None):
    """True where query row ``q_idx`` sees at least one key: O(T), no ``[T, S]`` grid.

    Under the rules that bound the key index from both sides (``k >= 0`` and, with a
    window, ``k >= q - left``; ``k < S``, ``k < kv_len`` and, causal or windowed,
    ``k <= q`` or ``k <= q + right``) the keys a row sees form one interval, so the row
    sees some key iff it sees the interval's first, ``max(0, q - left)``: that one
    key is checked with :func:`visible` itself, so the rules stay written once.
    Segment ids and a user mask are not intervals: rows under those need the full
    grid (``full_mask(p).any(-1)``).

    Args:
        cfg: the static mask (lengths, causal, window).
        q_idx: absolute query positions (a jax or a NumPy array: with NumPy and no
            lengths the answer is a NumPy array, known at trace time).
        q_len, kv_len: per-batch valid lengths, shaped to broadcast against ``q_idx``.

    Returns:
        A boolean array, the broadcast of ``q_idx`` and the lengths.

    Example:
        >>> import numpy as np
        >>> from jaxckpt.attention._validate import MaskConfig
        >>> cfg = MaskConfig(t=6, s=3, window=(1, 1))
        >>> row_sees_a_key(cfg, np.arange(6)).astype(int).tolist()
        [1, 1, 1, 1, 0, 0]
    """
    first = 0 if cfg.window is None else (q_idx - cfg.window[0]).clip(0)
    return visible(cfg, q_idx, first, q_len=q_len, kv_len=kv_len)


def _segment_span(seg: jax.Array, length: int, block: int, n_blocks: int):
    """Min and max segment id inside each block, ignoring padding: two [B, n_blocks]."""
    pad = n_blocks * block - length
    big = jnp.iinfo(jnp.int32).max
    lo = jnp.pad(seg, ((0, 0), (0, pad)), constant_values=big).reshape(seg.shape[0], n_blocks, block)
    hi = jnp.pad(seg, ((0, 0), (0, pad)), constant_values=-big).reshape(seg.shape[0], n_blocks, block)
    return lo.min(-1), hi.max(-1)


def _mask_tiles(mask: jax.Array, bq: int, bk: int, nq: int, nk: int):
    """Whether any / every entry of each tile of the user mask is True: two [nq, nk]."""
    _, _, tm, sm = mask.shape
    pad_t = nq * bq - tm if tm > 1 else 0
    pad_s = nk * bk - sm if sm > 1 else 0
    m = jnp.pad(mask, ((0, 0), (0, 0), (0, pad_t), (0, pad_s)))
    rows = (nq, bq) if tm > 1 else (1, 1)
    cols = (nk, bk) if sm > 1 else (1, 1)
    m = m.reshape(*m.shape[:2], *rows, *cols)
    tiles_any = m.any((0, 1, 3, 5))
    tiles_all = m.all((0, 1, 3, 5))
    return jnp.broadcast_to(tiles_any, (nq, nk)), jnp.broadcast_to(tiles_all, (nq, nk))


def classify_tiles(cfg: MaskConfig, arrays: MaskArrays, bq: int, bk: int) -> tuple[jax.Array, jax.Array]:
    """Which ``[bq, bk]`` tiles hold some visible pair, and which are entirely visible.

    Each rule of :func:`visible` is lifted to tiles conservatively: a tile marked
    not-any is certainly fully masked, a tile marked all is certainly fully
    visible, for every batch element and head. The blockwise loops take their
    bounds from the first, and skip computing the mask on tiles of the second.

    Returns:
        ``(any, all)``, bool ``[nq, nk]`` with ``nq = ceil(T / bq)``, ``nk = ceil(S / bk)``.
    """
    nq, nk = -(-cfg.t // bq), -(-cfg.s // bk)
    q_lo = (jnp.arange(nq, dtype=jnp.int32) * bq)[:, None]
    q_end = q_lo + bq - 1  # last row of the tile, padding included
    q_hi = jnp.minimum(q_end, cfg.t - 1)
    k_lo = (jnp.arange(nk, dtype=jnp.int32) * bk)[None, :]
    k_end = k_lo + bk - 1
    k_hi = jnp.minimum(k_end, cfg.s - 1)
    some = jnp.ones((nq, nk), bool)
    every = (q_end < cfg.t) & (k_end < cfg.s)
    if cfg.is_causal:
        some &= k_lo <= q_hi
        every &= k_end <= q_lo
    if cfg.window is not None:
        left, right = cfg.window
        some &= (k_hi >= q_lo - left) & (k_lo <= q_hi + right)
        every &= (k_lo >= q_end - left) & (k_end <= q_lo + right)
    if arrays.q_lengths is not None:
        some &= q_lo < arrays.q_lengths.max()
        every &= q_end < arrays.q_lengths.min()
    if arrays.kv_lengths is not None:
        some &= k_lo < arrays.kv_lengths.max()
        every &= k_end < arrays.kv_lengths.min()
    if arrays.q_segments is not None:
        qs_lo, qs_hi = _segment_span(arrays.q_segments, cfg.t, bq, nq)
        ks_lo, ks_hi = _segment_span(arrays.kv_segments, cfg.s, bk, nk)
        qs_lo, qs_hi, ks_lo, ks_hi = (
            qs_lo[:, :, None],
            qs_hi[:, :, None],
            ks_lo[:, None, :],
            ks_hi[:, None, :],
        )
        some &= ((qs_lo <= ks_hi) & (ks_lo <= qs_hi)).any(0)
        every &= ((qs_lo == qs_hi) & (ks_lo == ks_hi) & (qs_lo == ks_lo)).all(0)
    if arrays.mask is not None:
        mask_any, mask_all = _mask_tiles(arrays.mask, bq, bk, nq, nk)
        some &= mask_any
        every &= mask_all
    return some, every & some


def loop_bounds(vis: jax.Array) -> tuple[jax.Array, jax.Array]:
    """First and one-past-last True column of each row of ``vis``; (0, 0) for an empty row."""
    n = vis.shape[1]
    has = vis.any(1)
    lo = jnp.argmax(vis, axis=1)
    hi = n - jnp.argmax(vis[:, ::-1], axis=1)
    return jnp.where(has, lo, 0).astype(jnp.int32), jnp.where(has, hi, 0).astype(jnp.int32)
