"""A plain-torch reference of ``torch_npu.npu_fusion_attention`` and its grad op.

No Ascend hardware is needed: CPU tests inject this module where the NPU code
calls ``torch_npu``. It follows the ops' documented contract, and rejects with a
``ValueError``/``TypeError`` naming the argument what the docs forbid or leave
undefined, instead of returning numbers the real kernel would not.

Forward (``pse_type`` 1, the only one torch_npu exposes; pse is inside the scale)::

    attention_out = Dropout(Softmax(Mask(scale * (pse + query @ key^T), atten_mask)), keep_prob) @ value

Masks (True / 1 = masked out). For each pair (i, j) of a query row and key column,
with ``d = j - i``:

* ``sparse_mode=0`` (defaultMask): ``atten_mask`` in BNSS, B1SS, 11SS or SS. With
  it, the band ``-pre_tockens <= d <= next_tockens`` (top-left) must agree with it:
  every pair outside the band must be masked, else ``ValueError``. Negative tokens
  follow the documented rules (``next < 0``: ``pre >= |next|``, ``|next| < Skv``;
  ``pre < 0``: ``next >= |pre|``, ``|pre| < Sq``).
* ``1`` (allMask): the full ``atten_mask`` alone; pre/next are ignored.
* ``2`` (leftUpCausal): ``d <= 0``. ``3`` (rightDownCausal): ``d <= Skv - Sq``.
  ``4`` (band, bottom-right): ``-pre <= d - (Skv - Sq) <= next``, with ``pre + next >= 0``.
  All three require the compressed mask :func:`compressed_causal_mask` (2048 x
  2048, ``triu(ones, 1)``); any other mask is rejected.
* ``atten_mask=None``: every pair is computed, whatever ``sparse_mode``,
  ``pre_tockens`` and ``next_tockens`` say (documented behaviour, reproduced).
* TND (varlen): every mode applies per sequence with local indices; a full mask
  must be SS of shape (max Sq, max Skv) and each sequence uses its top-left
  ``[Sq_i, Skv_i]`` corner; it may not mask a whole row; mode 3 needs
  ``Sq_i <= Skv_i``. ``actual_seq_qlen`` / ``actual_seq_kvlen`` are cumulative end
  offsets (lengths [3, 5] -> [3, 8]); a tail of zeros skips the last sequences.

Outputs: ``(attention_out, softmax_max, softmax_sum, softmax_out, seed, offset,
numels)``. ``softmax_max``/``softmax_sum`` are fp32, the row value repeated 8 times:
``[B, N1, Sq, 8]``, or ``[T, N1, 8]`` for TND whose memory holds, by default
(``softmax_layout=""``, the op's "NTD"), one ``[N1, Sq_i, 8]`` block per sequence
at row offset ``start_i`` (``softmax_layout="TND"`` gives a true ``[T, N1, 8]``).
``softmax_out`` is an empty tensor (reserved). ``numels`` is ``B * N1 * Sq * Skv``
(TND: ``N1 * sum(Sq_i * Skv_i)``).

Where the docs were silent, this reference chose (and the kernel sources hinted):

* Masked logits become ``-FLT_MAX`` (the kernels' ``0xFF7FFFFF``), so
  ``softmax_max`` of a row that sees no key is ``-FLT_MAX`` and its
  ``softmax_sum`` is Skv; such a row outputs 0 and gets zero gradients (the
  kernels' "invalid line" handling, ``inner_precise=2``, automatic e.g. for mode
  3 with Sq > Skv; with ``inner_precise`` 0/1 the hardware may instead return the
  mean of V there). A TND sequence with ``Skv_i = 0`` gets 0 output, max and sum.
* Dropout bits are not Philox-compatible with the NPU. The flat mask of ``numels``
  bits is ordered ``[B, N1, Sq, Skv]`` (TND: one ``[N1, Sq_i, Skv_i]`` chunk per
  sequence) and is a pure function of ``(seed, offset, numels, keep_prob)``;
  ``seed``/``offset`` come from a module generator (:func:`manual_seed`) whose offset
  advances by 10 per call, like ``philox_engine_inputs(10)``. With ``keep_prob == 1``
  no dropout runs and ``seed = offset = 0`` (the real op leaves them unset).
* Not implemented (``ValueError``): sparse modes 5-8, ``prefix``-based masks, TND
  ``pse``, the alibi-compressed ``[.., 1024, Skv]`` pse. ``padding_mask`` is
  rejected (documented as unsupported). ``inner_precise``, ``prefix``,
  ``gen_mask_parallel`` and ``sync`` are accepted and ignored.
* ``npu_fusion_attention_grad`` returns ``dpse=None`` without pse (the C++ op
  returns an undefined tensor; older torch_npu returned an empty one).

Sources (stored copies, read in 2025):

* torch_npu.npu_fusion_attention, Ascend Extension for PyTorch API reference (zh):
  https://www.hiascend.com/document/detail/zh/Pytorch/600/apiref/apilist/ptaoplist_000850.html
  (its source: docs/context/torch_npu-npu_fusion_attention.md, https://gitcode.com/Ascend/op-plugin)
* sparseMode introduction (ops-transformer):
  https://github.com/hicann/ops-transformer/blob/master/docs/en/context/sparse_mode_introduction.md
* aclnnFlashAttentionScore and aclnnFlashAttentionVarLenScoreV4 (ops-transformer,
  attention/flash_attention_score/docs/aclnnFlashAttentionScore_en.md and
  aclnnFlashAttentionVarLenScoreV4_en.md): constraints, softmax shapes, "NTD".
* mindspore.ops.speed_fusion_attention (en, the same op):
  https://www.mindspore.cn/docs/en/r2.7.1/api_python/ops/mindspore.ops.speed_fusion_attention.html
* Ascend/op-plugin sources op_plugin/ops/opapi/FlashAttentionKernelNpuOpApi.cpp
  (numels, seed/offset, grad arity, dpse) and op_plugin/python/meta/_meta_registrations.py.
* ops-transformer kernels (attention/flash_attention_score/op_kernel/arch32/
  flash_attention_var_len_score.h, flash_attention_score_common.h): per-sequence
  softmax blocks, the ``-FLT_MAX`` fill, band bounds of modes 3 and 4 in varlen.
"""

