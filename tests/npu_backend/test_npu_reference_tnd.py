"""npu_backend.emulator: the TND (variable length) layout, half precision, and the
errors that name the argument (helpers in ``npu_reference_cases``)."""

import itertools

import pytest

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")

from npu_reference_cases import (  # noqa: E402
    DV,
    N1,
    N2,
    SKV,
    SQ,
    B,
    D,
    _close,
    _grid,
    _naive,
    _qkv,
    _randn,
)

from npu_backend import emulator as ref  # noqa: E402

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
