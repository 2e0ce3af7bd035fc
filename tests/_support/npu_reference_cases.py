"""Shared helpers of the ``npu_backend.emulator`` tests: inputs, layouts, the direct
formula and its autograd, and the expected masks as explicit (i, j) predicates.

Every case checks the forward against the direct formula and the backward against
``torch.autograd`` of that formula, with the expected masks written out here as
explicit (i, j) predicates, independent of the module's own mask code. Sizes are
odd and pairwise distinct (B=2, Sq=5, Skv=7, N1=6, N2=3, D=8, Dv=4) so that an
axis mix-up fails.
"""

import torch

from npu_backend import emulator as ref

B, SQ, SKV, N1, N2, D, DV = 2, 5, 7, 6, 3, 8, 4
FLT_MAX = torch.finfo(torch.float32).max
ATOL = 1e-5


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _qkv(b=B, sq=SQ, skv=SKV, n1=N1, n2=N2, d=D, dv=DV, seed=0):
    """query, key, value in BNSD, fp32."""
    return (
        _randn(b, n1, sq, d, seed=seed),
        _randn(b, n2, skv, d, seed=seed + 1),
        _randn(b, n2, skv, dv, seed=seed + 2),
    )


def _to(x, layout):
    """BNSD -> layout."""
    if layout == "BNSD":
        return x.contiguous()
    if layout == "BSND":
        return x.permute(0, 2, 1, 3).contiguous()
    b, n, s, d = x.shape
    bsh = x.permute(0, 2, 1, 3).reshape(b, s, n * d)
    return bsh.contiguous() if layout == "BSH" else bsh.permute(1, 0, 2).contiguous()


def _back(x, layout, n):
    """layout -> BNSD."""
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.permute(0, 2, 1, 3)
    if layout == "SBH":
        x = x.permute(1, 0, 2)
    b, s, h = x.shape
    return x.reshape(b, s, n, h // n).permute(0, 2, 1, 3)


def _visible(mode, i, j, sq, skv, pre, nxt):
    """Which pairs each sparse_mode computes, as documented (True = computed)."""
    if mode == 0:
        return -pre <= j - i <= nxt  # band aligned top-left
    if mode == 2:
        return j <= i  # leftUpCausal
    if mode == 3:
        return j <= i + skv - sq  # rightDownCausal
    if mode == 4:
        return -pre <= j - i - (skv - sq) <= nxt  # band aligned bottom-right
    raise AssertionError(mode)


def _grid(mode, sq=SQ, skv=SKV, pre=0, nxt=0):
    """[sq, skv] bool, True = masked out."""
    rows = [[not _visible(mode, i, j, sq, skv, pre, nxt) for j in range(skv)] for i in range(sq)]
    return torch.tensor(rows, dtype=torch.bool).reshape(sq, skv)


def _naive(q, k, v, *, masked=None, pse=None, scale=1.0, keep=None, keep_prob=1.0):
    """The documented formula on BNSD tensors, differentiable by torch.autograd."""
    g = q.shape[1] // k.shape[1]
    s = q @ k.repeat_interleave(g, 1).transpose(-1, -2)
    s = scale * (s if pse is None else s + pse)
    if masked is not None:
        masked = masked.expand(s.shape)
        s = s.masked_fill(masked, -1e30)
    p = torch.softmax(s, dim=-1)
    if masked is not None:
        p = p.masked_fill(masked, 0.0)  # a row that sees no key outputs 0
    if keep is not None:
        p = p * keep / keep_prob
    return p @ v.repeat_interleave(g, 1)


def _stats(q, k, *, masked=None, pse=None, scale=1.0):
    """Row max and sum of exp(logits - max), masked logits at -FLT_MAX (the kernels' fill)."""
    s = q @ k.repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2)
    s = scale * (s if pse is None else s + pse)
    if masked is not None:
        s = s.masked_fill(masked.expand(s.shape), -FLT_MAX)
    mx = s.amax(-1)
    return mx, torch.exp(s - mx[..., None]).sum(-1)


def _close(actual, expected, name, atol=ATOL):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=atol, msg=lambda m: f"{name}: {m}")


def _check(q, k, v, *, layout="BNSD", masked=None, pse=None, scale=0.3, keep_prob=1.0, **kw):
    """Runs both ops in ``layout`` and compares with the formula and its autograd."""
    n1, n2 = q.shape[1], k.shape[1]
    args = (_to(q, layout), _to(k, layout), _to(v, layout))
    out, mx, sm, softmax_out, seed, offset, numels = ref.npu_fusion_attention(
        *args, n1, layout, pse=pse, scale=scale, keep_prob=keep_prob, **kw
    )
    keep = None
    if keep_prob < 1.0:
        keep = ref._dropout_mask(seed, offset, numels, keep_prob).view(q.shape[0], n1, q.shape[2], k.shape[2])
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    p_leaf = None if pse is None else pse.clone().requires_grad_()
    want = _naive(*leaves, masked=masked, pse=p_leaf, scale=scale, keep=keep, keep_prob=keep_prob)
    dy = _randn(*want.shape, seed=99)
    want.backward(dy)
    _close(_back(out, layout, n1), want.detach(), "out")
    want_mx, want_sm = _stats(q, k, masked=masked, pse=pse, scale=scale)
    _close(mx, want_mx[..., None].expand(-1, -1, -1, 8), "softmax_max")
    _close(sm, want_sm[..., None].expand(-1, -1, -1, 8), "softmax_sum")
    dq, dk, dv, dpse = ref.npu_fusion_attention_grad(
        *args, _to(dy, layout), n1, layout, pse=pse, softmax_max=mx, softmax_sum=sm, attention_in=out,
        scale_value=scale, keep_prob=keep_prob, seed=seed, offset=offset, numels=numels, **kw,
    )  # fmt: skip
    for name, got, leaf, n in (
        ("dq", dq, leaves[0], n1),
        ("dk", dk, leaves[1], n2),
        ("dv", dv, leaves[2], n2),
    ):
        _close(_back(got, layout, n), leaf.grad, name)
    if pse is None:
        assert dpse is None
    else:
        _close(dpse, p_leaf.grad, "dpse")
    return out, mx, sm, softmax_out, seed, offset, numels
