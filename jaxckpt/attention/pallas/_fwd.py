"""FlashAttention-2 forward as a Pallas kernel: one program per (query block, b, n).

Each program keeps its ``[bq, Hp]`` query block, runs an online softmax over the key
blocks ``lo[i] .. hi[i]`` (the work-skipping bounds of ``pallas._layout.block_bounds``)
with fp32 statistics and accumulator, and writes ``out`` (the input dtype) and the
log-sum-exp (fp32; ``-inf`` and ``out = 0`` for a row that sees no key). K and V are
read at head ``n // G``: GQA without repeating them.

The refs a kernel receives are described once, by :func:`specs`, for every kernel: the
row-side operands blocked like the kernel's query axis, the key side whole (or blocked
like its key axis in the dK/dV kernel), the extras (ids, bias, mask, seed) as
``pallas._tile.Extras``.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxckpt.attention._vma import vary_like
from jaxckpt.attention.pallas import _tile as tile
from jaxckpt.attention.pallas._layout import Layout


def extras_specs(lay: Layout, extras: tile.Extras, *, per_group: bool):
    """BlockSpecs of the extras, for a grid ``(block, b, head)``.

    ``per_group``: the grid's head axis is the key/value head (dK/dV kernel); the bias and
    mask then hold the G query heads of that group (or 1 when broadcast over heads).
    """
    g = lay.groups if per_group else None

    def pairwise(full):
        shape = (None, (g if full[1] else 1) if per_group else None)
        shape = (*shape, lay.t_pad if full[2] else 1, lay.s_pad if full[3] else 1)
        return pl.BlockSpec(shape, lambda _, b, h: (b if full[0] else 0, h if full[1] else 0, 0, 0))

    ids_q = pl.BlockSpec((None, lay.t_pad), lambda _, b, h: (b, 0))
    ids_kv = pl.BlockSpec((None, lay.s_pad), lambda _, b, h: (b, 0))
    specs = tile.Extras(
        q_ids=ids_q,
        kv_ids=ids_kv,
        bias=None if lay.bias is None else pairwise(lay.bias),
        mask=None if lay.mask is None else pairwise(lay.mask),
        seed=pl.BlockSpec((1,), lambda *_: (0,)),
    )
    return [s for s, x in zip(specs, extras, strict=True) if x is not None]


def flat_extras(extras: tile.Extras) -> list:
    """The extras that are present, in :class:`~jaxckpt.attention.pallas._tile.Extras` order."""
    return [x for x in extras if x is not None]


def unflat_extras(present: tile.Extras, refs) -> tile.Extras:
    """Rebuilds :class:`Extras` of refs from the flat refs a kernel got (``present`` says which)."""
    refs = iter(refs)
    return tile.Extras(*(None if x is None else next(refs) for x in present))


def run_kernel(lay: Layout, kernel, name: str, *, grid, in_specs, out_specs, out_shapes, args):
    """``pallas_call`` of ``kernel`` on ``args``, with ``out_shapes`` as ``(shape, dtype)``s.

    Inside ``jax.shard_map`` with ``check_vma`` an output must say over which mesh axes it
    varies: the inputs are cast to vary over all their axes, and the outputs vary like them.
    """
    args = vary_like(list(args), *args)
    mat = jax.typeof(args[0]).mat
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=[jax.ShapeDtypeStruct(s, d, manual_axis_type=mat) for s, d in out_shapes],
        compiler_params=plgpu.CompilerParams(num_warps=lay.num_warps, num_stages=lay.num_stages),
        interpret=lay.interpret,
        name=name,
    )(*args)


def bounds_spec(n: int):
    return pl.BlockSpec((n,), lambda *_: (0,))


def _kernel(lay: Layout, present: tile.Extras, q_ref, k_ref, v_ref, lo_ref, hi_ref, *refs):
    *extra_refs, o_ref, lse_ref = refs
    ex = unflat_extras(present, extra_refs)
    bq, bk = lay.fwd
    i, b, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q0 = i * bq
    q = q_ref[...]

    def body(j, carry):
        m_prev, l_prev, acc = carry
        k0 = pl.multiple_of(j * bk, bk)
        s, _ = tile.logits(lay, ex, q, k_ref[pl.ds(k0, bk), :], q0, k0)
        m_new = jnp.maximum(m_prev, s.max(axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_safe[:, None])
        alpha = jnp.exp(m_prev - m_safe)
        l_new = alpha * l_prev + p.sum(axis=1)
        if lay.dropout:
            p = tile.dropped(lay, ex, p, b, n, q0, k0)
        v = v_ref[pl.ds(k0, bk), :]
        return m_new, l_new, alpha[:, None] * acc + tile.dot(p.astype(v.dtype), v)

    init = (
        jnp.full((bq,), -jnp.inf, jnp.float32),
        jnp.zeros((bq,), jnp.float32),
        jnp.zeros((bq, lay.h_pad), jnp.float32),
    )
    m, row_sum, acc = lax.fori_loop(lo_ref[i], hi_ref[i], body, init)
    seen = row_sum > 0
    denom = jnp.where(seen, row_sum, 1.0)
    o_ref[...] = jnp.where(seen[:, None], acc / denom[:, None], 0.0).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log(denom), -jnp.inf)


def forward(lay: Layout, q, k, v, bounds, extras: tile.Extras):
    """The forward kernel on padded operands.

    Args:
        lay: the static layout.
        q: ``[B, Tp, N, Hp]``; k, v: ``[B, Sp, K, Hp]``.
        bounds: ``(lo, hi)`` int32 ``[Tp / bq]``: the key blocks each query block visits.
        extras: the padded ids, bias, int8 mask and seed (absent: None).

    Returns:
        ``(out [B, Tp, N, Hp] in q's dtype, lse [B, N, Tp] fp32)``.
    """
    bq, _ = lay.fwd
    nq = lay.t_pad // bq
    g = lay.groups
    rows = pl.BlockSpec((None, bq, None, lay.h_pad), lambda i, b, n: (b, i, n, 0))
    keys = pl.BlockSpec((None, lay.s_pad, None, lay.h_pad), lambda i, b, n: (b, 0, n // g, 0))
    return run_kernel(
        lay,
        functools.partial(_kernel, lay, extras),
        "jaxckpt_flash_fwd",
        grid=(nq, lay.batch, lay.num_heads),
        in_specs=[
            rows,
            keys,
            keys,
            bounds_spec(nq),
            bounds_spec(nq),
            *extras_specs(lay, extras, per_group=False),
        ],
        out_specs=[rows, pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, i))],
        out_shapes=[(q.shape, q.dtype), ((lay.batch, lay.num_heads, lay.t_pad), jnp.float32)],
        args=(q, k, v, *bounds, *flat_extras(extras)),
    )
