"""npu_backend.reference: the CPU stand-in for torch_npu's fused attention ops.

Every case checks the forward against the direct formula and the backward against
``torch.autograd`` of that formula, with the expected masks written out here as
explicit (i, j) predicates, independent of the module's own mask code. Sizes are
odd and pairwise distinct (B=2, Sq=5, Skv=7, N1=6, N2=3, D=8, Dv=4) so that an
axis mix-up fails.
"""

import itertools

import pytest

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")

from npu_backend import reference as ref  # noqa: E402

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


# ---- outputs, layouts, heads ---------------------------------------------------------------


def test_returns_the_seven_tuple():
    q, k, v = _qkv()
    res = ref.npu_fusion_attention(q, k, v, N1, "BNSD")
    assert len(res) == 7
    out, mx, sm, softmax_out, seed, offset, numels = res
    assert out.shape == (B, N1, SQ, DV) and out.dtype == torch.float32
    assert mx.shape == sm.shape == (B, N1, SQ, 8) and mx.dtype == sm.dtype == torch.float32
    assert bool((mx == mx[..., :1]).all()) and bool((sm == sm[..., :1]).all())
    assert softmax_out.numel() == 0
    assert (seed, offset, numels) == (0, 0, B * N1 * SQ * SKV)
    assert all(type(x) is int for x in (seed, offset, numels))


def test_public_names():
    assert ref.LAYOUTS == ("BSH", "SBH", "BSND", "BNSD", "TND")
    assert ref.COMPRESSED_MASK_SIZE == 2048
    m = ref.compressed_causal_mask()
    assert m.dtype == torch.bool and torch.equal(m, torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1))
    m[0, 0] = True  # a fresh tensor each time
    assert not bool(ref.compressed_causal_mask()[0, 0])


@pytest.mark.parametrize("layout", ["BSH", "SBH", "BSND", "BNSD"])
def test_layouts_give_the_same_numbers(layout):
    q, k, v = _qkv()
    got = _check(q, k, v, layout=layout, masked=_grid(2), atten_mask=_grid(2), sparse_mode=1)
    base = ref.npu_fusion_attention(q, k, v, N1, "BNSD", scale=0.3, atten_mask=_grid(2), sparse_mode=1)
    _close(_back(got[0], layout, N1), base[0], "out vs BNSD", atol=1e-6)
    _close(got[1], base[1], "softmax_max vs BNSD", atol=1e-6)


@pytest.mark.parametrize("n2", [1, 2, 3, 6])
def test_gqa_and_mqa(n2):
    q, k, v = _qkv(n2=n2, seed=3)
    _check(q, k, v, layout="BSH")


@pytest.mark.parametrize("scale", [1.0, 0.125, 2.5])
def test_scale(scale):
    _check(*_qkv(seed=4), scale=scale)


# ---- masks ---------------------------------------------------------------------------------


@pytest.mark.parametrize("sq, skv", [(5, 7), (7, 5)])
@pytest.mark.parametrize("mode", [0, 1, 2, 3, 4])
def test_each_sparse_mode(mode, sq, skv):
    q, k, v = _qkv(sq=sq, skv=skv, seed=5)
    pre, nxt = 2, 1
    if mode == 0:
        mask = _grid(0, sq, skv, pre, nxt) | (_randn(sq, skv, seed=6) > 1.0)  # band plus extra pairs
        masked = mask
    elif mode == 1:
        mask = _randn(B, N1, sq, skv, seed=7) > 0.3
        masked = mask
    else:
        mask, masked = ref.compressed_causal_mask(), _grid(mode, sq, skv, pre, nxt)
    _check(q, k, v, masked=masked, atten_mask=mask, sparse_mode=mode, pre_tockens=pre, next_tockens=nxt)


@pytest.mark.parametrize("pre, nxt", [(3, -1), (-1, 3), (0, 0)])
@pytest.mark.parametrize("mode", [0, 4])
def test_bands_with_negative_tokens(mode, pre, nxt):
    q, k, v = _qkv(seed=8)
    grid = _grid(mode, pre=pre, nxt=nxt)
    mask = grid if mode == 0 else ref.compressed_causal_mask()
    _check(q, k, v, masked=grid, atten_mask=mask, sparse_mode=mode, pre_tockens=pre, next_tockens=nxt)


