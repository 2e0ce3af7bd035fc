"""npu_backend.emulator: outputs, layouts, heads, sparse modes, masks, pse and dropout,
against the direct formula and torch.autograd (helpers in ``npu_reference_cases``)."""

import pytest

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")

from npu_reference_cases import (  # noqa: E402
    DV,
    FLT_MAX,
    N1,
    SKV,
    SQ,
    B,
    _back,
    _check,
    _close,
    _grid,
    _qkv,
    _randn,
    _to,
)

from npu_backend import emulator as ref  # noqa: E402

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
