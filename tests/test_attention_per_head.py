"""The per-head split of the blockwise kernel gives the same numbers as the unsplit kernel.

Large tiles run one (batch, kv head) at a time (``jaxckpt.attention._per_head``).
The contract suite's sizes are too small to trigger the split, so these cases force
it by setting the cache budget to zero, and compare with the reference.
"""

import pytest
from attention_cases import FEATURES, Case, build, evaluate
from test_attention_contract import check_against_reference

import jaxckpt
from jaxckpt.attention import _per_head

CASES = [
    Case(b=2, t=129, s=300, n=6, k=3, h=16, features=("bias", "mask"), variant=v, seed=700 + v)
    for v in range(4)  # every broadcast shape of bias and mask
] + [
    Case(b=2, t=129, s=129, n=6, k=3, h=16, features=f, variant=i, seed=710 + i)
    for i, f in enumerate(
        [("causal", "lengths"), ("segments", "window"), ("dropout", "softcap"), tuple(FEATURES)]
    )
]


@pytest.fixture
def always_split(monkeypatch):
    monkeypatch.setattr(_per_head, "TILE_CACHE_BYTES", 0)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_split_matches_reference(always_split, case):
    assert _per_head.should_split(_tiling(case))
    check_against_reference("blockwise", case)


def test_split_equals_unsplit_bitwise_on_dropout(monkeypatch):
    """The dropout hash sees global (batch, head) indices inside a slice."""
    case = Case(b=2, t=65, s=65, n=4, k=2, h=16, features=("dropout",), seed=720)
    inp = build(case)
    monkeypatch.setattr(_per_head, "TILE_CACHE_BYTES", 2**62)
    whole = evaluate(jaxckpt.flash_attention, inp, block_sizes=case.block_sizes)
    monkeypatch.setattr(_per_head, "TILE_CACHE_BYTES", 0)
    split = evaluate(jaxckpt.flash_attention, inp, block_sizes=case.block_sizes)
    assert (split.out == whole.out).all()


def _tiling(case: Case):
    from jaxckpt.attention._tiles import Tiling

    inp = build(case)
    p = jaxckpt.attention.normalize(inp.q, inp.k, inp.v, **inp.arrays, **inp.static)
    return Tiling.create(p.static, case.block_sizes, p.query.shape, p.key.shape, p.query.dtype)
