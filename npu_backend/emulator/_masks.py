"""Which (query, key) pairs ``npu_fusion_attention`` computes, for each ``sparse_mode``.

Private helper of :mod:`npu_backend.emulator`. A mask here is a boolean tensor
that is True where the pair is masked OUT (the op's own convention for
``atten_mask``), broadcastable to ``[b, N1, Sq, Skv]`` for one segment: the whole
batch for BSH/SBH/BSND/BNSD, one sequence for TND (indices are then local to it).

The single predicate is :func:`band`: a pair (i, j) is computed when
``-pre <= j - i - shift <= next``, with ``shift = 0`` for top-left alignment and
``shift = Skv - Sq`` for bottom-right alignment.
"""

import functools
import os

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch

COMPRESSED_MASK_SIZE = 2048
MAX_TOKENS = 2147483647  # the op's default pre_tockens / next_tockens
IMPLEMENTED_SPARSE_MODES = (0, 1, 2, 3, 4)
# Modes that read a full (uncompressed) atten_mask, and modes that need the compressed one.
FULL_MASK_MODES = (0, 1)
COMPRESSED_MODES = (2, 3, 4)


def compressed_causal_mask() -> torch.Tensor:
    """The 2048 x 2048 "compressed" mask sparse modes 2, 3 and 4 require.

    True (masked) strictly above the diagonal: ``torch.triu(ones, diagonal=1)``.
    A fresh tensor on every call, so callers may modify it.

    Returns:
        A ``[2048, 2048]`` bool tensor.

    Example:
        >>> m = compressed_causal_mask()
        >>> m.shape, m.dtype, bool(m[0, 1]), bool(m[1, 0])
        (torch.Size([2048, 2048]), torch.bool, True, False)
    """
    return _canonical_compressed().clone()


@functools.cache
def _canonical_compressed() -> torch.Tensor:
    ones = torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool)
    return torch.triu(ones, diagonal=1)


def band(sq: int, skv: int, pre: int, nxt: int, shift: int) -> torch.Tensor:
    """``[sq, skv]`` bool, True where ``-pre <= j - i - shift <= nxt`` (the pair is computed)."""
    i = torch.arange(sq, dtype=torch.int64)[:, None]
    j = torch.arange(skv, dtype=torch.int64)[None, :]
    d = j - i - shift
    return (d >= -pre) & (d <= nxt)


def check_mask_dtype(atten_mask: torch.Tensor) -> None:
    if atten_mask.dtype not in (torch.bool, torch.uint8):
        raise TypeError(
            f"atten_mask must be bool or uint8 (True/1 = masked out); got {atten_mask.dtype=}. "
            "Pass mask.to(torch.bool)."
        )


def check_compressed(atten_mask: torch.Tensor, sparse_mode: int) -> None:
    """Modes 2/3/4 take only the 2048 x 2048 upper-triangular mask (or None: see caller)."""
    check_mask_dtype(atten_mask)
    want = (COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE)
    if tuple(atten_mask.shape) != want:
        raise ValueError(
            f"sparse_mode={sparse_mode} needs the compressed atten_mask of shape {want} "
            f"(npu_backend.emulator.compressed_causal_mask()); got {tuple(atten_mask.shape)=}. "
            "A full [Sq, Skv] mask goes with sparse_mode=0 or 1."
        )
    if not torch.equal(atten_mask.to(torch.bool).cpu(), _canonical_compressed()):
        raise ValueError(
            f"sparse_mode={sparse_mode}: atten_mask has the compressed shape but not its content; "
            "it must equal torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1) "
            "(npu_backend.emulator.compressed_causal_mask())."
        )


def check_band_tokens(sparse_mode: int, pre: int, nxt: int, sq: int, skv: int) -> None:
    """The documented limits on ``pre_tockens`` / ``next_tockens`` for modes 0 and 4."""
    if pre + nxt < 0:
        raise ValueError(
            f"pre_tockens and next_tockens must overlap (pre_tockens + next_tockens >= 0); "
            f"got {pre=} and {nxt=} with {sparse_mode=}."
        )
    if sparse_mode != 0:
        return
    if nxt < 0 and -nxt >= skv:
        raise ValueError(f"a negative next_tockens needs |next_tockens| < Skv; got {nxt=} and Skv={skv}.")
    if pre < 0 and -pre >= sq:
        raise ValueError(f"a negative pre_tockens needs |pre_tockens| < Sq; got {pre=} and Sq={sq}.")


def full_mask_4d(atten_mask: torch.Tensor, b: int, n1: int, sq: int, skv: int) -> torch.Tensor:
    """A BNSS / B1SS / 11SS / SS atten_mask as a 4-D bool tensor, or a ValueError."""
    check_mask_dtype(atten_mask)
    allowed = [(b, n1, sq, skv), (b, 1, sq, skv), (1, 1, sq, skv), (sq, skv)]
    if tuple(atten_mask.shape) not in allowed:
        raise ValueError(
            f"atten_mask must have one of the shapes BNSS, B1SS, 11SS or SS = {allowed} "
            f"(N = query heads); got {tuple(atten_mask.shape)=}."
        )
    mask = atten_mask.to(torch.bool).cpu()
    return mask if mask.dim() == 4 else mask[None, None]


def segment_mask(
    sparse_mode: int,
    full: torch.Tensor | None,
    pre: int,
    nxt: int,
    sq: int,
    skv: int,
) -> torch.Tensor | None:
    """The masked-out pairs of one segment, or None when every pair is computed.

    Args:
        sparse_mode: 0 to 4.
        full: the segment's part of a full atten_mask (modes 0 and 1), a bool tensor
            broadcastable to ``[b, N1, sq, skv]``; for modes 2-4 any non-None value
            stands for the (validated) compressed mask. None: no atten_mask was passed,
            and the op then computes every pair whatever the mode.
        pre, nxt: pre_tockens, next_tockens.
        sq, skv: the segment's query and key lengths.

    Returns:
        A bool tensor (True = masked out) broadcastable to ``[b, N1, sq, skv]``, or None.
    """
    if full is None:
        return None
    if sparse_mode == 1:
        return full
    if sparse_mode == 0:
        outside = ~band(sq, skv, pre, nxt, 0)
        if bool((outside & ~full).any()):
            raise ValueError(
                f"sparse_mode=0: atten_mask leaves pairs outside the band pre_tockens={pre}, "
                f"next_tockens={nxt} (top-left aligned: -pre <= j - i <= next) unmasked; the op "
                "requires the two to agree. Mask those pairs too, or widen the band."
            )
        return full
    shift = skv - sq
    if sparse_mode == 2:
        return ~band(sq, skv, MAX_TOKENS, 0, 0)[None, None]
    if sparse_mode == 3:
        return ~band(sq, skv, MAX_TOKENS, 0, shift)[None, None]
    return ~band(sq, skv, pre, nxt, shift)[None, None]