import os

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch

from npu_backend.emulator import _core, _inputs
from npu_backend.emulator._masks import COMPRESSED_MASK_SIZE, compressed_causal_mask

LAYOUTS = _inputs.LAYOUTS
_MAX = 2147483647

__all__ = [
    "COMPRESSED_MASK_SIZE",
    "LAYOUTS",
    "compressed_causal_mask",
    "manual_seed",
    "npu_fusion_attention",
    "npu_fusion_attention_grad",
]


def manual_seed(seed: int) -> None:
    """Seed the dropout generator, like ``torch_npu.npu.manual_seed``; the offset restarts at 0.

    Args:
        seed: any int.

    Raises:
        TypeError: ``seed`` is not an int.

    Example:
        >>> q = torch.ones(1, 1, 3, 2)
        >>> manual_seed(7)
        >>> npu_fusion_attention(q, q, q, 1, "BNSD", keep_prob=0.5)[4:6]
        (7, 0)
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int; got {seed!r}.")
    _core.set_seed(seed)


def _dropout(prob, keep_prob: float, seed: int, offset: int):
    return None if keep_prob >= 1.0 else _core.dropout_keep(seed, offset, prob.numels, keep_prob)


def _dropout_mask(seed: int, offset: int, numels: int, keep_prob: float) -> torch.Tensor:
    """The flat ``[numels]`` keep mask (True = kept) both ops use; for tests."""
    return _core.dropout_keep(seed, offset, numels, keep_prob)


def _softmax_layout(softmax_layout, layout: str) -> str:
    if softmax_layout not in ("", "TND") or (softmax_layout == "TND" and layout != "TND"):
        raise ValueError(
            f"softmax_layout must be '' or, with input_layout='TND', 'TND'; got {softmax_layout!r}."
        )
    return softmax_layout


def _pack(prob, stats: list[torch.Tensor], softmax_layout: str) -> torch.Tensor:
    """Per-segment ``[b, N1, Sq]`` row statistics -> the op's fp32 ``[..., 8]`` tensor."""
    n1 = prob.n1
    if prob.layout != "TND":
        return stats[0][..., None].expand(-1, -1, -1, 8).contiguous()
    t = prob.q.shape[0]
    if softmax_layout == "TND":
        out = prob.q.new_zeros(t, n1, 8)
        for seg, st in zip(prob.segments, stats, strict=True):
            out[seg.q_rows] = st[0].T[..., None].expand(-1, -1, 8)
        return out
    flat = prob.q.new_zeros(t * n1 * 8)
    for seg, st in zip(prob.segments, stats, strict=True):
        flat[seg.q_rows.start * n1 * 8 : seg.q_rows.stop * n1 * 8] = (
            st[0][..., None].expand(-1, -1, 8).reshape(-1)
        )
    return flat.view(t, n1, 8)


