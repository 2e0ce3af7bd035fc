"""Property test: blockwise (and pallas) == reference for random small shapes, features and blocks.

Hypothesis draws T, S in 1..70, H in {8, 16, 24}, K in {1, 2, 3}, N = K * G with G
in {1, 2}, any subset of the features and block sizes 1..40, and checks the
output, the lse and the gradients wrt q, k, v and bias. Each example compiles two or
three programs (the reference, blockwise and, on some, Pallas), so ``make test`` draws
half the examples of the hypothesis profile in conftest; the same test at the profile's
full count is marked ``grid`` (``pytest --grid``). The Pallas kernel, interpreted off a GPU
(about 3 s an example), runs on a fifth of each run's examples.

One test draws the cases for both kernels: an example that checks Pallas too compares it
with the same reference result as blockwise, so its reference program is compiled once,
not once per kernel.
"""

import dataclasses
import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import FEATURES, Case, build, evaluate, seen_rows
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tolerances import assert_close

import jaxckpt


@st.composite
def cases(draw) -> Case:
    k = draw(st.sampled_from((1, 2, 3)))
    return Case(
        b=draw(st.integers(1, 2)),
        t=draw(st.integers(1, 70)),
        s=draw(st.integers(1, 70)),
        n=k * draw(st.sampled_from((1, 2))),
        k=k,
        h=draw(st.sampled_from((8, 16, 24))),
        dtype=draw(st.sampled_from(("float32", "float32", "bfloat16"))),
        features=tuple(sorted(draw(st.sets(st.sampled_from(FEATURES))), key=FEATURES.index)),
        block=draw(st.tuples(st.integers(1, 40), st.integers(1, 40)) | st.none()),
        variant=draw(st.integers(0, 3)),
        seed=draw(st.integers(0, 2**16)),
    )


# A bf16 rounding tail found by this test; it set the bf16 grad tolerance (tolerances.py).
BF16_TAIL = Case(b=1, t=51, s=39, n=6, k=3, h=8, dtype="bfloat16", features=FEATURES, block=None)


def _check(impl: str, case: Case, inp, want) -> None:
    got = evaluate(jaxckpt.flash_attention, inp, implementation=impl, block_sizes=case.block_sizes)
    assert_close(got.out, want.out, case.dtype, "fwd", f"{impl} out {case.id}")
    assert_close(got.lse, want.lse, case.dtype, "fwd", f"{impl} lse {case.id}")
    for name, grad in want.grads.items():
        assert_close(got.grads[name], grad, case.dtype, "grad", f"{impl} {name} {case.id}")
    empty = ~seen_rows(inp)
    assert not np.any(got.out[empty]) and not np.any(got.grads["dq"][empty])
    assert got.out.dtype == jnp.dtype(case.dtype)


def _check_case(case: Case, examples_run, max_examples: int) -> None:
    """Blockwise on every example, Pallas on the first ones (the explicit example, then a
    fifth of ``max_examples``), both against one reference run. ``examples_run`` counts the
    test's examples."""
    inp = build(case)
    want = evaluate(jaxckpt.attention_reference, inp)
    _check("blockwise", case, inp, want)
    if next(examples_run) < 1 + max(1, max_examples // 5):
        _check("pallas", case, inp, want)


PROFILE_EXAMPLES = settings().max_examples
MAKE_TEST_EXAMPLES = max(1, PROFILE_EXAMPLES // 2)
_MAKE_TEST_RUN, _FULL_RUN = itertools.count(), itertools.count()


@pytest.mark.slow
@settings(max_examples=MAKE_TEST_EXAMPLES)
@given(case=cases())
@example(case=dataclasses.replace(BF16_TAIL, variant=1, seed=266))
def test_blockwise_and_pallas_match_reference(case):
    """Half the profile's examples: each compiles two or three programs."""
    _check_case(case, _MAKE_TEST_RUN, MAKE_TEST_EXAMPLES)


@pytest.mark.slow
@pytest.mark.grid
@given(case=cases())
@example(case=dataclasses.replace(BF16_TAIL, variant=1, seed=266))
def test_blockwise_and_pallas_match_reference_at_the_profiles_count(case):
    """The profile's full count of examples (``pytest --grid``)."""
    _check_case(case, _FULL_RUN, PROFILE_EXAMPLES)
