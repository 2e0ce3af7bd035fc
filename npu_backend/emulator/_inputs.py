"""Argument checking and segmentation for :mod:`npu_backend.emulator`.

Private helper. :func:`problem` turns query/key/value in any layout into fp32
tensors plus a list of segments (the batch, or one TND sequence each);
:func:`config` checks everything else once; :func:`segment_inputs` hands the math
one segment's q/k/v/mask/pse/dropout; :func:`assemble` puts per-segment results
back in the caller's layout.
"""

import dataclasses
import os

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch

from npu_backend.emulator import _core as core
from npu_backend.emulator import _masks as masks

LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_RANK = {"BSH": 3, "SBH": 3, "BSND": 4, "BNSD": 4, "TND": 3}


@dataclasses.dataclass(frozen=True)
class Segment:
    q_rows: slice | None  # TND: this sequence's rows of query; None: the whole batch
    kv_rows: slice | None
    sq: int
    skv: int
    keep_start: int  # where its dropout bits start in the flat [numels] mask


@dataclasses.dataclass(frozen=True)
class Problem:
    layout: str
    q: torch.Tensor  # fp32: [B, N1, Sq, D], or [T, N1, D] for TND
    k: torch.Tensor
    v: torch.Tensor
    n1: int
    n2: int
    segments: tuple[Segment, ...]
    numels: int  # the dropout mask length the op reports


@dataclasses.dataclass(frozen=True)
class Config:
    sparse_mode: int
    pre: int
    nxt: int
    scale: float
    keep_prob: float
    mask: torch.Tensor | None  # bool: 4-D full mask, [maxSq, maxSkv] for TND, compressed for 2-4
    pse: torch.Tensor | None  # fp32, 4-D


def layout_of(input_layout) -> str:
    if not isinstance(input_layout, str) or input_layout.upper() not in LAYOUTS:
        raise ValueError(f"input_layout must be one of {LAYOUTS} (case-insensitive); got {input_layout!r}.")
    return input_layout.upper()


def _check_tensors(query, key, value, layout: str) -> None:
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}.")
        if x.dim() != _RANK[layout]:
            raise ValueError(
                f"input_layout={layout!r} needs {_RANK[layout]}-D {name}; got {tuple(x.shape)=}."
            )
    if query.dtype not in DTYPES:
        raise TypeError(f"query must be float16, bfloat16 or float32; got {query.dtype=}.")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(
            f"query, key and value must share a dtype; got {query.dtype}, {key.dtype}, {value.dtype}."
        )


