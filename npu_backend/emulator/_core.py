"""Layouts, dropout bits and the fp32 attention math behind :mod:`npu_backend.emulator`.

Private helper. The math works on one segment in BNSD and fp32: query
``[b, N1, Sq, D]``, key ``[b, N2, Skv, D]``, value ``[b, N2, Skv, Dv]``, where
query head ``h`` reads key/value head ``h // (N1 // N2)`` (GQA).
"""

import os

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch

# The kernels' select value for masked logits: 0xFF7FFFFF, i.e. -FLT_MAX (finite).
MASK_FILL = -torch.finfo(torch.float32).max
# torch's default generator seed (c10::default_rng_seed_val) until manual_seed is called.
DEFAULT_SEED = 67280421310721
# torch_npu asks its generator for philox_engine_inputs(10) per dropout call.
PHILOX_INCREMENT = 10
_U64 = (1 << 64) - 1
_RNG = {"seed": DEFAULT_SEED, "offset": 0}


def set_seed(seed: int) -> None:
    _RNG["seed"] = seed
    _RNG["offset"] = 0


def next_seed_offset() -> tuple[int, int]:
    """The (seed, offset) for one dropout call; the offset then advances."""
    seed, offset = _RNG["seed"], _RNG["offset"]
    _RNG["offset"] = offset + PHILOX_INCREMENT
    return seed, offset


def dropout_keep(seed: int, offset: int, numels: int, keep_prob: float) -> torch.Tensor:
    """``[numels]`` bool, True = kept; a pure function of its arguments."""
    mixed = ((seed & _U64) * 0x9E3779B97F4A7C15 + (offset & _U64) * 0xC2B2AE3D27D4EB4F + 1) & _U64
    gen = torch.Generator(device="cpu")
    gen.manual_seed(mixed)
    return torch.rand(numels, generator=gen, dtype=torch.float32) < keep_prob


# ---- layouts ------------------------------------------------------------------------------


def to_bnsd(x: torch.Tensor, layout: str, heads: int) -> torch.Tensor:
    """``x`` in ``layout`` (not TND) as ``[B, N, S, D]``; BSH/SBH split H into ``heads``."""
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.permute(0, 2, 1, 3)
    if layout == "SBH":
        x = x.permute(1, 0, 2)
    b, s, h = x.shape
    return x.reshape(b, s, heads, h // heads).permute(0, 2, 1, 3)


def from_bnsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    """The inverse of :func:`to_bnsd`: ``[B, N, S, D]`` back to ``layout`` (contiguous)."""
    if layout == "BNSD":
        return x.contiguous()
    if layout == "BSND":
        return x.permute(0, 2, 1, 3).contiguous()
    b, n, s, d = x.shape
    bsh = x.permute(0, 2, 1, 3).reshape(b, s, n * d)
    return (bsh if layout == "BSH" else bsh.permute(1, 0, 2)).contiguous()


# ---- math ---------------------------------------------------------------------------------


def _expand_kv(x: torch.Tensor, n1: int) -> torch.Tensor:
    return x.repeat_interleave(n1 // x.shape[1], dim=1)


def _group_sum(x: torch.Tensor, n2: int) -> torch.Tensor:
    b, n1, s, d = x.shape
    return x.reshape(b, n2, n1 // n2, s, d).sum(dim=2)


def _logits(q, k, pse, scale: float, masked) -> torch.Tensor:
    """``Mask(scale * (pse + q @ k^T), masked)``; masked logits become :data:`MASK_FILL`."""
    s = q @ _expand_kv(k, q.shape[1]).transpose(-1, -2)
    if pse is not None:
        s = s + pse
    s = s * scale
    return s if masked is None else s.masked_fill(masked, MASK_FILL)


def _probs(s, mx, sm, masked) -> torch.Tensor:
    p = torch.exp(s - mx[..., None]) / sm[..., None]
    return p if masked is None else p.masked_fill(masked, 0.0)


def _dropped(p, keep, keep_prob: float) -> torch.Tensor:
    return p if keep is None else p * keep / keep_prob


def forward(q, k, v, *, pse, scale, masked, keep, keep_prob):
    """One segment's ``(out [b, N1, Sq, Dv], max [b, N1, Sq], sum [b, N1, Sq])`` in fp32.

    ``max`` is the row max of the masked logits and ``sum`` the row sum of
    ``exp(logits - max)`` over all Skv columns, masked ones included (they add
    ``exp(MASK_FILL - max)``: 0 in a row that sees a key, 1 each in a row that sees
    none). Rows that see no key output 0. With ``Skv == 0`` everything is 0 (what the
    varlen kernel writes for an empty key sequence).
    """
    b, n1, sq, _ = q.shape
    if k.shape[2] == 0:
        zeros = q.new_zeros(b, n1, sq)
        return q.new_zeros(b, n1, sq, v.shape[-1]), zeros, zeros.clone()
    s = _logits(q, k, pse, scale, masked)
    mx = s.amax(dim=-1)
    sm = torch.exp(s - mx[..., None]).sum(dim=-1)
    p = _probs(s, mx, sm, masked)
    out = _dropped(p, keep, keep_prob) @ _expand_kv(v, n1)
    return out, mx, sm


def backward(q, k, v, dy, out, mx, sm, *, pse, scale, masked, keep, keep_prob):
    """FlashAttention-2 backward of one segment from its residuals, in fp32.

    Recomputes ``P = exp(logits - max) / sum`` (0 where masked) instead of reading
    a saved graph, and uses ``rowsum(dy * out)`` for the softmax term.

    Returns:
        ``(dq, dk, dv, dlogits)``; ``dlogits = scale * dS`` is the gradient of a
        BNSS pse before any broadcast is summed out.
    """
    n1, n2 = q.shape[1], k.shape[1]
    if k.shape[2] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None
    p = _probs(_logits(q, k, pse, scale, masked), mx, sm, masked)
    pd = _dropped(p, keep, keep_prob)
    dv = _group_sum(pd.transpose(-1, -2) @ dy, n2)
    dp = _dropped(dy @ _expand_kv(v, n1).transpose(-1, -2), keep, keep_prob)
    ds = p * (dp - (dy * out).sum(dim=-1, keepdim=True))
    dq = scale * (ds @ _expand_kv(k, n1))
    dk = scale * _group_sum(ds.transpose(-1, -2) @ q, n2)
    return dq, dk, dv, scale * ds
