"""jaxckpt's attention arguments -> ``npu_fusion_attention``'s, on torch tensors.

| jaxckpt (``flash_attention``)        | ``torch_npu.npu_fusion_attention``                           |
|--------------------------------------|--------------------------------------------------------------|
| query/key/value ``[B, T, N, H]``     | ``input_layout="BSND"``, ``head_num=N``; GQA passed as is    |
| ``scale`` (default ``1/sqrt(H)``)    | ``scale=`` always passed (its default there is 1.0)          |
| ``bias`` (added after the scale)     | ``pse = bias / scale`` (the op adds pse *before* the scale)  |
| ``mask`` (True = attend), a window,  | ``atten_mask = ~visible`` on the ``[T, S]`` grid (True =     |
| lengths/segments in BSND             | masked out), ``sparse_mode=0``: see "The mask" below         |
| ``is_causal`` alone                  | ``sparse_mode=2`` (left-up causal) + the 2048x2048 mask      |
| ``local_window_size=(left, right)``  | ``pre_tockens=left``, ``next_tockens=right`` + that mask     |
| ``query/key_value_seq_lengths``      | ``input_layout="TND"``, cumulative ``actual_seq_qlen/kvlen`` |
| ``segment_ids`` (contiguous runs)    | one TND sequence per segment                                 |
| lengths/segments + bias/mask/window, | the full ``atten_mask`` (BSND, ``sparse_mode=0``)            |
| or segments TND cannot express       |                                                              |
| ``dropout_rate``                     | ``keep_prob = 1 - dropout_rate``; seed from ``dropout_rng``  |
| ``logits_soft_cap``                  | not supported: ``NotImplementedError``                       |

The mask. Which key a query sees is decided once, by jaxckpt's predicate
``jaxckpt.attention._masks.visible``: ``npu_backend._fusion`` evaluates it on the whole
grid in JAX (``jaxckpt.attention.full_mask``) and hands over its negation, bool
``[B|1, N|1, T, S]``. This module only lays that mask out for the op (a ``1NSS`` mask,
which the op does not take, is expanded to ``BNSS``) and never rewrites it. The other
routes are layout choices over the same predicate: causal alone is the op's own
left-up causal mode (its compressed 2048x2048 mask), and the TND layout packs the
tokens that lengths and segment ids keep. Segment ids may need the full mask after all
(when TND cannot express them, which is known only on the host), so a call with
segment ids hands both over.

A query row that sees no key gets 0 and zero gradients here, whatever the kernel does
with such a row (jaxckpt's contract); its ``dy`` is zeroed before the backward call.
"""

import dataclasses
import functools

from torch_bridge.interop import torch

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

    Example:
        >>> plan = CallPlan(heads=2, t=5, s=7, scale=0.5, causal=True, lengths=True)
        >>> plan.varlen, plan.full_mask
        (True, False)
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

    @property
    def full_mask(self) -> bool:
        """Whether the call hands the op a full ``atten_mask`` (built in JAX): for a mask,
        a window, or lengths/segments in BSND; with segment ids always, as the fallback
        for ids the TND layout cannot express."""
        return self.mask or self.window is not None or self.segments or (self.lengths and not self.varlen)


@functools.lru_cache(maxsize=8)
def _compressed_causal_mask(device: str) -> "torch.Tensor":
    th = torch()
    return th.triu(th.ones(COMPRESSED, COMPRESSED, dtype=th.bool, device=device), diagonal=1)


def compressed_causal_mask(device) -> "torch.Tensor":
    """The 2048x2048 bool upper triangle sparse modes 2-4 expect (True = masked), built
    once per device (4 MiB; the ops only read it)."""
    return _compressed_causal_mask(str(device))


def _tokens(plan: CallPlan) -> tuple[int, int]:
    """``(pre_tockens, next_tockens)`` of the band the call keeps (top-left aligned)."""
    pre, nxt = plan.window if plan.window is not None else (MAX_TOKENS, MAX_TOKENS)
    if plan.causal:
        nxt = min(nxt, 0)
    return pre, nxt


def mask_arguments(plan: CallPlan, extras: dict, batch: int, device) -> tuple[dict, "torch.Tensor | None"]:
    """The op's mask keywords for a BSND call, and ``[B', N', T]`` rows that see no key.

    Args:
        extras: the call's optional tensors by name; ``atten_mask`` (present when
            ``plan.full_mask``) is jaxckpt's mask, ``[B|1, N|1, T, S]`` bool, True =
            masked out, built in JAX from ``visible``.

    Returns:
        ``(kwargs, empty)``: ``sparse_mode``, ``atten_mask`` (True = masked out),
        ``pre_tockens``, ``next_tockens``; ``empty`` is None when every row sees a key.
    """
    if not plan.full_mask:
        if plan.causal:
            return {"sparse_mode": 2, "atten_mask": compressed_causal_mask(device)}, None
        return {"sparse_mode": 0}, None
    masked = extras["atten_mask"].to(device)
    bm, nm = masked.shape[:2]
    if nm != 1 and bm == 1:  # the op takes BNSS, B1SS, 11SS or SS: no 1NSS
        masked = masked.expand(batch, -1, -1, -1)
    pre, nxt = _tokens(plan)
    kwargs = {"sparse_mode": 0, "atten_mask": masked.contiguous(), "pre_tockens": pre, "next_tockens": nxt}
    empty = masked.all(-1)
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
