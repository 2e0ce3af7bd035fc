"""The host side of the NPU route: torch tensors in, the fused ops called, tensors out.

``forward`` and ``backward`` run inside ``torch_bridge.call_torch`` callbacks. They move
the inputs to the ops' device, call ``npu_fusion_attention`` / ``..._grad`` with the
arguments ``_translate`` builds, and bring back the output, the fp32 row statistics
(``softmax_max``, ``softmax_sum``: the residuals of the backward) and the dropout
generator state ``(seed, offset, numels)``, packed as int32 words.
"""

import math

from npu_backend._ops import FusionOps
from npu_backend._translate import (
    CallPlan,
    compressed_causal_mask,
    join_int64,
    mask_arguments,
    pse_argument,
    reduce_to,
    split_int64,
)
from npu_backend._varlen import NotTND, Packing, packing
from torch_bridge.interop import torch

STAT_WIDTH = 8
"""``softmax_max``/``softmax_sum`` repeat each row's value 8 times on their last axis."""


def _rng_words(seed: int, offset: int, numels: int) -> "torch.Tensor":
    return torch().tensor(
        [*split_int64(seed), *split_int64(offset), *split_int64(numels)], dtype=torch().int32
    )


def _rng_values(words) -> dict:
    w = [int(x) for x in words.tolist()]
    return {
        "seed": join_int64(w[0], w[1]),
        "offset": join_int64(w[2], w[3]),
        "numels": join_int64(w[4], w[5]),
    }


def _widen(stat: "torch.Tensor") -> "torch.Tensor":
    return stat[..., None].expand(*stat.shape, STAT_WIDTH).contiguous()


def _common(plan: CallPlan) -> dict:
    return {"keep_prob": plan.keep_prob}


def _bsnd_kwargs(plan: CallPlan, extras: dict, batch: int, device) -> tuple[dict, object]:
    kwargs, empty = mask_arguments(plan, extras, batch, device)
    if plan.bias:
        kwargs["pse"] = pse_argument(plan, extras["bias"].to(device), batch)
    return kwargs, empty


def _zero_rows(x: "torch.Tensor", empty) -> "torch.Tensor":
    """``x [B, T, N, H]`` with the rows of ``empty [B', N', T]`` set to 0."""
    return x if empty is None else x.masked_fill(empty.permute(0, 2, 1)[..., None].to(x.device), 0)


def _tnd(plan: CallPlan, extras: dict, batch: int) -> Packing | None:
    """The call's TND packing; None for BSND, including segment ids TND cannot express
    (those then join the full ``atten_mask``, at O(T * S) mask memory)."""
    if not plan.varlen:
        return None
    try:
        return _packed(plan, extras, batch)
    except NotTND:
        return None


def forward(plan: CallPlan, ops: FusionOps, q, k, v, extras: dict):
    """``(out [B,T,N,H], lse [B,N,T], softmax_max [B,N,T], softmax_sum [B,N,T], rng int32[6])``."""
    if "seed" in extras:
        ops.manual_seed(int(extras["seed"]))
    pk = _tnd(plan, extras, q.shape[0])
    if pk is not None:
        return _forward_tnd(plan, ops, q, k, v, pk)
    dev, batch = ops.device, q.shape[0]
    kwargs, empty = _bsnd_kwargs(plan, extras, batch, dev)
    res = ops.forward(
        q.to(dev), k.to(dev), v.to(dev), plan.heads, "BSND", scale=plan.scale, **_common(plan), **kwargs
    )
    out = _zero_rows(res[0].cpu(), empty)
    smax, ssum = (r[..., 0].float().cpu() for r in res[1:3])
    lse = smax + ssum.log()
    if empty is not None:
        lse = lse.masked_fill(empty.expand_as(lse), -math.inf)
    return out, lse, smax, ssum, _rng_words(*res[4:7])


def backward(plan: CallPlan, ops: FusionOps, q, k, v, out, dout, smax, ssum, rng, extras: dict):
    """``(dq, dk, dv)``, plus ``dbias`` (shaped like the bias) when the call has one."""
    pk = _tnd(plan, extras, q.shape[0])
    if pk is not None:
        return _backward_tnd(plan, ops, pk, q, k, v, out, dout, smax, ssum, rng)
    dev, batch = ops.device, q.shape[0]
    kwargs, empty = _bsnd_kwargs(plan, extras, batch, dev)
    dout = _zero_rows(dout, empty)
    res = ops.backward(
        *(x.to(dev) for x in (q, k, v, dout)),
        plan.heads,
        "BSND",
        softmax_max=_widen(smax).to(dev),
        softmax_sum=_widen(ssum).to(dev),
        attention_in=out.to(dev),
        scale_value=plan.scale,
        **_common(plan),
        **_rng_values(rng),
        **kwargs,
    )
    grads = tuple(g.cpu() for g in res[:3])
    if not plan.bias:
        return grads
    bias = extras["bias"]
    return (*grads, reduce_to(res[3].cpu().float() / plan.scale, tuple(bias.shape)).to(bias.dtype))


# ----------------------------------------------------------------------------- TND


