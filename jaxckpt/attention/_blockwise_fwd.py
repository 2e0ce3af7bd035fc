"""FlashAttention-2 forward: online softmax over key tiles, fp32 accumulators.

For each query tile (a ``scan``), a ``fori_loop`` runs over only the key tiles
that ``Tiles.visible`` marks as holding a visible pair: its bounds do the work
skipping (causal, window, lengths, segments, a sparse mask). Tiles that are
entirely visible (``Tiles.full``) take a branch that computes no mask.
"""

import functools

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
    tile_keep,
    tile_logits,
)
from jaxckpt.attention._vma import vary_like


def _update(tl: Tiling, d: Tiles, i, q_tile, j, carry, *, masked: bool):
    """One key tile of the online softmax: carry ``(row max, row sum, acc)``."""
    rate = tl.static.dropout_rate
    m_prev, l_prev, acc = carry
    s, _ = tile_logits(tl, d, i, j, q_tile, d.k_t[j], masked)
    m_new = jnp.maximum(m_prev, s.max(-1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - m_safe[..., None])
    alpha = jnp.exp(m_prev - m_safe)
    l_new = alpha * l_prev + p.sum(-1)
    if rate > 0:
        p = dropped(tl, tile_keep(tl, d, i, j), p)
    v_tile = d.v[j]
    pv = lax.dot_general(p.astype(v_tile.dtype), v_tile, MATMUL, preferred_element_type=jnp.float32)
    return m_new, l_new, alpha[..., None] * acc + pv


def forward(tl: Tiling, d: Tiles, out_dtype=None) -> tuple[jax.Array, jax.Array]:
    """Blockwise attention forward.

    Args:
        tl: the static tiling.
        d: the inputs in tile layout.
        out_dtype: the dtype of ``out``; None: the input dtype (context parallelism asks
            for float32, to merge the partial outputs of several key blocks unrounded).

    Returns:
        ``(out [nq, B*K, G*bq, H] in out_dtype, lse [nq, B*K, G*bq] fp32)``;
        rows that see no key get ``out = 0`` and ``lse = -inf``.
    """
    lo, hi = loop_bounds(d.visible)
    _, bkh, rows, h = d.q.shape
    stat_shape = (bkh, rows)

    def q_step(_, xs):
        i, q_tile, start, stop = xs
        update = functools.partial(_update, tl, d, i, q_tile)

        def kv_step(j, carry):
            return mask_only_if_needed(d, i, j, update, j, carry)

        init = (
            jnp.full(stat_shape, -jnp.inf, jnp.float32),
            jnp.zeros(stat_shape, jnp.float32),
            jnp.zeros((*stat_shape, h), jnp.float32),
        )
        init = vary_like(init, q_tile, d)
        row_max, row_sum, acc = lax.fori_loop(start, stop, kv_step, init)
        seen = row_sum > 0
        denom = jnp.where(seen, row_sum, 1.0)
        out = jnp.where(seen[..., None], acc / denom[..., None], 0.0)
        lse = jnp.where(seen, row_max + jnp.log(denom), -jnp.inf)
        return None, (out.astype(out_dtype or d.q.dtype), lse)

    _, (out, lse) = lax.scan(q_step, None, (jnp.arange(tl.nq, dtype=jnp.int32), d.q, lo, hi))
    return out, lse