@pytest.mark.parametrize("kind", ["BNSS", "B1SS", "11SS", "SS"])
@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8])
def test_atten_mask_shapes(kind, dtype):
    shape = {"BNSS": (B, N1, SQ, SKV), "B1SS": (B, 1, SQ, SKV), "11SS": (1, 1, SQ, SKV), "SS": (SQ, SKV)}[
        kind
    ]
    mask = _randn(*shape, seed=9) > 0.2
    masked = mask if mask.dim() == 4 else mask[None, None]
    _check(*_qkv(seed=10), masked=masked, atten_mask=mask.to(dtype), sparse_mode=1)


@pytest.mark.parametrize("mode", [0, 2, 3, 4])
def test_no_atten_mask_computes_every_pair(mode):
    """Documented: with atten_mask=None, sparse_mode, pre and next tokens are ignored."""
    _check(*_qkv(seed=11), sparse_mode=mode, pre_tockens=1, next_tockens=0)


def test_rows_that_see_no_key():
    q, k, v = _qkv(sq=7, skv=5, seed=12)
    mask = ref.compressed_causal_mask()
    out, mx, sm, *_ = _check(q, k, v, masked=_grid(3, 7, 5), atten_mask=mask, sparse_mode=3)
    assert bool((out[:, :, :2] == 0).all()) and bool((out[:, :, 2:] != 0).any())
    assert bool((mx[:, :, :2] == -FLT_MAX).all())
    assert bool((sm[:, :, :2] == 5).all())


# ---- pse -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["BNSS", "1NSS", "BN1S"])
def test_pse_is_inside_the_scale(kind):
    shape = {"BNSS": (B, N1, SQ, SKV), "1NSS": (1, N1, SQ, SKV), "BN1S": (B, N1, 1, SKV)}[kind]
    pse = _randn(*shape, seed=13)
    _check(
        *_qkv(seed=14), layout="BSND", pse=pse, scale=0.7, atten_mask=_grid(2), sparse_mode=1, masked=_grid(2)
    )


# ---- dropout -------------------------------------------------------------------------------


def test_dropout_is_deterministic_and_matches_its_backward():
    q, k, v = _qkv(seed=15)
    ref.manual_seed(123)
    first = _check(q, k, v, keep_prob=0.6, layout="SBH")
    second = ref.npu_fusion_attention(
        *(_to(x, "SBH") for x in (q, k, v)), N1, "SBH", scale=0.3, keep_prob=0.6
    )
    assert (first[4], first[5]) == (123, 0)
    assert (second[4], second[5]) == (123, 10)
    assert not torch.equal(first[0], second[0])
    ref.manual_seed(123)
    again = ref.npu_fusion_attention(*(_to(x, "SBH") for x in (q, k, v)), N1, "SBH", scale=0.3, keep_prob=0.6)
    assert torch.equal(again[0], first[0]) and again[4:] == first[4:]
    kept = ref._dropout_mask(123, 0, first[6], 0.6).float().mean().item()
    assert 0.5 < kept < 0.7


def test_no_dropout_draws_no_seed():
    q, k, v = _qkv(seed=16)
    ref.manual_seed(5)
    assert ref.npu_fusion_attention(q, k, v, N1, "BNSD")[4:6] == (0, 0)
    assert ref.npu_fusion_attention(q, k, v, N1, "BNSD", keep_prob=0.9)[4:6] == (5, 0)


def test_backward_uses_the_given_seed_and_offset():
    q, k, v = _qkv(seed=17)
    ref.manual_seed(1)
    out, mx, sm, _, seed, offset, numels = ref.npu_fusion_attention(q, k, v, N1, "BNSD", keep_prob=0.5)
    kw = dict(softmax_max=mx, softmax_sum=sm, attention_in=out, keep_prob=0.5, numels=numels, seed=seed)
    dy = torch.ones_like(out)
    same = ref.npu_fusion_attention_grad(q, k, v, dy, N1, "BNSD", offset=offset, **kw)
    other = ref.npu_fusion_attention_grad(q, k, v, dy, N1, "BNSD", offset=offset + 10, **kw)
    assert not torch.equal(same[2], other[2])


# ---- TND -----------------------------------------------------------------------------------

QLENS, KVLENS = [3, 5, 1], [4, 6, 2]  # per-sequence lengths; Sq_i <= Skv_i for mode 3


def _spans(lens):
    """Per-sequence lengths -> [(start, end)] row ranges."""
    ends = list(itertools.accumulate(lens))
    return list(zip([0, *ends[:-1]], ends, strict=True))


TND = dict(
    actual_seq_qlen=list(itertools.accumulate(QLENS)), actual_seq_kvlen=list(itertools.accumulate(KVLENS))
)
SPANS = list(zip(_spans(QLENS), _spans(KVLENS), strict=True))