def _heads(query, key, value, head_num, layout: str) -> tuple[int, int]:
    """(N1, N2) from the shapes, checking head_num, GQA and head dims."""
    if isinstance(head_num, bool) or not isinstance(head_num, int) or head_num <= 0:
        raise ValueError(f"head_num must be a positive int (the query head count); got {head_num!r}.")
    if layout in ("BSH", "SBH"):
        h1, h2, hv = query.shape[-1], key.shape[-1], value.shape[-1]
        d = h1 // head_num
        if h1 % head_num or d == 0 or h2 % d or hv % max(h2 // d, 1):
            raise ValueError(
                f"{layout}: query H={h1} must split into head_num={head_num} heads of size D, key H={h2} "
                f"into N2 heads of that D, and value H={hv} into N2 heads; got {head_num=}."
            )
        n1, n2, dq, dk, dv = head_num, h2 // d, d, d, hv // (h2 // d)
    else:
        n_axis = 1 if layout in ("BNSD", "TND") else 2
        n1, n2 = query.shape[n_axis], key.shape[n_axis]
        dq, dk, dv = query.shape[-1], key.shape[-1], value.shape[-1]
        if n1 != head_num:
            raise ValueError(
                f"head_num must equal the query's N axis; got {head_num=} and {tuple(query.shape)=}."
            )
        if value.shape[n_axis] != n2:
            raise ValueError(f"key and value need the same head count; got {key.shape=} and {value.shape=}.")
    if n2 == 0 or n1 % n2:
        raise ValueError(f"the key/value head count N2={n2} must divide head_num N1={n1} (GQA).")
    if dq != dk or dv > dk:
        raise ValueError(f"head dims must satisfy Dq == Dk >= Dv; got Dq={dq}, Dk={dk}, Dv={dv}.")
    return n1, n2


def _bounds(cum, name: str, total: int) -> list[tuple[int, int]]:
    """Cumulative end offsets -> (start, end) per computed sequence (a 0 tail is skipped)."""
    if cum is None or len(cum) == 0:
        raise ValueError(
            f"input_layout='TND' needs {name}: cumulative end offsets, e.g. lengths [3, 5] -> [3, 8]."
        )
    vals = [int(x) for x in cum]
    out, prev, tail = [], 0, False
    for x in vals:
        if tail and x != 0:
            raise ValueError(f"{name}: once the 0 tail starts every entry must be 0; got {vals}.")
        if x < prev:
            if x != 0:
                raise ValueError(f"{name} must be non-decreasing (cumulative offsets); got {vals}.")
            tail = True
            continue
        out.append((prev, x))
        prev = x
    if prev > total or (not tail and prev != total):
        raise ValueError(f"{name} ends at {prev} but the tensor has T={total} rows; got {vals}.")
    return out


def problem(query, key, value, head_num, layout: str, actual_seq_qlen, actual_seq_kvlen) -> Problem:
    _check_tensors(query, key, value, layout)
    n1, n2 = _heads(query, key, value, head_num, layout)
    if layout != "TND":
        if actual_seq_qlen is not None or actual_seq_kvlen is not None:
            raise ValueError("actual_seq_qlen / actual_seq_kvlen go with input_layout='TND' only.")
        q, k, v = (core.to_bnsd(x.float(), layout, h) for x, h in ((query, n1), (key, n2), (value, n2)))
        if not (q.shape[0] == k.shape[0] == v.shape[0]) or k.shape[2] != v.shape[2]:
            raise ValueError(
                f"batch and key length must agree; got {query.shape=}, {key.shape=}, {value.shape=}."
            )
        b, sq, skv = q.shape[0], q.shape[2], k.shape[2]
        seg = Segment(None, None, sq, skv, 0)
        return Problem(layout, q, k, v, n1, n2, (seg,), b * n1 * sq * skv)
    if key.shape[0] != value.shape[0]:
        raise ValueError(f"key and value need the same T; got {key.shape=} and {value.shape=}.")
    qb = _bounds(actual_seq_qlen, "actual_seq_qlen", query.shape[0])
    kb = _bounds(actual_seq_kvlen, "actual_seq_kvlen", key.shape[0])
    if len(qb) != len(kb):
        raise ValueError(
            f"actual_seq_qlen and actual_seq_kvlen must describe as many sequences; got {qb} and {kb}."
        )
    segs, start = [], 0
    for (q0, q1), (k0, k1) in zip(qb, kb, strict=True):
        segs.append(Segment(slice(q0, q1), slice(k0, k1), q1 - q0, k1 - k0, start))
        start += n1 * (q1 - q0) * (k1 - k0)
    return Problem(layout, query.float(), key.float(), value.float(), n1, n2, tuple(segs), start)


def _check_mask(prob: Problem, atten_mask, sparse_mode: int, pre: int, nxt: int):
    """The validated bool atten_mask (or None) and the band checks."""
    segs = prob.segments
    sq, skv = max(s.sq for s in segs), max(s.skv for s in segs)
    if atten_mask is None:
        return None
    if sparse_mode in masks.COMPRESSED_MODES:
        masks.check_compressed(atten_mask, sparse_mode)
    elif prob.layout == "TND":
        masks.check_mask_dtype(atten_mask)
        if tuple(atten_mask.shape) != (sq, skv):
            raise ValueError(
                f"input_layout='TND' takes an SS atten_mask of shape (max Sq, max Skv) = {(sq, skv)}; "
                f"got {tuple(atten_mask.shape)=}."
            )
    else:
        atten_mask = masks.full_mask_4d(atten_mask, prob.q.shape[0], prob.n1, sq, skv)
    if sparse_mode in (0, 4):
        masks.check_band_tokens(sparse_mode, pre, nxt, sq, skv)
    return atten_mask.to(torch.bool).cpu()


def _check_pse(prob: Problem, pse, query):
    if pse is None:
        return None
    if prob.layout == "TND":
        raise ValueError(
            "pse with input_layout='TND' (only the alibi-compressed form exists) is not implemented."
        )
    b, n1, sq, skv = prob.q.shape[0], prob.n1, prob.q.shape[2], prob.k.shape[2]
    allowed = [(b, n1, sq, skv), (b, n1, 1, skv), (1, n1, sq, skv)]
    if tuple(pse.shape) not in allowed:
        extra = " (the alibi-compressed [.., 1024, Skv] form is not implemented)" if pse.dim() == 4 else ""
        raise ValueError(
            f"pse must have a shape in BNSS, BN1S, 1NSS = {allowed}{extra}; got {tuple(pse.shape)=}."
        )
    if pse.dtype != query.dtype:
        raise TypeError(f"pse must have the query's dtype; got {pse.dtype=} and {query.dtype=}.")
    return pse.float()


def config(prob: Problem, query, *, pse, padding_mask, atten_mask, scale, keep_prob, pre, nxt, sparse_mode):
    """Checks every argument but the tensors' shapes (done by :func:`problem`) once."""
    if padding_mask is not None:
        raise ValueError(
            "padding_mask is not supported by npu_fusion_attention (the docs reserve it); pass None."
        )
    if not 0.0 < float(keep_prob) <= 1.0:
        raise ValueError(f"keep_prob must be in (0, 1]; got {keep_prob=}.")
    if isinstance(sparse_mode, bool) or sparse_mode not in masks.IMPLEMENTED_SPARSE_MODES:
        known = range(0, 9) if prob.layout == "TND" else range(0, 7)
        why = "is not implemented by this reference" if sparse_mode in known else "is not a valid mode"
        raise ValueError(f"sparse_mode={sparse_mode!r} {why}; use one of {masks.IMPLEMENTED_SPARSE_MODES}.")
    if prob.layout == "TND" and sparse_mode == 3 and atten_mask is not None:
        for s in prob.segments:
            if s.sq > s.skv:
                raise ValueError(
                    f"TND with sparse_mode=3 needs Sq <= Skv per sequence; got Sq={s.sq}, Skv={s.skv}."
                )
    pre, nxt = int(pre), int(nxt)
    return Config(
        sparse_mode=int(sparse_mode),
        pre=pre,
        nxt=nxt,
        scale=float(scale),
        keep_prob=float(keep_prob),
        mask=_check_mask(prob, atten_mask, sparse_mode, pre, nxt),
        pse=_check_pse(prob, pse, query),
    )


def segment_inputs(prob: Problem, cfg: Config, seg: Segment, keep: torch.Tensor | None):
    """(q, k, v, masked, pse, keep) of one segment, in BNSD fp32."""
    if prob.layout != "TND":
        q, k, v, full = prob.q, prob.k, prob.v, cfg.mask
    else:
        q, k, v = (
            x.permute(1, 0, 2)[None] for x in (prob.q[seg.q_rows], prob.k[seg.kv_rows], prob.v[seg.kv_rows])
        )
        full = cfg.mask
        if full is not None and cfg.sparse_mode in masks.FULL_MASK_MODES:
            full = full[: seg.sq, : seg.skv][None, None]  # top-left corner of the SS mask
    masked = masks.segment_mask(cfg.sparse_mode, full, cfg.pre, cfg.nxt, seg.sq, seg.skv)
    tnd_full = prob.layout == "TND" and cfg.sparse_mode in masks.FULL_MASK_MODES and seg.skv > 0
    if tnd_full and masked is not None and bool(masked.all(dim=-1).any()):
        raise ValueError(
            "input_layout='TND': atten_mask (with the band) may not mask a whole row of a sequence."
        )
    seg_keep = None
    if keep is not None:
        size = q.shape[0] * prob.n1 * seg.sq * seg.skv
        seg_keep = keep[seg.keep_start : seg.keep_start + size].view(q.shape[0], prob.n1, seg.sq, seg.skv)
    return q, k, v, masked, cfg.pse, seg_keep


def assemble(prob: Problem, parts: list[torch.Tensor], kv: bool) -> torch.Tensor:
    """Per-segment ``[b, N, S, D]`` results back to the input layout (TND: rows of no sequence are 0)."""
    if prob.layout != "TND":
        return core.from_bnsd(parts[0], prob.layout)
    like = prob.k if kv else prob.q
    out = like.new_zeros(like.shape[0], parts[0].shape[1], parts[0].shape[-1])
    for seg, part in zip(prob.segments, parts, strict=True):
        out[seg.kv_rows if kv else seg.q_rows] = part[0].permute(1, 0, 2)
    return out
