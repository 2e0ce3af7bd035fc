"""Run the blockwise kernel one (batch, kv head) at a time when its tiles outgrow the cache.

A tile of logits holds ``B*K*G*bq*bk`` floats. When that is larger than a core's
L2 cache, each of the several elementwise passes over it (exp, row sums, dS)
streams from L3 or memory. Slicing the ``B*K`` axis into single heads, run one
after another by ``lax.map``/``lax.scan``, keeps every tile in cache. The result
is identical: heads are independent, and the dropout hash is told where the
slice sits (``Tiles.origin``).
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxckpt.attention._blockwise_bwd import BackwardTiles, backward
from jaxckpt.attention._blockwise_fwd import forward
from jaxckpt.attention._tiles import Tiles, Tiling

TILE_CACHE_BYTES = 2 * 2**20
"""Split into heads when one tile of fp32 logits for all heads exceeds this (L2-sized)."""


def should_split(tl: Tiling) -> bool:
    """Whether the tiles of all ``B*K`` rows together outgrow :data:`TILE_CACHE_BYTES`."""
    rows = tl.batch * tl.kv_heads
    return rows > 1 and rows * tl.groups * tl.bq * tl.bk * 4 > TILE_CACHE_BYTES


def _row(x: jax.Array | None, r, axis: int = 1):
    return None if x is None else lax.dynamic_slice_in_dim(x, r, 1, axis=axis)


def _pairwise_start(x: jax.Array, b, kh) -> tuple:
    """Start of the (b, kh) slice in a ``[Bx, Kx, Gx, T|1, S|1]`` bias or mask."""
    return (b if x.shape[0] > 1 else 0, kh if x.shape[1] > 1 else 0, 0, 0, 0)


def _pairwise_slice(x: jax.Array | None, b, kh):
    if x is None:
        return None
    return lax.dynamic_slice(x, _pairwise_start(x, b, kh), (1, 1, *x.shape[2:]))


def _slice(tl: Tiling, d: Tiles, e: BackwardTiles | None, r):
    """Tiles (and backward tiles) of row ``r = b * K + kh`` of ``B*K``."""
    b, kh = r // tl.kv_heads, r % tl.kv_heads
    d = d._replace(
        q=_row(d.q, r),
        k_t=_row(d.k_t, r),
        v=_row(d.v, r),
        bias=_pairwise_slice(d.bias, b, kh),
        mask=_pairwise_slice(d.mask, b, kh),
        q_len=_row(d.q_len, b, axis=0),
        kv_len=_row(d.kv_len, b, axis=0),
        q_seg=_row(d.q_seg, b),
        kv_seg=_row(d.kv_seg, b),
        origin=jnp.stack([b, kh]).astype(jnp.int32),
    )
    e = None if e is None else BackwardTiles(*(_row(x, r) for x in e))
    return d, e, (b, kh)


def _one_head(tl: Tiling) -> Tiling:
    return dataclasses.replace(tl, batch=1, kv_heads=1)


def forward_per_head(tl: Tiling, d: Tiles):
    """:func:`forward`, split into single heads when :func:`should_split`."""
    if not should_split(tl):
        return forward(tl, d)
    head = _one_head(tl)
    out, lse = lax.map(lambda r: forward(head, _slice(tl, d, None, r)[0]), jnp.arange(tl.batch * tl.kv_heads))
    return out[:, :, 0].swapaxes(0, 1), lse[:, :, 0].swapaxes(0, 1)


def backward_per_head(tl: Tiling, d: Tiles, e: BackwardTiles, need_dbias: bool):
    """:func:`backward`, split into single heads when :func:`should_split`."""
    if not should_split(tl):
        return backward(tl, d, e, need_dbias)
    head = _one_head(tl)

    def one(dbias, r):
        d_r, e_r, (b, kh) = _slice(tl, d, e, r)
        dq, dk_t, dv_t, dbias_r = backward(head, d_r, e_r, need_dbias)
        if need_dbias:
            start = _pairwise_start(dbias, b, kh)
            total = lax.dynamic_slice(dbias, start, dbias_r.shape) + dbias_r
            dbias = lax.dynamic_update_slice(dbias, total, start)
        return dbias, (dq, dk_t, dv_t)

    dbias0 = jnp.zeros(d.bias.shape, jnp.float32) if need_dbias else None
    dbias, grads = lax.scan(one, dbias0, jnp.arange(tl.batch * tl.kv_heads))
    dq, dk_t, dv_t = (g[:, :, 0].swapaxes(0, 1) for g in grads)
    return dq, dk_t, dv_t, dbias
