"""FlashAttention-2 backward as three Pallas kernels, with P recomputed from the lse.

1. ``delta = rowsum(dO * O)``, one program per (query block, b, n);
2. dK and dV, one program per (key block, b, key/value head): it keeps its key block and
   accumulates over the G query heads of its group and the query blocks
   ``lo[j] .. hi[j]`` that see it (no atomics, no repeated K/V);
3. dQ, one program per (query block, b, n), over the key blocks ``lo[i] .. hi[i]``; with
   a differentiated bias it also writes ``dS`` block by block, zeros where it skips.

With ``P = exp(S - lse)`` (``lse = +inf`` for a row that sees no key, so ``P = 0``)::

    dV += P^T dO        dP = dO V^T        dS = P * (dP - delta)   (* (1 - tanh^2) capped)
    dQ += dS K * scale  dK += dS^T Q * scale

Dropout multiplies P in ``dV`` and ``dP`` by the same regenerated keep mask as the forward.
"""

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxckpt.attention.pallas import _tile as tile
from jaxckpt.attention.pallas._fwd import (
    bounds_spec,
    extras_specs,
    flat_extras,
    run_kernel,
    unflat_extras,
)
from jaxckpt.attention.pallas._layout import Layout


def _delta_kernel(o_ref, do_ref, delta_ref):
    o, do = o_ref[...].astype(jnp.float32), do_ref[...].astype(jnp.float32)
    delta_ref[...] = jnp.sum(o * do, axis=1)


def delta(lay: Layout, out, do):
    """``rowsum(dO * O)`` ``[B, N, Tp]`` fp32 from padded ``out`` and ``dO`` ``[B, Tp, N, Hp]``."""
    bq = lay.dq[0]
    rows = pl.BlockSpec((None, bq, None, lay.h_pad), lambda i, b, n: (b, i, n, 0))
    (dlt,) = run_kernel(
        lay,
        _delta_kernel,
        "jaxckpt_flash_bwd_delta",
        grid=(lay.t_pad // bq, lay.batch, lay.num_heads),
        in_specs=[rows, rows],
        out_specs=[pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, i))],
        out_shapes=[((lay.batch, lay.num_heads, lay.t_pad), jnp.float32)],
        args=(out, do),
    )
    return dlt


def _ds(lay, ex, q, k, v, do, lse, dlt, b, n, q0, k0, head=None):
    """``(P as dV reads it, dS)`` of one block, both ``[bq, bk]`` fp32 (dS without the scale)."""
    s, tanh = tile.logits(lay, ex, q, k, q0, k0, head)
    p = jnp.exp(s - lse[:, None])
    dp = tile.dot(do, v, trans_b=True)
    p_used = p
    if lay.dropout:
        p_used = tile.dropped(lay, ex, p, b, n, q0, k0)
        dp = tile.dropped(lay, ex, dp, b, n, q0, k0)
    ds = p * (dp - dlt[:, None])
    if tanh is not None:
        ds = ds * (1.0 - tanh * tanh)
    return p_used, ds


