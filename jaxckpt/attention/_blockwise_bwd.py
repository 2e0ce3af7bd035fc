"""FlashAttention-2 backward: recompute probabilities tile by tile from the lse.

Outer ``scan`` over key tiles (accumulating dK and dV in registers), inner
``fori_loop`` over the query tiles that see that key tile (bounds from
``Tiles.visible``), accumulating dQ in place. With ``delta = rowsum(dO * O)``:

    P = exp(S - lse)    dV += P^T dO    dP = dO V^T    dS = P * (dP - delta)
    dQ += dS K * scale  dK += dS^T Q * scale
"""

import jax
import jax.numpy as jnp
from jax import lax

from jaxckpt.attention._masks import loop_bounds
from jaxckpt.attention._tiles import (
    KEY_SIDE_DIMS,
    PV_DIMS,
    QK_DIMS,
    Tiles,
    Tiling,
    pairwise_tile,
    pairwise_tile_start,
    tile_keep,
    tile_logits,
)


def _add_bias_grad(dbias: jax.Array, ds: jax.Array, tl: Tiling, i, j) -> jax.Array:
    """Adds tile (i, j) of dS, summed over the bias's broadcast axes, into dbias."""
    axes = tuple(a for a in range(5) if dbias.shape[a] == 1 and ds.shape[a] > 1)
    update = pairwise_tile(dbias, tl, i, j) + ds.sum(axes, keepdims=True)
    return lax.dynamic_update_slice(dbias, update, pairwise_tile_start(dbias, tl, i, j))


def _q_step(tl: Tiling, d: Tiles, j, k_tile, v_tile, do, lse, delta):
    """One query tile against key tile j: carry ``(dk, dv, dq, dbias)``."""
    st = tl.static
    rate = st.dropout_rate

    def step(i, carry):
        dk, dv, dq, dbias = carry
        q_tile, do_tile = d.q[i], do[i]
        s, tanh = tile_logits(tl, d, i, j, q_tile, k_tile)
        p = jnp.exp(s - lse[i][..., None])
        dp = lax.dot_general(do_tile, v_tile, QK_DIMS, preferred_element_type=jnp.float32)
        p_used = p
        if rate > 0:
            keep = tile_keep(tl, d, i, j)
            p_used = jnp.where(keep, p * (1.0 / (1.0 - rate)), 0.0)
            dp = jnp.where(keep, dp * (1.0 / (1.0 - rate)), 0.0)
        dv = dv + lax.dot_general(
            p_used.astype(do_tile.dtype), do_tile, KEY_SIDE_DIMS, preferred_element_type=jnp.float32
        )
        ds = p * (dp - delta[i][..., None])
        if tanh is not None:
            ds = ds * (1.0 - tanh * tanh)
        if dbias is not None:
            dbias = _add_bias_grad(dbias, ds, tl, i, j)
        ds = (ds * st.scale).astype(q_tile.dtype)
        dq = dq.at[i].add(lax.dot_general(ds, k_tile, PV_DIMS, preferred_element_type=jnp.float32))
        dk = dk + lax.dot_general(ds, q_tile, KEY_SIDE_DIMS, preferred_element_type=jnp.float32)
        return dk, dv, dq, dbias

    return step


def backward(tl: Tiling, d: Tiles, out: jax.Array, lse: jax.Array, do: jax.Array, need_dbias: bool):
    """Blockwise attention backward, all in tile layout.

    Args:
        tl: the static tiling.
        d: the forward's inputs in tile layout.
        out: forward output ``[nq, B, K, G, bq, H]``.
        lse: forward log-sum-exp ``[nq, B, K, G, bq]`` (``-inf`` for rows seeing no key).
        do: output cotangent, like ``out``.
        need_dbias: whether to accumulate the bias gradient.

    Returns:
        ``(dq, dk, dv, dbias)`` in tile layout; ``dbias`` is None unless requested.
    """
    delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    lse = jnp.where(lse == -jnp.inf, jnp.inf, lse)  # rows seeing no key: P = 0
    lo, hi = loop_bounds(d.visible.T)
    _, b, kh, bk, h = d.k.shape
    dbias0 = jnp.zeros(d.bias.shape, jnp.float32) if need_dbias else None

    def k_step(carry, xs):
        dq, dbias = carry
        j, k_tile, v_tile, start, stop = xs
        zeros = jnp.zeros((b, kh, bk, h), jnp.float32)
        step = _q_step(tl, d, j, k_tile, v_tile, do, lse, delta)
        dk, dv, dq, dbias = lax.fori_loop(start, stop, step, (zeros, zeros, dq, dbias))
        return (dq, dbias), (dk.astype(d.k.dtype), dv.astype(d.v.dtype))

    dq0 = jnp.zeros(d.q.shape, jnp.float32)
    (dq, dbias), (dk, dv) = lax.scan(k_step, (dq0, dbias0), (jnp.arange(tl.nk), d.k, d.v, lo, hi))
    return dq.astype(d.q.dtype), dk, dv, dbias
