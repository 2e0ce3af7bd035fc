"""Tile layout and per-tile math shared by the blockwise forward and backward.

Layout. Queries are grouped by their key/value head (GQA without repeating K/V)
and cut into ``nq`` tiles of ``bq`` rows; keys and values into ``nk`` tiles of
``bk`` rows. The tile index is the leading axis, so fetching a tile inside a
loop is a contiguous slice:

    q    [nq, B*K, G*bq, H]      k^T  [nk, B*K, H, bk]    v  [nk, B*K, bk, H]
    lse  [nq, B*K, G*bq]         logits of one tile  [B*K, G*bq, bk]

with ``N = K * G``: every matmul is a plain batched matmul over B*K. Masks,
bias and dropout are written per tile as ``[B, K, G, bq, bk]`` and flattened
(:func:`flat`). Each operand is stored in the orientation its matmul reads
(k^T for ``Q K^T``; ``(dO)^T`` and ``Q^T`` for the key-side gradients in the
backward), so no tile of size bq x bk is ever transposed inside a loop. Inputs
whose length is not a multiple of the tile are padded; padded keys and rows are
masked by :func:`jaxckpt.attention._masks.visible`.
"""

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxckpt.attention import _dropout
from jaxckpt.attention._block_sizes import BlockSizes
from jaxckpt.attention._masks import classify_tiles, visible
from jaxckpt.attention._validate import MaskArrays, Static

