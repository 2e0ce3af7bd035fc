"""Variable lengths and packed segments -> the TND layout's sequences.

jaxckpt pads: ``query_seq_lengths``/``key_value_seq_lengths`` say how much of each
batch row is real, and ``segment_ids`` pack several sequences into one row. The NPU
kernel takes the real tokens only, concatenated (``TND``), with cumulative sequence
ends ``actual_seq_qlen``/``actual_seq_kvlen``. ``packing`` finds those sequences on the
host, where the lengths and ids are concrete.
"""

import dataclasses

from npu_backend._translate import CallPlan
from torch_bridge.interop import torch


class NotTND(NotImplementedError):
    """Segment ids the TND layout cannot express; the call then uses the full mask."""


@dataclasses.dataclass(frozen=True)
class Packing:
    """Where the TND tokens come from in the padded ``[B * T]`` / ``[B * S]`` rows.

    Attributes:
        q_index, kv_index: flat padded positions of the packed query / key tokens.
        cu_q, cu_kv: cumulative sequence ends (``actual_seq_qlen``/``actual_seq_kvlen``).
    """

    q_index: "torch.Tensor"
    kv_index: "torch.Tensor"
    cu_q: list[int]
    cu_kv: list[int]


def _runs(ids, limit: int) -> list[tuple[int, int, int]]:
    """``(id, start, stop)`` of each run of equal ids in ``ids[:limit]``."""
    ids = ids[:limit]
    if ids.numel() == 0:
        return []
    change = (torch().nonzero(ids[1:] != ids[:-1]).flatten() + 1).tolist()
    starts, stops = [0, *change], [*change, ids.numel()]
    return [(int(ids[a]), a, b) for a, b in zip(starts, stops, strict=True)]


def _one_run_per_id(runs: list[tuple[int, int, int]], side: str, b: int) -> dict[int, tuple[int, int]]:
    found: dict[int, tuple[int, int]] = {}
    for sid, start, stop in runs:
        if sid in found:
            raise NotTND(
                f"segment_ids: segment {sid} of batch row {b} is split into several runs on the {side} "
                "side; the NPU's TND layout needs each segment contiguous"
            )
        found[sid] = (start, stop)
    return found


def _pairs(plan: CallPlan, b: int, tq: int, tk: int, q_seg, kv_seg) -> list[tuple[int, int, int, int]]:
    """``(q_start, q_stop, kv_start, kv_stop)`` of the sequences of batch row ``b``."""
    if q_seg is None:
        return [(0, tq, 0, tk)] if tq > 0 and tk > 0 else []
    kv_runs = _one_run_per_id(_runs(kv_seg[b], tk), "key", b)
    out = []
    for sid, (qa, qc) in _one_run_per_id(_runs(q_seg[b], tq), "query", b).items():
        if sid not in kv_runs:
            continue  # its queries see no key: they stay 0
        ka, kc = kv_runs[sid]
        if plan.causal and ka != qa:
            raise NotTND(
                f"segment_ids with is_causal: segment {sid} of batch row {b} starts at query {qa} but "
                f"key {ka}; the TND layout's causal mask is relative to each sequence's start"
            )
        out.append((qa, qc, ka, kc))
    return out


def packing(plan: CallPlan, batch: int, q_len=None, kv_len=None, q_seg=None, kv_seg=None) -> Packing:
    """The TND sequences of a padded batch (lengths clipped to ``[0, T]``/``[0, S]``).

    Raises:
        NotTND: segment ids that cannot become TND (a segment split into several runs,
            or causal with query and key runs that start apart).

    Example:
        >>> import torch
        >>> plan = CallPlan(heads=1, t=4, s=4, scale=1.0, lengths=True)
        >>> p = packing(plan, 2, q_len=torch.tensor([3, 2]), kv_len=torch.tensor([4, 1]))
        >>> p.q_index.tolist(), p.cu_q, p.cu_kv
        ([0, 1, 2, 4, 5], [3, 5], [4, 5])
    """
    th = torch()
    q_index, kv_index, cu_q, cu_kv = [], [], [0], [0]
    for b in range(batch):
        tq = plan.t if q_len is None else max(0, min(int(q_len[b]), plan.t))
        tk = plan.s if kv_len is None else max(0, min(int(kv_len[b]), plan.s))
        for qa, qc, ka, kc in _pairs(plan, b, tq, tk, q_seg, kv_seg):
            q_index.append(th.arange(qa, qc) + b * plan.t)
            kv_index.append(th.arange(ka, kc) + b * plan.s)
            cu_q.append(cu_q[-1] + qc - qa)
            cu_kv.append(cu_kv[-1] + kc - ka)
    empty = th.zeros(0, dtype=th.long)
    return Packing(
        th.cat(q_index) if q_index else empty, th.cat(kv_index) if kv_index else empty, cu_q[1:], cu_kv[1:]
    )
