"""The NPU route: jaxckpt attention through the CANN fused kernel, with a custom VJP.

:func:`npu_attention` is the function registered as ``implementation="npu"`` (and, with
the plain-torch ops, ``"npu_reference"``): it is reached through
``jaxckpt.flash_attention(..., implementation="npu")``, which validates the arguments
once. The forward calls ``npu_fusion_attention`` and keeps ``(out, softmax_max,
softmax_sum, seed, offset, numels)``; the backward calls ``npu_fusion_attention_grad``
with them. Both calls are host callbacks (``torch_bridge.call_torch``): the arrays cross
to torch through DLPack/numpy without copies on the CPU and move to the NPU there.

The attention mask is built here, in JAX, from jaxckpt's one mask predicate
(``jaxckpt.attention.full_mask``, i.e. ``visible`` on the whole grid) and handed over as
the op's ``atten_mask`` (True = masked out); the torch side only lays it out.
"""

import functools

import jax
import jax.numpy as jnp

from jaxckpt.attention import AttentionInputs, features_used, full_mask
from npu_backend import _host
from npu_backend._ops import FusionOps
from npu_backend._translate import CallPlan
from torch_bridge import call_torch

UNSUPPORTED = frozenset({"softcap"})
"""jaxckpt features the fused kernel has no counterpart for."""


def call_plan(p: AttentionInputs) -> CallPlan:
    """The static description of a call, checked against what the route supports.

    Raises:
        NotImplementedError: naming an argument the NPU route cannot take.
    """
    used = features_used(p)
    if "softcap" in used:
        raise NotImplementedError(
            "implementation='npu' does not support logits_soft_cap (the CANN kernel has none)"
        )
    st = p.static
    plan = CallPlan(
        heads=p.query.shape[2],
        t=st.mask.t,
        s=st.mask.s,
        scale=float(st.scale),
        causal=st.mask.is_causal,
        window=st.mask.window,
        keep_prob=1.0 - float(st.dropout_rate),
        bias="bias" in used,
        mask="mask" in used,
        lengths="lengths" in used,
        segments="segments" in used,
    )
    return plan


def _extras(plan: CallPlan, p: AttentionInputs) -> dict:
    """The traced optional inputs the host functions read, by name (absent ones left out).

    ``atten_mask``: ``~full_mask(p)``, bool ``[B|1, N|1, T, S]``, True = masked out (the
    op's polarity), when the call needs the full mask. ``q_len``/``kv_len``/``q_seg``/
    ``kv_seg``: only for the TND layout, which packs the tokens they select.
    """
    a = p.arrays
    named = {"bias": p.bias}
    if plan.full_mask:
        named["atten_mask"] = jnp.logical_not(full_mask(p))
    if plan.varlen:
        named |= {"q_len": a.q_lengths, "kv_len": a.kv_lengths}
        named |= {"q_seg": a.q_segments, "kv_seg": a.kv_segments}
    if p.static.dropout_rate > 0:
        named["seed"] = jax.random.randint(p.dropout_rng, (), 0, 2**31 - 1, dtype=jnp.int32)
    return {k: v for k, v in named.items() if v is not None}


def _forward_shapes(plan: CallPlan, q: jax.Array):
    b = q.shape[0]
    stat = jax.ShapeDtypeStruct((b, plan.heads, plan.t), jnp.float32)
    rng = jax.ShapeDtypeStruct((6,), jnp.int32)
    return (jax.ShapeDtypeStruct(q.shape, q.dtype), stat, stat, stat, rng)


def _host_forward(plan, ops, q, k, v, extras):
    fn = functools.partial(_host.forward, plan, ops)
    return call_torch(fn, _forward_shapes(plan, q))(q, k, v, extras)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attention(plan: CallPlan, ops: FusionOps, q, k, v, extras):
    out, lse, *_ = _host_forward(plan, ops, q, k, v, extras)
    return out, lse


def _attention_fwd(plan, ops, q, k, v, extras):
    out, lse, smax, ssum, rng = _host_forward(plan, ops, q, k, v, extras)
    return (out, lse), (q, k, v, extras, out, smax, ssum, rng)


def _attention_bwd(plan, ops, residuals, cotangents):
    q, k, v, extras, out, smax, ssum, rng = residuals
    dout, _ = cotangents  # the lse is not differentiated (as in jax.nn)
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
    if plan.bias:
        shapes.append(jax.ShapeDtypeStruct(extras["bias"].shape, extras["bias"].dtype))
    fn = functools.partial(_host.backward, plan, ops)
    grads = call_torch(fn, tuple(shapes))(q, k, v, out, dout.astype(out.dtype), smax, ssum, rng, extras)
    d_extras = {name: None for name in extras}
    if plan.bias:
        d_extras["bias"] = grads[3]
    return (*grads[:3], d_extras)


_attention.defvjp(_attention_fwd, _attention_bwd)


def npu_attention(p: AttentionInputs, ops: FusionOps) -> tuple[jax.Array, jax.Array]:
    """``(out [B, T, N, H], lse [B, N, T] fp32)`` of canonical inputs through ``ops``
    (the function registered as ``implementation="npu"`` and ``"npu_reference"``).

    Raises:
        NotImplementedError: ``logits_soft_cap`` (the kernel has no soft cap).

    Example:
        >>> import jax
        >>> from jaxckpt.attention import normalize
        >>> from npu_backend._fusion import npu_attention
        >>> from npu_backend._ops import reference_ops
        >>> q = jax.random.normal(jax.random.key(0), (2, 5, 6, 8))
        >>> kv = jax.random.normal(jax.random.key(1), (2, 7, 3, 8))
        >>> out, lse = npu_attention(normalize(q, kv, kv, is_causal=True), reference_ops())
        >>> out.shape, lse.shape
        ((2, 5, 6, 8), (2, 6, 5))
    """
    plan = call_plan(p)
    return _attention(plan, ops, p.query, p.key, p.value, _extras(plan, p))