def _packed(plan: CallPlan, extras: dict, batch: int) -> Packing:
    return packing(
        plan, batch, extras.get("q_len"), extras.get("kv_len"), extras.get("q_seg"), extras.get("kv_seg")
    )


def _tnd_kwargs(plan: CallPlan, pk: Packing, device) -> dict:
    kwargs = {"actual_seq_qlen": pk.cu_q, "actual_seq_kvlen": pk.cu_kv}
    if plan.causal:
        kwargs |= {"sparse_mode": 2, "atten_mask": compressed_causal_mask(device)}
    return kwargs


def _gather(x, index, device):
    """The packed rows ``index`` of ``x [B, L, ...]`` (flattened to ``[B * L, ...]``)."""
    return x.reshape(-1, *x.shape[2:])[index].to(device)


def _scatter(packed, index, batch: int, length: int, fill: float = 0.0):
    """``packed [P, ...]`` put back at rows ``index`` of a ``[B, L, ...]`` tensor of ``fill``."""
    full = torch().full((batch * length, *packed.shape[1:]), fill, dtype=packed.dtype)
    full[index] = packed.cpu()
    return full.reshape(batch, length, *packed.shape[1:])


def _blocks(cu: list[int]):
    """``(start, stop)`` rows of each TND sequence."""
    return zip([0, *cu[:-1]], cu, strict=True)


def ntd_to_rows(stat, cu: list[int]) -> "torch.Tensor":
    """``[P, N]`` per packed row from a TND ``softmax_max``/``softmax_sum``.

    Its shape is ``[P, N, 8]`` but by default (the op's "NTD" softmax layout) its memory
    holds one ``[N, Sq_i, 8]`` block per sequence, at row offset ``start_i``.
    """
    flat, heads = stat.reshape(-1), stat.shape[1]
    width = stat.shape[-1]
    parts = [
        flat[a * heads * width : b * heads * width].reshape(heads, b - a, width)[..., 0].T
        for a, b in _blocks(cu)
    ]
    return torch().cat(parts)


def rows_to_ntd(rows, cu: list[int]) -> "torch.Tensor":
    """The inverse of ``ntd_to_rows``: ``[P, N]`` -> ``[P, N, 8]`` in NTD blocks."""
    parts = [_widen(rows[a:b].T).reshape(-1) for a, b in _blocks(cu)]
    return torch().cat(parts).reshape(rows.shape[0], rows.shape[1], STAT_WIDTH)


def _forward_tnd(plan: CallPlan, ops: FusionOps, q, k, v, pk: Packing):
    th, dev, batch = torch(), ops.device, q.shape[0]
    zeros = th.zeros(batch, plan.heads, plan.t)
    if pk.q_index.numel() == 0:  # no query sees a key
        return th.zeros_like(q), zeros - math.inf, zeros, zeros + 1, _rng_words(0, 0, 0)
    res = ops.forward(
        _gather(q, pk.q_index, dev),
        _gather(k, pk.kv_index, dev),
        _gather(v, pk.kv_index, dev),
        plan.heads,
        "TND",
        scale=plan.scale,
        **_common(plan),
        **_tnd_kwargs(plan, pk, dev),
    )
    out = _scatter(res[0], pk.q_index, batch, plan.t)
    smax, ssum = (ntd_to_rows(r.float().cpu(), pk.cu_q) for r in res[1:3])  # [P, N]
    lse = _scatter(smax + ssum.log(), pk.q_index, batch, plan.t, -math.inf).permute(0, 2, 1)
    smax = _scatter(smax, pk.q_index, batch, plan.t).permute(0, 2, 1)
    ssum = _scatter(ssum, pk.q_index, batch, plan.t, 1.0).permute(0, 2, 1)
    return out, lse.contiguous(), smax.contiguous(), ssum.contiguous(), _rng_words(*res[4:7])


def _backward_tnd(plan: CallPlan, ops: FusionOps, pk: Packing, q, k, v, out, dout, smax, ssum, rng):
    dev, batch = ops.device, q.shape[0]
    if pk.q_index.numel() == 0:
        return torch().zeros_like(q), torch().zeros_like(k), torch().zeros_like(v)
    stats = (_gather(s.permute(0, 2, 1), pk.q_index, "cpu") for s in (smax, ssum))  # [P, N]
    smax_p, ssum_p = (rows_to_ntd(s, pk.cu_q).to(dev) for s in stats)
    res = ops.backward(
        _gather(q, pk.q_index, dev),
        _gather(k, pk.kv_index, dev),
        _gather(v, pk.kv_index, dev),
        _gather(dout, pk.q_index, dev),
        plan.heads,
        "TND",
        softmax_max=smax_p,
        softmax_sum=ssum_p,
        attention_in=_gather(out, pk.q_index, dev),
        scale_value=plan.scale,
        **_common(plan),
        **_rng_values(rng),
        **_tnd_kwargs(plan, pk, dev),
    )
    dq = _scatter(res[0], pk.q_index, batch, plan.t)
    dk, dv = (_scatter(g, pk.kv_index, batch, plan.s) for g in res[1:3])
    return dq, dk, dv