# The one dot_general of the kernel: a row-major (NN) matmul batched over B*K.
MATMUL = (((2,), (1,)), ((0,), (0,)))  # [BK, m, x] x [BK, x, n] -> [BK, m, n]


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Static description of one blockwise call."""

    static: Static
    bq: int
    bk: int
    nq: int
    nk: int
    batch: int
    kv_heads: int
    groups: int
    prescale: bool  # q is multiplied by the scale before tiling (exact or fp32)

    @property
    def num_heads(self) -> int:
        return self.kv_heads * self.groups

    @property
    def logit_scale(self) -> float:
        """The factor still applied to ``Q K^T`` inside a tile (1 once q is prescaled)."""
        return 1.0 if self.prescale else self.static.scale

    @classmethod
    def create(cls, static: Static, block_sizes: BlockSizes, query_shape, key_shape, dtype) -> "Tiling":
        """Tiling of a call with canonical ``query [B, T, N, H]`` and ``key [B, S, K, H]``.

        The scale is folded into q (saving a pass over every logits tile) when that
        is exact: in fp32, or for a power-of-two scale such as 1/sqrt(64).
        """
        t, s = static.mask.t, static.mask.s
        bs = block_sizes.clamp(t, s)
        nq, nk = -(-t // bs.block_q), -(-s // bs.block_k)
        b, _, n, _ = query_shape
        kh = key_shape[2]
        exact = math.frexp(static.scale)[0] == 0.5
        prescale = jnp.dtype(dtype) == jnp.float32 or exact
        return cls(static, bs.block_q, bs.block_k, nq, nk, b, kh, n // kh, prescale)

    def scaled_q(self, q: jax.Array) -> jax.Array:
        """q as the tiles hold it: multiplied by the scale when ``prescale``."""
        return (q * jnp.asarray(self.static.scale, q.dtype)) if self.prescale else q


class Tiles(NamedTuple):
    """The traced inputs of a blockwise call, in tile layout (unused fields None)."""

    q: jax.Array  # [nq, B*K, G*bq, H]
    k_t: jax.Array  # [nk, B*K, H, bk]
    v: jax.Array  # [nk, B*K, bk, H]
    bias: jax.Array | None  # [Bb, Kb, Gb, Tp|1, Sp|1]
    mask: jax.Array | None  # [Bm, Km, Gm, Tp|1, Sp|1]
    q_len: jax.Array | None  # [B]
    kv_len: jax.Array | None  # [B]
    q_seg: jax.Array | None  # [nq, B, bq]
    kv_seg: jax.Array | None  # [nk, B, bk]
    seed: jax.Array | None  # uint32 dropout seed
    visible: jax.Array  # bool [nq, nk]: tiles holding a visible pair (loop bounds)
    full: jax.Array  # bool [nq, nk]: tiles entirely visible (no mask to compute)
    q_pos: jax.Array | None = None  # [nq, B, bq]: positions the causal/window rules compare
    kv_pos: jax.Array | None = None  # [nk, B, bk]


def _pad_to(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def rows_to_tiles(x: jax.Array, tl: Tiling) -> jax.Array:
    """``[B, T, N, H]`` (q, out, dO) -> ``[nq, B*K, G*bq, H]``."""
    x = _pad_to(x, 1, tl.nq * tl.bq).reshape(tl.batch, tl.nq, tl.bq, tl.kv_heads, tl.groups, -1)
    return x.transpose(1, 0, 3, 4, 2, 5).reshape(tl.nq, tl.batch * tl.kv_heads, tl.groups * tl.bq, -1)


def tiles_to_rows(x: jax.Array, tl: Tiling) -> jax.Array:
    """Inverse of :func:`rows_to_tiles`, dropping the padding."""
    x = x.reshape(tl.nq, tl.batch, tl.kv_heads, tl.groups, tl.bq, -1).transpose(1, 0, 4, 2, 3, 5)
    return x.reshape(tl.batch, tl.nq * tl.bq, tl.num_heads, -1)[:, : tl.static.mask.t]


def keys_to_tiles(x: jax.Array, tl: Tiling) -> jax.Array:
    """``[B, S, K, H]`` (k, v) -> ``[nk, B*K, bk, H]``."""
    x = _pad_to(x, 1, tl.nk * tl.bk).reshape(tl.batch, tl.nk, tl.bk, tl.kv_heads, -1)
    return x.transpose(1, 0, 3, 2, 4).reshape(tl.nk, tl.batch * tl.kv_heads, tl.bk, -1)


def keys_to_tiles_t(x: jax.Array, tl: Tiling) -> jax.Array:
    """``[B, S, K, H]`` (k, v) -> ``[nk, B*K, H, bk]``, the transposed tiles."""
    return keys_to_tiles(x, tl).swapaxes(2, 3)


def tiles_t_to_keys(x: jax.Array, tl: Tiling) -> jax.Array:
    """Inverse of :func:`keys_to_tiles_t`, dropping the padding."""
    x = x.reshape(tl.nk, tl.batch, tl.kv_heads, -1, tl.bk).transpose(1, 0, 4, 2, 3)
    return x.reshape(tl.batch, tl.nk * tl.bk, tl.kv_heads, -1)[:, : tl.static.mask.s]


def lse_to_rows(lse: jax.Array, tl: Tiling) -> jax.Array:
    """``[nq, B*K, G*bq]`` -> ``[B, N, T]``."""
    lse = lse.reshape(tl.nq, tl.batch, tl.kv_heads, tl.groups, tl.bq).transpose(1, 2, 3, 0, 4)
    return lse.reshape(tl.batch, tl.num_heads, tl.nq * tl.bq)[..., : tl.static.mask.t]


def rows_to_lse(lse: jax.Array, tl: Tiling) -> jax.Array:
    """``[B, N, T]`` -> ``[nq, B*K, G*bq]``."""
    lse = _pad_to(lse, 2, tl.nq * tl.bq).reshape(tl.batch, tl.kv_heads, tl.groups, tl.nq, tl.bq)
    return lse.transpose(3, 0, 1, 2, 4).reshape(tl.nq, tl.batch * tl.kv_heads, tl.groups * tl.bq)


def flat(x: jax.Array, tl: Tiling) -> jax.Array:
    """A tile broadcastable to ``[B, K, G, bq, bk]`` -> the flat ``[B*K, G*bq, bk]``."""
    x = jnp.broadcast_to(x, (tl.batch, tl.kv_heads, tl.groups, tl.bq, tl.bk))
    return x.reshape(tl.batch * tl.kv_heads, tl.groups * tl.bq, tl.bk)


def unflat(x: jax.Array, tl: Tiling) -> jax.Array:
    """Inverse of :func:`flat` (without the broadcast)."""
    return x.reshape(tl.batch, tl.kv_heads, tl.groups, tl.bq, tl.bk)


def tiles_to_pairwise(x: jax.Array, tl: Tiling, shape: tuple[int, ...]) -> jax.Array:
    """Inverse of :func:`pairwise_to_tiles` back to the 4-D ``shape``, dropping padding."""
    bx, nx, tx, sx = shape
    return x[..., :tx, :sx].reshape(bx, nx, tx, sx)


def pairwise_to_tiles(x: jax.Array, tl: Tiling, fill) -> jax.Array:
    """A ``[Bx, Nx, Tx, Sx]`` mask or bias -> ``[Bx, Kx, Gx, Tp|1, Sp|1]`` (Nx is 1 or N)."""
    bx, nx, tx, sx = x.shape
    heads = (tl.kv_heads, tl.groups) if nx > 1 else (1, 1)
    x = x.reshape(bx, *heads, tx, sx)
    if tx > 1:
        x = _pad_to(x, 3, tl.nq * tl.bq, fill)
    if sx > 1:
        x = _pad_to(x, 4, tl.nk * tl.bk, fill)
    return x


def to_tiles(q, k, v, bias, arrays: MaskArrays, seed, tl: Tiling, positions=None) -> Tiles:
    """Puts canonical inputs (rank-4 BTNH etc.) into tile layout.

    ``positions``: ``(q_pos [B, T], kv_pos [B, S])``, the tokens' positions in the whole
    sequence, which the causal and window rules then compare instead of the indices
    (:func:`jaxckpt.attention._masks.visible`); None: the indices.
    """

    def seg(x, n, blk):
        return None if x is None else _pad_to(x, 1, n * blk, -1).reshape(x.shape[0], n, blk).swapaxes(0, 1)

    q_pos, kv_pos = (None, None) if positions is None else positions
    visible, full = classify_tiles(tl.static.mask, arrays, tl.bq, tl.bk, positions)
    return Tiles(
        q=rows_to_tiles(tl.scaled_q(q), tl),
        k_t=keys_to_tiles_t(k, tl),
        v=keys_to_tiles(v, tl),
        bias=None if bias is None else pairwise_to_tiles(bias, tl, 0),
        mask=None if arrays.mask is None else pairwise_to_tiles(arrays.mask, tl, False),
        q_len=arrays.q_lengths,
        kv_len=arrays.kv_lengths,
        q_seg=seg(arrays.q_segments, tl.nq, tl.bq),
        kv_seg=seg(arrays.kv_segments, tl.nk, tl.bk),
        seed=seed,
        visible=visible,
        full=full,
        q_pos=seg(q_pos, tl.nq, tl.bq),
        kv_pos=seg(kv_pos, tl.nk, tl.bk),
    )


def pairwise_tile_start(x: jax.Array, tl: Tiling, i, j) -> tuple:
    """Start indices of tile (i, j) in a :func:`pairwise_to_tiles` array.

    All int32, whatever ``jax_enable_x64`` says: ``dynamic_slice`` needs its start
    indices to share one integer type, and a Python 0 would be int64 under x64.
    """
    zero = jnp.int32(0)
    row = jnp.asarray(i, jnp.int32) * tl.bq if x.shape[3] > 1 else zero
    col = jnp.asarray(j, jnp.int32) * tl.bk if x.shape[4] > 1 else zero
    return (zero, zero, zero, row, col)


def pairwise_tile(x: jax.Array, tl: Tiling, i, j) -> jax.Array:
    """Tile (i, j) of a bias or mask in :func:`pairwise_to_tiles` layout."""
    size = (*x.shape[:3], tl.bq if x.shape[3] > 1 else 1, tl.bk if x.shape[4] > 1 else 1)
    return lax.dynamic_slice(x, pairwise_tile_start(x, tl, i, j), size)


def _indices(tl: Tiling, i, j):
    """Absolute query and key positions of tile (i, j), shaped ``[1,1,1,bq,1]`` / ``[1,1,1,1,bk]``."""
    q_idx = i * tl.bq + lax.broadcasted_iota(jnp.int32, (1, 1, 1, tl.bq, 1), 3)
    k_idx = j * tl.bk + lax.broadcasted_iota(jnp.int32, (1, 1, 1, 1, tl.bk), 4)
    return q_idx, k_idx


def tile_visible(tl: Tiling, d: Tiles, i, j) -> jax.Array:
    """The mask of tile (i, j), broadcastable to ``[B, K, G, bq, bk]`` (flatten with :func:`flat`)."""
    q_idx, k_idx = _indices(tl, i, j)
    per_batch = lambda x: None if x is None else x[:, None, None, None, None]
    return visible(
        tl.static.mask,
        q_idx,
        k_idx,
        q_len=per_batch(d.q_len),
        kv_len=per_batch(d.kv_len),
        q_seg=None if d.q_seg is None else d.q_seg[i][:, None, None, :, None],
        kv_seg=None if d.kv_seg is None else d.kv_seg[j][:, None, None, None, :],
        mask=None if d.mask is None else pairwise_tile(d.mask, tl, i, j),
        q_pos=None if d.q_pos is None else d.q_pos[i][:, None, None, :, None],
        k_pos=None if d.kv_pos is None else d.kv_pos[j][:, None, None, None, :],
    )


def tile_logits(tl: Tiling, d: Tiles, i, j, q_tile, k_t_tile, masked: bool):
    """fp32 logits of tile (i, j), and ``tanh`` of the soft cap (or None).

    Args:
        masked: apply the mask (False only for tiles known to be fully visible).

    Returns:
        ``(logits [B*K, G*bq, bk], tanh or None)``; masked entries are ``-inf``.
    """
    st = tl.static
    s = lax.dot_general(q_tile, k_t_tile, MATMUL, preferred_element_type=jnp.float32)
    if tl.logit_scale != 1.0:
        s = s * tl.logit_scale
    if d.bias is not None:
        s = s + flat(pairwise_tile(d.bias, tl, i, j), tl).astype(jnp.float32)
    tanh = None
    if st.logits_soft_cap is not None:
        tanh = jnp.tanh(s / st.logits_soft_cap)
        s = st.logits_soft_cap * tanh
    if masked:
        s = jnp.where(flat(tile_visible(tl, d, i, j), tl), s, -jnp.inf)
    return s, tanh


def tile_keep(tl: Tiling, d: Tiles, i, j) -> jax.Array:
    """Dropout keep-mask of tile (i, j), flat ``[B*K, G*bq, bk]``."""
    q_idx, k_idx = _indices(tl, i, j)
    b, kh, g = tl.batch, tl.kv_heads, tl.groups
    b_idx = lax.broadcasted_iota(jnp.int32, (b, 1, 1, 1, 1), 0)
    kh_idx = lax.broadcasted_iota(jnp.int32, (1, kh, g, 1, 1), 1)
    n_idx = kh_idx * g + lax.broadcasted_iota(jnp.int32, (1, kh, g, 1, 1), 2)
    keep = _dropout.keep(d.seed, b_idx, n_idx, q_idx, k_idx, tl.num_heads, tl.static.dropout_rate)
    return flat(keep, tl)


def dropped(tl: Tiling, keep: jax.Array, x: jax.Array) -> jax.Array:
    """``x`` with dropout applied: kept entries scaled by ``1 / (1 - rate)``, others 0."""
    return jnp.where(keep, x * (1.0 / (1.0 - tl.static.dropout_rate)), 0.0)


def mask_only_if_needed(d: Tiles, i, j, update, loop_index, carry):
    """``update(loop_index, carry, masked=...)``, unmasked on tiles marked ``Tiles.full``."""
    unmasked = functools.partial(update, masked=False)
    return lax.cond(d.full[i, j], unmasked, functools.partial(update, masked=True), loop_index, carry)