def _unpack(prob, stat, seg, softmax_layout: str, name: str) -> torch.Tensor:
    """One segment's ``[b, N1, Sq]`` statistic out of the op's softmax_max/softmax_sum."""
    if stat is None:
        raise ValueError(f"{name} is required: pass the forward's {name} output.")
    n1 = prob.n1
    want = (prob.q.shape[0], n1, 8) if prob.layout == "TND" else (*prob.q.shape[:3], 8)
    if tuple(stat.shape) != want:
        raise ValueError(f"{name} must have shape {want} (the forward's output); got {tuple(stat.shape)=}.")
    stat = stat.float()
    if prob.layout != "TND":
        return stat[..., 0]
    if softmax_layout == "TND":
        return stat[seg.q_rows, :, 0].T[None]
    block = stat.reshape(-1)[seg.q_rows.start * n1 * 8 : seg.q_rows.stop * n1 * 8]
    return block.view(n1, seg.sq, 8)[None, ..., 0]


def npu_fusion_attention(
    query,
    key,
    value,
    head_num,
    input_layout,
    pse=None,
    padding_mask=None,
    atten_mask=None,
    scale=1.0,
    keep_prob=1.0,
    pre_tockens=_MAX,
    next_tockens=_MAX,
    inner_precise=0,
    prefix=None,
    actual_seq_qlen=None,
    actual_seq_kvlen=None,
    sparse_mode=0,
    gen_mask_parallel=True,
    sync=False,
    softmax_layout="",
):
    """Fused attention forward, computed in fp32 on CPU (see the module docstring).

    Args:
        query, key, value: fp16/bf16/fp32 tensors in ``input_layout``; key and
            value may have N2 heads with N2 dividing ``head_num`` (GQA).
        head_num: the query head count N1.
        input_layout: one of :data:`LAYOUTS`.
        pse: position bias added before the scale, BNSS / BN1S / 1NSS.
        padding_mask: must be None (unsupported by the op).
        atten_mask: bool/uint8, True = masked out; shapes per ``sparse_mode``.
        scale: multiplies ``pse + query @ key^T``.
        keep_prob: dropout keep probability in (0, 1].
        pre_tockens, next_tockens: band limits for sparse modes 0 and 4.
        inner_precise, prefix, gen_mask_parallel, sync: accepted, ignored.
        actual_seq_qlen, actual_seq_kvlen: TND cumulative end offsets.
        sparse_mode: 0 to 4.
        softmax_layout: TND only: "" (per-sequence NTD blocks) or "TND".

    Returns:
        ``(attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels)``.

    Raises:
        ValueError, TypeError: an argument outside the documented contract.

    Example:
        >>> q = torch.randn(2, 3, 5, 4)
        >>> out, mx, sm, _, seed, offset, numels = npu_fusion_attention(q, q, q, 3, "BNSD", scale=0.5)
        >>> out.shape, mx.shape, numels
        (torch.Size([2, 3, 5, 4]), torch.Size([2, 3, 5, 8]), 150)
    """
    layout = _inputs.layout_of(input_layout)
    softmax_layout = _softmax_layout(softmax_layout, layout)
    prob = _inputs.problem(query, key, value, head_num, layout, actual_seq_qlen, actual_seq_kvlen)
    cfg = _inputs.config(
        prob, query, pse=pse, padding_mask=padding_mask, atten_mask=atten_mask, scale=scale,
        keep_prob=keep_prob, pre=pre_tockens, nxt=next_tockens, sparse_mode=sparse_mode,
    )  # fmt: skip
    seed, offset = _core.next_seed_offset() if cfg.keep_prob < 1.0 else (0, 0)
    keep = _dropout(prob, cfg.keep_prob, seed, offset)
    outs, maxes, sums = [], [], []
    for seg in prob.segments:
        q, k, v, masked, pse4, seg_keep = _inputs.segment_inputs(prob, cfg, seg, keep)
        out, mx, sm = _core.forward(
            q, k, v, pse=pse4, scale=cfg.scale, masked=masked, keep=seg_keep, keep_prob=cfg.keep_prob
        )
        outs.append(out)
        maxes.append(mx)
        sums.append(sm)
    attention_out = _inputs.assemble(prob, outs, kv=False).to(query.dtype)
    softmax_out = torch.empty(0, dtype=query.dtype)
    return (
        attention_out,
        _pack(prob, maxes, softmax_layout),
        _pack(prob, sums, softmax_layout),
        softmax_out,
        seed,
        offset,
        prob.numels,
    )


def _out_shape(prob) -> tuple[int, ...]:
    """The shape of attention_out (the query's layout, with the value head dim)."""
    dv, n1 = prob.v.shape[-1], prob.n1
    if prob.layout == "TND":
        return (prob.q.shape[0], n1, dv)
    b, _, sq, _ = prob.q.shape
    shapes = {
        "BNSD": (b, n1, sq, dv),
        "BSND": (b, sq, n1, dv),
        "BSH": (b, sq, n1 * dv),
        "SBH": (sq, b, n1 * dv),
    }
    return shapes[prob.layout]


