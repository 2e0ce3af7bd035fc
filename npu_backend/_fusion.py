"""``fusion_attention``: jaxckpt attention through the CANN fused kernel, with a custom VJP.

The forward calls ``npu_fusion_attention`` and keeps ``(out, softmax_max, softmax_sum,
seed, offset, numels)``; the backward calls ``npu_fusion_attention_grad`` with them.
Both calls are host callbacks (``torch_bridge.call_torch``): the arrays cross to torch
through DLPack/numpy without copies on the CPU and move to the NPU there.
"""

import functools

import jax
import jax.numpy as jnp

from jaxckpt.attention import AttentionInputs, features_used, normalize
from jaxckpt.attention._validate import finish
from npu_backend import _host
from npu_backend._ops import FusionOps, torch_npu_ops
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


def _extras(p: AttentionInputs) -> dict:
    """The traced optional inputs the host functions read, by name (absent ones left out)."""
    a = p.arrays
    named = {"bias": p.bias, "mask": a.mask, "q_len": a.q_lengths, "kv_len": a.kv_lengths}
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
    (the function registered as ``implementation="npu"``)."""
    return _attention(call_plan(p), ops, p.query, p.key, p.value, _extras(p))


def fusion_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    scale=None,
    is_causal=False,
    local_window_size=None,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    segment_ids=None,
    logits_soft_cap=None,
    dropout_rate=0.0,
    dropout_rng=None,
    ops: FusionOps | None = None,
):
    """Attention through ``torch_npu.npu_fusion_attention`` (forward) and
    ``npu_fusion_attention_grad`` (backward), in the ``jaxckpt.flash_attention`` layout.

    Every argument means what it means for ``jaxckpt.flash_attention`` (BTNH, mask
    True = attend, top-left causal); ``npu_backend._translate`` documents how each one
    becomes the op's. A query row that sees no key gets 0 and zero gradients.

    Args:
        query, key, value, bias, mask, scale, is_causal, local_window_size,
            query_seq_lengths, key_value_seq_lengths, segment_ids, dropout_rate,
            dropout_rng: as ``jaxckpt.flash_attention``.
        logits_soft_cap: not supported (``NotImplementedError``).
        ops: where the two ops come from. None: torch_npu on the NPU (the real CANN
            kernels). ``npu_backend.reference_ops()``: the plain-torch reference of
            the op contract, on the CPU, which is how this route is tested without
            an NPU.

    Raises:
        NotImplementedError: ``logits_soft_cap`` (the kernel has no soft cap).

    Lengths and segment ids go through the TND layout. Segment ids it cannot express
    (a segment split into several runs; with ``is_causal``, query and key runs that
    start apart) and any lengths or segments combined with a bias, a mask or a window
    join the full ``atten_mask`` instead (BSND, O(T * S) mask memory).
        RuntimeError: ``ops=None`` where torch_npu cannot run (the reason is given).

    Example:
        >>> import jax, npu_backend
        >>> q = jax.random.normal(jax.random.key(0), (2, 5, 6, 8))
        >>> kv = jax.random.normal(jax.random.key(1), (2, 7, 3, 8))
        >>> out = npu_backend.fusion_attention(q, kv, kv, is_causal=True, ops=npu_backend.reference_ops())
        >>> out.shape
        (2, 5, 6, 8)
    """
    p = normalize(
        query,
        key,
        value,
        bias,
        mask,
        scale=scale,
        is_causal=is_causal,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size,
        segment_ids=segment_ids,
        logits_soft_cap=logits_soft_cap,
        dropout_rate=dropout_rate,
        dropout_rng=dropout_rng,
    )
    out, lse = npu_attention(p, ops if ops is not None else torch_npu_ops())
    return finish(out, lse, p.unbatched, False)
