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
    q_pos=None,
    k_pos=None,
) -> jax.Array:
    """True where query ``q_idx`` may attend key ``k_idx``.

    Every argument is an array already shaped to broadcast against the others
    (the caller chooses the layout). Padding beyond T and S is always masked.

    Args:
        cfg: the static mask (lengths, causal, window).
        q_idx: absolute query indices (in the arrays the kernel holds).
        k_idx: absolute key indices.
        q_len, kv_len: per-batch valid lengths, or None.
        q_seg, kv_seg: segment ids of the rows and columns, or None.
        mask: a boolean tile of the user mask (True = attend), or None.
        q_pos, k_pos: the tokens' positions in the whole sequence, which the causal and
            window rules compare instead of the indices (context parallelism: a shard
            holds a chunk, or two in a load-balanced order); None: the indices. Padding
            and lengths stay on the indices.

    Returns:
        A boolean array, the broadcast of all inputs.
    """
    ok = (q_idx < cfg.t) & (k_idx < cfg.s)
    q_at = q_idx if q_pos is None else q_pos
    k_at = k_idx if k_pos is None else k_pos
    if cfg.is_causal:
        ok &= k_at <= q_at
    if cfg.window is not None:
        left, right = cfg.window
        ok &= (k_at >= q_at - left) & (k_at <= q_at + right)
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


def _span(seg: jax.Array, length: int, block: int, n_blocks: int):
    """Min and max value (segment id, position) inside each block, ignoring padding:
    two [B, n_blocks]."""
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


def _position_rules(cfg: MaskConfig, positions, bq: int, bk: int, nq: int, nk: int):
    """The causal and window rules lifted to tiles from explicit positions (``q_pos [B, T]``,
    ``kv_pos [B, S]``): each tile's span of positions, per batch row; two bool [nq, nk]."""
    q_lo, q_hi = (x[:, :, None] for x in _span(positions[0], cfg.t, bq, nq))
    k_lo, k_hi = (x[:, None, :] for x in _span(positions[1], cfg.s, bk, nk))
    some = every = jnp.ones((1, nq, nk), bool)
    if cfg.is_causal:
        some, every = some & (k_lo <= q_hi), every & (k_hi <= q_lo)
    if cfg.window is not None:
        left, right = cfg.window
        some &= (k_hi >= q_lo - left) & (k_lo <= q_hi + right)
        every &= (k_lo >= q_hi - left) & (k_hi <= q_lo + right)
    return some.any(0), every.all(0)


def classify_tiles(
    cfg: MaskConfig, arrays: MaskArrays, bq: int, bk: int, positions=None
) -> tuple[jax.Array, jax.Array]:
    """Which ``[bq, bk]`` tiles hold some visible pair, and which are entirely visible.

    Each rule of :func:`visible` is lifted to tiles conservatively: a tile marked
    not-any is certainly fully masked, a tile marked all is certainly fully
    visible, for every batch element and head. The blockwise loops take their
    bounds from the first, and skip computing the mask on tiles of the second.

    Args:
        cfg: the static mask.
        arrays: the traced mask arrays.
        bq, bk: the tile sizes.
        positions: ``(q_pos [B, T], kv_pos [B, S])``, the positions the causal and window
            rules compare (:func:`visible`'s ``q_pos`` / ``k_pos``); None: the indices.

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
    if positions is not None:
        by_position = _position_rules(cfg, positions, bq, bk, nq, nk)
        some, every = some & by_position[0], every & by_position[1]
    elif cfg.is_causal:
        some &= k_lo <= q_hi
        every &= k_end <= q_lo
    if positions is None and cfg.window is not None:
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
        qs_lo, qs_hi = _span(arrays.q_segments, cfg.t, bq, nq)
        ks_lo, ks_hi = _span(arrays.kv_segments, cfg.s, bk, nk)
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
