"""FlashAttention-2 backward: recompute probabilities tile by tile from the lse.

Outer ``scan`` over key tiles (accumulating dK and dV in registers), inner
``fori_loop`` over the query tiles that see that key tile (bounds from
``Tiles.visible``), accumulating dQ in place. With ``delta = rowsum(dO * O)``:

    P = exp(S - lse)    dV^T += dO^T P    dP = dO V^T    dS = P * (dP - delta)
    dQ += dS K          dK^T += Q^T dS       (times the scale, once, at the end)

The key-side gradients are accumulated transposed (``[H, bk]``) so that every
matmul reads its operands in their stored orientation, and the scale is applied
to the small accumulators, never to a ``bq x bk`` tile.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxckpt.attention._masks import loop_bounds
from jaxckpt.attention._tiles import (
    MATMUL,
    Tiles,
    Tiling,
    dropped,
    mask_only_if_needed,
    pairwise_tile,
    pairwise_tile_start,
    rows_to_lse,
    rows_to_tiles,
    tile_keep,
    tile_logits,
    unflat,
)
from jaxckpt.attention._vma import vary_like


class BackwardTiles(NamedTuple):
    """What the backward reads besides the forward's :class:`Tiles`."""

    q_t: jax.Array  # [nq, B*K, H, G*bq]
    do: jax.Array  # [nq, B*K, G*bq, H]
    do_t: jax.Array  # [nq, B*K, H, G*bq]
    k: jax.Array  # [nk, B*K, bk, H]
    v_t: jax.Array  # [nk, B*K, H, bk]
    lse: jax.Array  # [nq, B*K, G*bq], +inf for rows seeing no key
    delta: jax.Array  # [nq, B*K, G*bq], rowsum(dO * O)


def _add_bias_grad(dbias: jax.Array, ds: jax.Array, tl: Tiling, i, j) -> jax.Array:
    """Adds tile (i, j) of dS, summed over the bias's broadcast axes, into dbias."""
    ds = unflat(ds, tl)
    axes = tuple(a for a in range(5) if dbias.shape[a] == 1 and ds.shape[a] > 1)
    update = pairwise_tile(dbias, tl, i, j) + ds.sum(axes, keepdims=True)
    return lax.dynamic_update_slice(dbias, update, pairwise_tile_start(dbias, tl, i, j))


def _update(tl: Tiling, d: Tiles, e: BackwardTiles, j, i, carry, *, masked: bool):
    """Query tile i against key tile j: carry ``(dk^T, dv^T, dq, dbias)``."""
    st = tl.static
    rate = st.dropout_rate
    dk_t, dv_t, dq, dbias = carry
    q_tile, do_tile, do_t_tile = d.q[i], e.do[i], e.do_t[i]
    s, tanh = tile_logits(tl, d, i, j, q_tile, d.k_t[j], masked)
    p = jnp.exp(s - e.lse[i][..., None])
    dp = lax.dot_general(do_tile, e.v_t[j], MATMUL, preferred_element_type=jnp.float32)
    p_used = p
    if rate > 0:
        keep = tile_keep(tl, d, i, j)
        p_used, dp = dropped(tl, keep, p), dropped(tl, keep, dp)
    dv_t = dv_t + lax.dot_general(
        do_t_tile, p_used.astype(do_tile.dtype), MATMUL, preferred_element_type=jnp.float32
    )
    ds = p * (dp - e.delta[i][..., None])
    if tanh is not None:
        ds = ds * (1.0 - tanh * tanh)
    if dbias is not None:
        dbias = _add_bias_grad(dbias, ds, tl, i, j)
    ds = ds.astype(q_tile.dtype)
    dq = dq.at[i].add(lax.dot_general(ds, e.k[j], MATMUL, preferred_element_type=jnp.float32))
    dk_t = dk_t + lax.dot_general(e.q_t[i], ds, MATMUL, preferred_element_type=jnp.float32)
    return dk_t, dv_t, dq, dbias


def backward(tl: Tiling, d: Tiles, e: BackwardTiles, need_dbias: bool, grad_dtype=None):
    """Blockwise attention backward, all in tile layout.

    Args:
        tl: the static tiling.
        d: the forward's inputs in tile layout.
        e: the backward's extra tiles (transposes, dO, lse, delta).
        need_dbias: whether to accumulate the bias gradient.
        grad_dtype: the dtype of dq, dk, dv; None: the input dtype (context parallelism
            asks for float32, to sum the gradients of several key blocks unrounded).

    Returns:
        ``(dq [nq, B*K, G*bq, H], dk^T [nk, B*K, H, bk], dv^T, dbias)`` in grad_dtype;
        ``dbias`` (pairwise tile layout, fp32) is None unless requested.
    """
    lo, hi = loop_bounds(d.visible.T)
    key_side = d.k_t.shape[1:]  # [B*K, H, bk]
    dbias0 = jnp.zeros(d.bias.shape, jnp.float32) if need_dbias else None

    def k_step(carry, xs):
        dq, dbias = carry
        j, start, stop = xs
        update = functools.partial(_update, tl, d, e, j)

        def q_step(i, c):
            return mask_only_if_needed(d, i, j, update, i, c)

        zeros = vary_like(jnp.zeros(key_side, jnp.float32), d, e)
        dk_t, dv_t, dq, dbias = lax.fori_loop(start, stop, q_step, (zeros, zeros, dq, dbias))
        return (dq, dbias), (
            (dk_t * tl.logit_scale).astype(grad_dtype or d.k_t.dtype),
            dv_t.astype(grad_dtype or d.v.dtype),
        )

    carry = vary_like((jnp.zeros(d.q.shape, jnp.float32), dbias0), d, e)
    (dq, dbias), (dk_t, dv_t) = lax.scan(k_step, carry, (jnp.arange(tl.nk, dtype=jnp.int32), lo, hi))
    return (dq * tl.static.scale).astype(grad_dtype or d.q.dtype), dk_t, dv_t, dbias


def backward_tiles(tl: Tiling, d: Tiles, out, lse, do) -> BackwardTiles:
    """Builds :class:`BackwardTiles` from the forward's tiles, its canonical out and
    lse, and the output cotangent; the transposed operands are views of ``d``'s tiles.
    """
    do = do.astype(out.dtype)
    delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, T, N]
    lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)  # rows seeing no key: P = 0
    do = rows_to_tiles(do, tl)
    return BackwardTiles(
        q_t=d.q.swapaxes(2, 3),
        do=do,
        do_t=do.swapaxes(2, 3),
        k=d.k_t.swapaxes(2, 3),
        v_t=d.v.swapaxes(2, 3),
        lse=rows_to_lse(lse, tl),
        delta=rows_to_lse(jnp.swapaxes(delta, 1, 2), tl),
    )