def _block(stat, q0, q1):
    """One sequence's [N1, Sq_i, 8] block of a TND softmax_max/sum (the op's default "NTD")."""
    return stat.reshape(-1)[q0 * N1 * 8 : q1 * N1 * 8].view(N1, q1 - q0, 8)


def _tnd_inputs(seed=20):
    tq, tk = sum(QLENS), sum(KVLENS)
    return _randn(tq, N1, D, seed=seed), _randn(tk, N2, D, seed=seed + 1), _randn(tk, N2, DV, seed=seed + 2)


def _tnd_mask(mode):
    sq, skv = max(QLENS), max(KVLENS)
    if mode == 0:
        return _grid(0, sq, skv, 2, 1)
    if mode == 1:
        mask = _randn(sq, skv, seed=21) > 0.0
        mask[:, 0] = False  # TND forbids rows that see no key
        return mask
    return None if mode is None else ref.compressed_causal_mask()


@pytest.mark.parametrize("mode", [None, 0, 1, 2, 3, 4])
def test_tnd_equals_each_sequence_alone(mode):
    q, k, v = _tnd_inputs()
    mask = _tnd_mask(mode)
    kw = dict(atten_mask=mask, sparse_mode=mode or 0, pre_tockens=2, next_tockens=1)
    out, mx, sm, _, _, _, numels = ref.npu_fusion_attention(q, k, v, N1, "TND", scale=0.3, **TND, **kw)
    assert mx.shape == (sum(QLENS), N1, 8) and numels == N1 * sum(
        a * b for a, b in zip(QLENS, KVLENS, strict=True)
    )
    dy = _randn(*out.shape, seed=22)
    grads = ref.npu_fusion_attention_grad(
        q, k, v, dy, N1, "TND", softmax_max=mx, softmax_sum=sm, attention_in=out, scale_value=0.3, **TND, **kw
    )
    for (q0, q1), (k0, k1) in SPANS:
        one_kw = dict(kw, atten_mask=mask[: q1 - q0, : k1 - k0] if mode in (0, 1) else mask)
        one = ref.npu_fusion_attention(
            q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], N1, "BSND", scale=0.3, **one_kw
        )
        _close(out[q0:q1], one[0][0], "out")
        _close(_block(mx, q0, q1), one[1][0], "softmax_max block")
        _close(_block(sm, q0, q1), one[2][0], "softmax_sum block")
        g = ref.npu_fusion_attention_grad(
            q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], dy[None, q0:q1], N1, "BSND",
            softmax_max=one[1], softmax_sum=one[2], attention_in=one[0], scale_value=0.3, **one_kw,
        )  # fmt: skip
        for name, got, want, rows in zip(
            "qkv", grads[:3], g[:3], [(q0, q1), (k0, k1), (k0, k1)], strict=True
        ):
            _close(got[rows[0] : rows[1]], want[0], f"d{name}")


def test_tnd_softmax_layout_tnd_is_token_major():
    q, k, v = _tnd_inputs(seed=23)
    ntd = ref.npu_fusion_attention(q, k, v, N1, "TND", **TND)
    tok = ref.npu_fusion_attention(q, k, v, N1, "TND", softmax_layout="TND", **TND)
    assert torch.equal(ntd[0], tok[0])
    for q0, q1 in _spans(QLENS):
        assert torch.equal(tok[1][q0:q1], _block(ntd[1], q0, q1).permute(1, 0, 2))
    dy = torch.ones_like(tok[0])
    a = ref.npu_fusion_attention_grad(
        q, k, v, dy, N1, "TND", softmax_max=ntd[1], softmax_sum=ntd[2], attention_in=ntd[0], **TND
    )
    b = ref.npu_fusion_attention_grad(
        q, k, v, dy, N1, "TND", softmax_max=tok[1], softmax_sum=tok[2], attention_in=tok[0],
        softmax_layout="TND", **TND,
    )  # fmt: skip
    for x, y in zip(a[:3], b[:3], strict=True):
        assert torch.equal(x, y)


