"""The per-block math that the three Pallas kernels share, written on loaded blocks.

One block is ``bq`` query rows against ``bk`` keys of one (batch, head). Everything here
runs inside a kernel (Triton on a GPU, the Pallas interpreter elsewhere), so it uses only
what both lower: 1-D iotas broadcast to 2-D, ``pl.dot`` on 2-D operands, elementwise
math. The mask is :func:`jaxckpt.attention._masks.visible` itself and the dropout keep
mask is :func:`jaxckpt.attention._dropout.keep` itself, so the Pallas kernel masks and
drops exactly what the blockwise kernel and the reference do.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxckpt.attention import _dropout
from jaxckpt.attention._masks import visible
from jaxckpt.attention.pallas._layout import Layout


class Extras(NamedTuple):
    """The optional refs of a kernel, as ``pallas_call`` hands them over (absent: None).

    ``q_ids`` and ``kv_ids`` are 1-D (the kernel's ids of its batch element); ``bias`` and
    ``mask`` are ``[Tp|1, Sp|1]`` (the kernel's head) or ``[G|1, Tp|1, Sp|1]`` (the
    dK/dV kernel's group); ``seed`` is ``[1]``.
    """

    q_ids: object = None
    kv_ids: object = None
    bias: object = None
    mask: object = None
    seed: object = None


def dot(a: jax.Array, b: jax.Array, *, trans_a: bool = False, trans_b: bool = False) -> jax.Array:
    """``a @ b`` (optionally transposed) in fp32; fp32 operands at full precision (no TF32)."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, precision=precision)


def _pairwise(ref, full: tuple[bool, ...], q0, bq: int, k0, bk: int, head) -> jax.Array:
    """Block (q0, k0) of a bias or mask ref; a broadcast axis is read as size 1.

    The ref is ``[Tp|1, Sp|1]``, or ``[G|1, Tp|1, Sp|1]`` when ``head`` (the query head
    within the group, in the dK/dV kernel) is given.
    """
    rows = pl.ds(q0, bq) if full[2] else pl.ds(0, 1)
    cols = pl.ds(k0, bk) if full[3] else pl.ds(0, 1)
    if head is None:
        return ref[rows, cols]
    return ref[head if full[1] else 0, rows, cols]


def indices(q0, bq: int, k0, bk: int) -> tuple[jax.Array, jax.Array]:
    """Absolute query and key positions of a block, ``[bq, 1]`` and ``[1, bk]`` int32."""
    q_idx = q0 + jnp.arange(bq, dtype=jnp.int32)
    k_idx = k0 + jnp.arange(bk, dtype=jnp.int32)
    return q_idx[:, None], k_idx[None, :]


def logits(lay: Layout, ex: Extras, q, k, q0, k0, head=None) -> tuple[jax.Array, jax.Array | None]:
    """fp32 logits of one block, ``[bq, bk]``, and the soft cap's ``tanh`` (or None).

    ``scale * q k^T``, plus the bias, capped, and ``-inf`` where the mask hides a key.
    ``head``: the query head within the group, for the bias and mask refs of the dK/dV
    kernel (which hold the whole group).
    """
    st = lay.static
    bq, bk = q.shape[0], k.shape[0]
    s = dot(q, k, trans_b=True) * st.scale
    if ex.bias is not None:
        s = s + _pairwise(ex.bias, lay.bias, q0, bq, k0, bk, head).astype(jnp.float32)
    tanh = None
    if st.logits_soft_cap is not None:
        tanh = jnp.tanh(s / st.logits_soft_cap)
        s = st.logits_soft_cap * tanh
    if lay.masked:
        q_idx, k_idx = indices(q0, bq, k0, bk)
        ids = ex.q_ids is not None
        ok = visible(
            st.mask,
            q_idx,
            k_idx,
            q_seg=ex.q_ids[pl.ds(q0, bq)][:, None] if ids else None,
            kv_seg=ex.kv_ids[pl.ds(k0, bk)][None, :] if ids else None,
            mask=None if ex.mask is None else _pairwise(ex.mask, lay.mask, q0, bq, k0, bk, head) != 0,
        )
        s = jnp.where(ok, s, -jnp.inf)
    return s, tanh


def dropped(lay: Layout, ex: Extras, x: jax.Array, b, n, q0, k0) -> jax.Array:
    """``x [bq, bk]`` with dropout at (b, n, q, k): kept entries over ``1 - rate``, others 0."""
    rate = lay.static.dropout_rate
    q_idx, k_idx = indices(q0, x.shape[0], k0, x.shape[1])
    keep = _dropout.keep(ex.seed[0], b, n, q_idx, k_idx, lay.num_heads, rate)
    return jnp.where(keep, x * (1.0 / (1.0 - rate)), 0.0)