def _dkdv_kernel(lay: Layout, present, q_ref, k_ref, v_ref, do_ref, lse_ref, dlt_ref, lo_ref, hi_ref, *refs):
    *extra_refs, dk_ref, dv_ref = refs
    ex = unflat_extras(present, extra_refs)
    bq, bk = lay.dkdv
    j, b, kh = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    k0 = j * bk
    k, v = k_ref[...], v_ref[...]

    def head(g, carry):
        n = kh * lay.groups + g

        def block(i, carry):
            dk, dv = carry
            q0 = pl.multiple_of(i * bq, bq)
            rows = pl.ds(q0, bq)
            q, do = q_ref[rows, g, :], do_ref[rows, g, :]
            p, ds = _ds(lay, ex, q, k, v, do, lse_ref[g, rows], dlt_ref[g, rows], b, n, q0, k0, g)
            dv = dv + tile.dot(p.astype(do.dtype), do, trans_a=True)
            dk = dk + tile.dot(ds.astype(q.dtype), q, trans_a=True)
            return dk, dv

        return lax.fori_loop(lo_ref[j], hi_ref[j], block, carry)

    zeros = jnp.zeros((bk, lay.h_pad), jnp.float32)
    dk, dv = lax.fori_loop(0, lay.groups, head, (zeros, zeros))
    dk_ref[...] = (dk * lay.static.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def dkdv(lay: Layout, q, k, v, do, lse, dlt, bounds, extras: tile.Extras):
    """dK and dV ``[B, Sp, K, Hp]`` (the input dtype) from padded operands.

    ``lse`` is ``+inf`` on rows that see no key; ``bounds`` are per key block.
    """
    _, bk = lay.dkdv
    nk, g = lay.s_pad // bk, lay.groups
    group_rows = pl.BlockSpec((None, lay.t_pad, g, lay.h_pad), lambda j, b, h: (b, 0, h, 0))
    group_stats = pl.BlockSpec((None, g, lay.t_pad), lambda j, b, h: (b, h, 0))
    keys = pl.BlockSpec((None, bk, None, lay.h_pad), lambda j, b, h: (b, j, h, 0))
    return run_kernel(
        lay,
        functools.partial(_dkdv_kernel, lay, extras),
        "jaxckpt_flash_bwd_dkdv",
        grid=(nk, lay.batch, lay.kv_heads),
        in_specs=[
            group_rows,
            keys,
            keys,
            group_rows,
            group_stats,
            group_stats,
            bounds_spec(nk),
            bounds_spec(nk),
            *extras_specs(lay, extras, per_group=True),
        ],
        out_specs=[keys, keys],
        out_shapes=[(k.shape, k.dtype), (v.shape, v.dtype)],
        args=(q, k, v, do, lse, dlt, *bounds, *flat_extras(extras)),
    )


def _dq_kernel(
    lay: Layout, present, need_ds: bool, q_ref, k_ref, v_ref, do_ref, lse_ref, dlt_ref, lo_ref, hi_ref, *refs
):
    if need_ds:
        *extra_refs, dq_ref, ds_ref = refs
    else:
        *extra_refs, dq_ref = refs
    ex = unflat_extras(present, extra_refs)
    bq, bk = lay.dq
    i, b, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q0 = i * bq
    q, do, lse, dlt = q_ref[...], do_ref[...], lse_ref[...], dlt_ref[...]
    lo, hi = lo_ref[i], hi_ref[i]

    def block(j, dq):
        k0 = pl.multiple_of(j * bk, bk)
        k, v = k_ref[pl.ds(k0, bk), :], v_ref[pl.ds(k0, bk), :]
        _, ds = _ds(lay, ex, q, k, v, do, lse, dlt, b, n, q0, k0)
        if need_ds:
            ds_ref[:, pl.ds(k0, bk)] = ds
        return dq + tile.dot(ds.astype(k.dtype), k)

    if need_ds:  # the blocks the loop skips hold dS = 0

        def zero(j, _):
            ds_ref[:, pl.ds(pl.multiple_of(j * bk, bk), bk)] = jnp.zeros((bq, bk), jnp.float32)
            return _

        lax.fori_loop(0, lo, zero, 0)
        lax.fori_loop(hi, lay.s_pad // bk, zero, 0)
    dq = lax.fori_loop(lo, hi, block, jnp.zeros((bq, lay.h_pad), jnp.float32))
    dq_ref[...] = (dq * lay.static.scale).astype(dq_ref.dtype)


def dq(lay: Layout, q, k, v, do, lse, dlt, bounds, extras: tile.Extras, *, need_ds: bool):
    """dQ ``[B, Tp, N, Hp]`` (the input dtype), and with ``need_ds`` the fp32 ``dS``
    ``[B, N, Tp, Sp]`` that the bias gradient is summed from."""
    bq, _ = lay.dq
    nq, g = lay.t_pad // bq, lay.groups
    rows = pl.BlockSpec((None, bq, None, lay.h_pad), lambda i, b, n: (b, i, n, 0))
    keys = pl.BlockSpec((None, lay.s_pad, None, lay.h_pad), lambda i, b, n: (b, 0, n // g, 0))
    stats = pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, i))
    out_specs, out_shapes = [rows], [(q.shape, q.dtype)]
    if need_ds:
        out_specs.append(pl.BlockSpec((None, None, bq, lay.s_pad), lambda i, b, n: (b, n, i, 0)))
        out_shapes.append(((lay.batch, lay.num_heads, lay.t_pad, lay.s_pad), jnp.float32))
    return run_kernel(
        lay,
        functools.partial(_dq_kernel, lay, extras, need_ds),
        "jaxckpt_flash_bwd_dq",
        grid=(nq, lay.batch, lay.num_heads),
        in_specs=[
            rows,
            keys,
            keys,
            rows,
            stats,
            stats,
            bounds_spec(nq),
            bounds_spec(nq),
            *extras_specs(lay, extras, per_group=False),
        ],
        out_specs=out_specs,
        out_shapes=out_shapes,
        args=(q, k, v, do, lse, dlt, *bounds, *flat_extras(extras)),
    )