def test_tnd_dropout_chunks_per_sequence():
    q, k, v = _tnd_inputs(seed=24)
    ref.manual_seed(9)
    out, mx, sm, _, seed, offset, numels = ref.npu_fusion_attention(q, k, v, N1, "TND", keep_prob=0.7, **TND)
    dy = _randn(*out.shape, seed=25)
    grads = ref.npu_fusion_attention_grad(
        q, k, v, dy, N1, "TND", softmax_max=mx, softmax_sum=sm, attention_in=out, keep_prob=0.7,
        seed=seed, offset=offset, numels=numels, **TND,
    )  # fmt: skip
    keep, start = ref._dropout_mask(seed, offset, numels, 0.7), 0
    for (q0, q1), (k0, k1) in SPANS:
        size = N1 * (q1 - q0) * (k1 - k0)
        chunk = keep[start : start + size].view(1, N1, q1 - q0, k1 - k0)
        start += size
        leaves = [x[rows].permute(1, 0, 2)[None].clone().requires_grad_() for x, rows in
                  ((q, slice(q0, q1)), (k, slice(k0, k1)), (v, slice(k0, k1)))]  # fmt: skip
        want = _naive(*leaves, keep=chunk, keep_prob=0.7)
        want.backward(dy[q0:q1].permute(1, 0, 2)[None])
        _close(out[q0:q1], want.detach()[0].permute(1, 0, 2), "out")
        for name, got, leaf, rows in zip(
            "qkv", grads[:3], leaves, [(q0, q1), (k0, k1), (k0, k1)], strict=True
        ):
            _close(got[rows[0] : rows[1]], leaf.grad[0].permute(1, 0, 2), f"d{name}")


def test_tnd_empty_sequences_and_zero_tail():
    q, k, v = _randn(6, N1, D, seed=26), _randn(9, N2, D, seed=27), _randn(9, N2, DV, seed=28)
    # sequence 2 has no queries, sequence 3 no keys, then a tail of skipped sequences
    qlen, kvlen = [2, 2, 6, 0, 0], [4, 9, 9, 0, 0]
    out, mx, *_ = ref.npu_fusion_attention(q, k, v, N1, "TND", actual_seq_qlen=qlen, actual_seq_kvlen=kvlen)
    assert bool((out[2:6] == 0).all()) and bool((mx.reshape(-1)[2 * N1 * 8 :] == 0).all())
    one = ref.npu_fusion_attention(q[None, :2], k[None, :4], v[None, :4], N1, "BSND")
    _close(out[:2], one[0][0], "out of sequence 1")


# ---- dtypes --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_compute_in_fp32(dtype):
    q, k, v = (x.to(dtype) for x in _qkv(seed=29))
    out, mx, sm, so, *_ = ref.npu_fusion_attention(q, k, v, N1, "BNSD", scale=0.3)
    assert out.dtype == so.dtype == dtype and mx.dtype == sm.dtype == torch.float32
    full = ref.npu_fusion_attention(q.float(), k.float(), v.float(), N1, "BNSD", scale=0.3)
    assert torch.equal(out, full[0].to(dtype)) and torch.equal(mx, full[1])
    dy = _randn(*out.shape, seed=30).to(dtype)
    common = dict(softmax_max=mx, softmax_sum=sm, scale_value=0.3)
    half = ref.npu_fusion_attention_grad(q, k, v, dy, N1, "BNSD", attention_in=out, **common)
    wide = ref.npu_fusion_attention_grad(
        q.float(), k.float(), v.float(), dy.float(), N1, "BNSD", attention_in=out.float(), **common
    )
    for h, w in zip(half[:3], wide[:3], strict=True):
        assert h.dtype == dtype and torch.equal(h, w.to(dtype))


# ---- errors --------------------------------------------------------------------------------


def _fwd(**kw):
    q, k, v = _qkv(seed=31)
    args = dict(query=q, key=k, value=v, head_num=N1, input_layout="BNSD")
    args.update(kw)
    return ref.npu_fusion_attention(**args)


def _tnd_fwd(**kw):
    q, k, v = _tnd_inputs(seed=32)
    args = dict(TND, **kw)
    return ref.npu_fusion_attention(q, k, v, N1, "TND", **args)


ALL = torch.ones(SQ, SKV, dtype=torch.bool)  # every pair masked
CM = ref.compressed_causal_mask()

