"""jaxckpt's attention arguments -> ``npu_fusion_attention``'s, on torch tensors.

| jaxckpt (``flash_attention``)        | ``torch_npu.npu_fusion_attention``                           |
|--------------------------------------|--------------------------------------------------------------|
| query/key/value ``[B, T, N, H]``     | ``input_layout="BSND"``, ``head_num=N``; GQA passed as is    |
| ``scale`` (default ``1/sqrt(H)``)    | ``scale=`` always passed (its default there is 1.0)          |
| ``bias`` (added after the scale)     | ``pse = bias / scale`` (the op adds pse *before* the scale)  |
| ``mask`` (True = attend)             | ``atten_mask = ~mask`` (True = masked out), ``sparse_mode=0``|
| ``is_causal`` alone                  | ``sparse_mode=2`` (left-up causal) + the 2048x2048 mask      |
| ``local_window_size=(left, right)``  | ``pre_tockens=left``, ``next_tockens=right`` + the band mask |
| ``query/key_value_seq_lengths``      | ``input_layout="TND"``, cumulative ``actual_seq_qlen/kvlen`` |
| ``segment_ids`` (contiguous runs)    | one TND sequence per segment                                 |
| lengths/segments + bias/mask/window, | folded into the full ``atten_mask`` (BSND, ``sparse_mode=0``)|
| or segments TND cannot express       |                                                              |
| ``dropout_rate``                     | ``keep_prob = 1 - dropout_rate``; seed from ``dropout_rng``  |
| ``logits_soft_cap``                  | not supported: ``NotImplementedError``                       |

A query row that sees no key gets 0 and zero gradients here, whatever the kernel does
with such a row (jaxckpt's contract); its ``dy`` is zeroed before the backward call.
"""

import dataclasses
import functools

from torch_bridge._torch import torch

MAX_TOKENS = 2147483647
"""``pre_tockens``/``next_tockens`` meaning "unbounded" (the ops' default)."""
COMPRESSED = 2048
"""Side of the compressed causal mask sparse modes 2-4 take."""


@dataclasses.dataclass(frozen=True)
class CallPlan:
    """Everything static about one call (hashable: a jit static argument).

    Attributes:
        heads: N, the query heads (``head_num``). t, s: query and key lengths.
        scale: the logit scale. causal: top-left causal. window: ``(left, right)``.
        keep_prob: ``1 - dropout_rate``. bias, mask, lengths, segments: which optional
        inputs the call has.
    """

    heads: int
    t: int
    s: int
    scale: float
    causal: bool = False
    window: tuple[int, int] | None = None
    keep_prob: float = 1.0
    bias: bool = False
    mask: bool = False
    lengths: bool = False
    segments: bool = False

    @property
    def varlen(self) -> bool:
        """Whether the call goes through the TND (variable length) layout: lengths or
        segments without a bias, a mask or a window (those need the full ``[T, S]``
        mask, which then carries the lengths and segments too, in BSND)."""
        return (self.lengths or self.segments) and not (self.bias or self.mask or self.window)


@functools.lru_cache(maxsize=8)
def _compressed_causal_mask(device: str) -> "torch.Tensor":
    th = torch()
    return th.triu(th.ones(COMPRESSED, COMPRESSED, dtype=th.bool, device=device), diagonal=1)


def compressed_causal_mask(device) -> "torch.Tensor":
    """The 2048x2048 bool upper triangle sparse modes 2-4 expect (True = masked), built
    once per device (4 MiB; the ops only read it)."""
    return _compressed_causal_mask(str(device))


def _band(plan: CallPlan, device) -> "torch.Tensor":
    """``[T, S]`` bool: True where causal and window let query i see key j."""
    th = torch()
    i = th.arange(plan.t, device=device)[:, None]
    j = th.arange(plan.s, device=device)[None, :]
    visible = th.ones(plan.t, plan.s, dtype=th.bool, device=device)
    if plan.causal:
        visible &= j <= i
    if plan.window is not None:
        left, right = plan.window
        visible &= (j >= i - left) & (j <= i + right)
    return visible