def _check_grad_inputs(prob, query, dy, attention_in, keep_prob, numels) -> None:
    if attention_in is None:
        raise ValueError("attention_in is required: pass the forward's attention_out.")
    want = _out_shape(prob)
    for name, x in (("dy", dy), ("attention_in", attention_in)):
        if tuple(x.shape) != want:
            raise ValueError(f"{name} must have the attention_out shape {want}; got {tuple(x.shape)=}.")
    if dy.dtype != query.dtype:
        raise TypeError(f"dy must have the query's dtype; got {dy.dtype=} and {query.dtype=}.")
    if keep_prob < 1.0 and numels != prob.numels:
        raise ValueError(f"numels must be the forward's {prob.numels} for these shapes; got {numels=}.")


def _as_segment(prob, x: torch.Tensor, seg) -> torch.Tensor:
    """A tensor laid out like attention_out, as one segment's fp32 ``[b, N1, Sq, Dv]``."""
    if prob.layout != "TND":
        return _core.to_bnsd(x.float(), prob.layout, prob.n1)
    return x[seg.q_rows].float().permute(1, 0, 2)[None]


def npu_fusion_attention_grad(
    query,
    key,
    value,
    dy,
    head_num,
    input_layout,
    *,
    pse=None,
    padding_mask=None,
    atten_mask=None,
    softmax_max=None,
    softmax_sum=None,
    softmax_in=None,
    attention_in=None,
    scale_value=1.0,
    keep_prob=1.0,
    pre_tockens=_MAX,
    next_tockens=_MAX,
    inner_precise=0,
    seed=0,
    offset=0,
    numels=0,
    prefix=None,
    actual_seq_qlen=None,
    actual_seq_kvlen=None,
    sparse_mode=0,
    gen_mask_parallel=True,
    sync=False,
    softmax_layout="",
):
    """Fused attention backward from the forward's residuals (FlashAttention-2 style).

    Takes the forward's arguments (``scale`` is spelled ``scale_value`` here), the
    output gradient ``dy``, and the residuals ``softmax_max``, ``softmax_sum``,
    ``attention_in`` (the forward's ``attention_out``) and ``seed``/``offset``/
    ``numels``, from which it regenerates the forward's dropout mask.
    ``softmax_in`` is reserved and ignored.

    Returns:
        ``(dq, dk, dv, dpse)`` in the inputs' layouts and dtype; ``dpse`` has the
        pse's shape, or is None without pse.

    Raises:
        ValueError, TypeError: an argument outside the documented contract, or a
        missing residual.

    Example:
        >>> q = torch.randn(1, 2, 3, 4)
        >>> out, mx, sm, _, seed, offset, numels = npu_fusion_attention(q, q, q, 2, "BNSD")
        >>> dq, dk, dv, dpse = npu_fusion_attention_grad(
        ...     q, q, q, torch.ones_like(out), 2, "BNSD",
        ...     softmax_max=mx, softmax_sum=sm, attention_in=out)
        >>> dq.shape, dpse is None
        (torch.Size([1, 2, 3, 4]), True)
    """
    layout = _inputs.layout_of(input_layout)
    softmax_layout = _softmax_layout(softmax_layout, layout)
    prob = _inputs.problem(query, key, value, head_num, layout, actual_seq_qlen, actual_seq_kvlen)
    cfg = _inputs.config(
        prob, query, pse=pse, padding_mask=padding_mask, atten_mask=atten_mask, scale=scale_value,
        keep_prob=keep_prob, pre=pre_tockens, nxt=next_tockens, sparse_mode=sparse_mode,
    )  # fmt: skip
    _check_grad_inputs(prob, query, dy, attention_in, cfg.keep_prob, numels)
    keep = _dropout(prob, cfg.keep_prob, int(seed), int(offset))
    grads: list[list] = [[], [], [], []]
    for seg in prob.segments:
        q, k, v, masked, pse4, seg_keep = _inputs.segment_inputs(prob, cfg, seg, keep)
        mx = _unpack(prob, softmax_max, seg, softmax_layout, "softmax_max")
        sm = _unpack(prob, softmax_sum, seg, softmax_layout, "softmax_sum")
        res = _core.backward(
            q, k, v, _as_segment(prob, dy, seg), _as_segment(prob, attention_in, seg), mx, sm,
            pse=pse4, scale=cfg.scale, masked=masked, keep=seg_keep, keep_prob=cfg.keep_prob,
        )  # fmt: skip
        for acc, g in zip(grads, res, strict=True):
            acc.append(g)
    dq = _inputs.assemble(prob, grads[0], kv=False).to(query.dtype)
    dk = _inputs.assemble(prob, grads[1], kv=True).to(query.dtype)
    dv = _inputs.assemble(prob, grads[2], kv=True).to(query.dtype)
    dpse = None if pse is None else grads[3][0].sum_to_size(pse.shape).to(pse.dtype)
    return dq, dk, dv, dpse