BAD = {
    "layout": (lambda: _fwd(input_layout="BHSD"), "input_layout"),
    "head_num": (lambda: _fwd(head_num=3), "head_num"),
    "gqa": (lambda: _fwd(key=_randn(B, 4, SKV, D, seed=0), value=_randn(B, 4, SKV, DV, seed=0)), "N2"),
    "dv > dk": (lambda: _fwd(value=_randn(B, N2, SKV, 9, seed=0)), "Dv"),
    "dtype": (lambda: _fwd(key=_randn(B, N2, SKV, D, seed=0).half()), "dtype"),
    "keep_prob 0": (lambda: _fwd(keep_prob=0.0), "keep_prob"),
    "keep_prob > 1": (lambda: _fwd(keep_prob=1.5), "keep_prob"),
    "padding_mask": (lambda: _fwd(padding_mask=torch.zeros(SQ, SKV, dtype=torch.bool)), "padding_mask"),
    "mode 5": (lambda: _fwd(sparse_mode=5), "sparse_mode"),
    "mode 9": (lambda: _fwd(sparse_mode=9), "sparse_mode"),
    "mode 2 full mask": (lambda: _fwd(sparse_mode=2, atten_mask=_grid(2)), "compressed"),
    "mode 3 wrong content": (
        lambda: _fwd(sparse_mode=3, atten_mask=torch.zeros(2048, 2048, dtype=torch.bool)),
        "content",
    ),
    "mode 4 no overlap": (
        lambda: _fwd(sparse_mode=4, atten_mask=CM, pre_tockens=-3, next_tockens=1),
        "overlap",
    ),
    "mask shape": (lambda: _fwd(atten_mask=torch.zeros(SKV, SQ, dtype=torch.bool)), "atten_mask"),
    "mask dtype": (lambda: _fwd(atten_mask=torch.zeros(SQ, SKV)), "atten_mask"),
    "band vs mask": (lambda: _fwd(atten_mask=_grid(0, pre=3, nxt=3), pre_tockens=1, next_tockens=1), "band"),
    "negative next": (lambda: _fwd(atten_mask=ALL, pre_tockens=9, next_tockens=-7), "next_tockens"),
    "negative pre": (lambda: _fwd(atten_mask=ALL, pre_tockens=-5, next_tockens=9), "pre_tockens"),
    "pse shape": (lambda: _fwd(pse=torch.zeros(B, N1, SKV, SQ)), "pse"),
    "pse dtype": (lambda: _fwd(pse=torch.zeros(B, N1, SQ, SKV, dtype=torch.float16)), "pse"),
    "seq lens outside TND": (lambda: _fwd(actual_seq_qlen=[SQ], actual_seq_kvlen=[SKV]), "actual_seq_qlen"),
    "softmax_layout": (lambda: _fwd(softmax_layout="TND"), "softmax_layout"),
    "TND without lens": (lambda: _tnd_fwd(actual_seq_qlen=None), "actual_seq_qlen"),
    "TND lengths not cumulative": (lambda: _tnd_fwd(actual_seq_qlen=[3, 5, 1]), "actual_seq_qlen"),
    "TND total": (lambda: _tnd_fwd(actual_seq_kvlen=[4, 10, 11]), "actual_seq_kvlen"),
    "TND mask shape": (lambda: _tnd_fwd(atten_mask=torch.zeros(SQ + 1, 7, dtype=torch.bool)), "atten_mask"),
    "TND full row": (
        lambda: _tnd_fwd(atten_mask=torch.ones(5, 6, dtype=torch.bool), sparse_mode=1),
        "whole row",
    ),
    "TND mode 3 Sq > Skv": (
        lambda: _tnd_fwd(actual_seq_kvlen=[2, 8, 12], sparse_mode=3, atten_mask=CM),
        "sparse_mode=3",
    ),
    "TND pse": (lambda: _tnd_fwd(pse=torch.zeros(1, N1, 5, 6)), "pse"),
    "seed type": (lambda: ref.manual_seed(1.5), "seed"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_errors_name_the_argument(case):
    call, word = BAD[case]
    with pytest.raises((ValueError, TypeError), match=word):
        call()


def test_grad_errors_name_the_argument():
    q, k, v = _qkv(seed=33)
    out, mx, sm, _, seed, offset, numels = ref.npu_fusion_attention(q, k, v, N1, "BNSD", keep_prob=0.5)
    dy = torch.ones_like(out)
    kw = dict(softmax_max=mx, softmax_sum=sm, attention_in=out, keep_prob=0.5, seed=seed, offset=offset)
    with pytest.raises(ValueError, match="numels"):
        ref.npu_fusion_attention_grad(q, k, v, dy, N1, "BNSD", numels=numels + 1, **kw)
    with pytest.raises(ValueError, match="softmax_max"):
        ref.npu_fusion_attention_grad(q, k, v, dy, N1, "BNSD", **dict(kw, softmax_max=None), numels=numels)
    with pytest.raises(ValueError, match="softmax_sum"):
        ref.npu_fusion_attention_grad(
            q, k, v, dy, N1, "BNSD", **dict(kw, softmax_sum=mx[..., :4]), numels=numels
        )
    with pytest.raises(ValueError, match="attention_in"):
        ref.npu_fusion_attention_grad(q, k, v, dy, N1, "BNSD", **dict(kw, attention_in=None), numels=numels)
    with pytest.raises(ValueError, match="dy"):
        ref.npu_fusion_attention_grad(q, k, v, dy[:, :, :3], N1, "BNSD", **kw, numels=numels)