def _tokens(plan: CallPlan) -> tuple[int, int]:
    """``(pre_tockens, next_tockens)`` of the band the call keeps (top-left aligned)."""
    pre, nxt = plan.window if plan.window is not None else (MAX_TOKENS, MAX_TOKENS)
    if plan.causal:
        nxt = min(nxt, 0)
    return pre, nxt


def _folded(plan: CallPlan, extras: dict, device) -> "torch.Tensor":
    """``[B', N', T, S]`` bool: the band, the lengths, the segments and the user mask."""
    th = torch()
    visible = _band(plan, device)[None, None]
    i, j = th.arange(plan.t, device=device), th.arange(plan.s, device=device)
    if "q_len" in extras:
        visible = visible & (i[None, None, :, None] < extras["q_len"].to(device)[:, None, None, None])
    if "kv_len" in extras:
        visible = visible & (j[None, None, None, :] < extras["kv_len"].to(device)[:, None, None, None])
    if "q_seg" in extras:
        q_seg, kv_seg = extras["q_seg"].to(device), extras["kv_seg"].to(device)
        visible = visible & (q_seg[:, None, :, None] == kv_seg[:, None, None, :])
    if "mask" in extras:
        visible = visible & extras["mask"].to(device)
    return visible


def mask_arguments(plan: CallPlan, extras: dict, batch: int, device) -> tuple[dict, "torch.Tensor | None"]:
    """The op's mask keywords for a BSND call, and ``[B', N', T]`` rows that see no key.

    Args:
        extras: the call's optional tensors by name: the user ``mask`` ``[Bm, Nm, Tm, Sm]``
            (True = attend), ``q_len``/``kv_len`` ``[B]``, ``q_seg``/``kv_seg``.

    Returns:
        ``(kwargs, empty)``: ``sparse_mode``, ``atten_mask`` (True = masked out),
        ``pre_tockens``, ``next_tockens``; ``empty`` is None when every row sees a key.
    """
    if not (plan.mask or plan.window or plan.lengths or plan.segments):
        if plan.causal:
            return {"sparse_mode": 2, "atten_mask": compressed_causal_mask(device)}, None
        return {"sparse_mode": 0}, None
    visible = _folded(plan, extras, device)
    bm, nm = visible.shape[:2]
    if nm != 1 and bm == 1:  # the op takes BNSS, B1SS, 11SS or SS: no 1NSS
        visible = visible.expand(batch, -1, -1, -1)
    visible = visible.expand(-1, -1, plan.t, plan.s)
    pre, nxt = _tokens(plan)
    kwargs = {"sparse_mode": 0, "atten_mask": ~visible.contiguous(), "pre_tockens": pre, "next_tockens": nxt}
    empty = ~visible.any(-1)
    return kwargs, (empty if bool(empty.any()) else None)


def pse_argument(plan: CallPlan, bias, batch: int) -> "torch.Tensor":
    """``pse = bias / scale`` as ``[B or 1, N, T, S]`` (BNSS or 1NSS)."""
    pse = bias / plan.scale
    b = batch if pse.shape[0] != 1 else 1
    return pse.expand(b, plan.heads, plan.t, plan.s).contiguous()


def reduce_to(grad: "torch.Tensor", shape: tuple[int, ...]) -> "torch.Tensor":
    """``grad`` summed over the axes where ``shape`` broadcast (size 1)."""
    axes = tuple(i for i, (g, s) in enumerate(zip(grad.shape, shape, strict=True)) if s == 1 and g != 1)
    return grad.sum(dim=axes, keepdim=True) if axes else grad


def split_int64(value: int) -> list[int]:
    """An int64 as ``[high, low]`` int32 words (JAX without x64 has no int64)."""
    value = int(value) & 0xFFFFFFFFFFFFFFFF
    high, low = value >> 32, value & 0xFFFFFFFF
    return [high - (1 << 32) if high >= 1 << 31 else high, low - (1 << 32) if low >= 1 << 31 else low]


def join_int64(high: int, low: int) -> int:
    """The inverse of ``split_int64``.

    Example:
        >>> join_int64(*split_int64(2**40 + 7)), join_int64(*split_int64(-3))
        (1099511627783, -3)
    """
    value = ((int(high) & 0xFFFFFFFF) << 32) | (int(low) & 0xFFFFFFFF)
    return value - (1 << 64) if value >= 1 << 63 else value
