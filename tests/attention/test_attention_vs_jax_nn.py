"""Blockwise attention vs ``jax.nn.dot_product_attention(implementation="xla")``.

For every argument the two share, the blockwise kernel must be a drop-in. The
one documented difference is a query row that sees no key (jax.nn returns the
mean of V there, jaxckpt returns 0), so outputs and lse are compared only on rows
that see a key, and the loss weights are zero on the other rows so that the
gradients are comparable everywhere.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import Case, Inputs, build, device, evaluate, seen_rows
from tolerances import assert_close

import jaxckpt

BLOCKS = jaxckpt.BlockSizes(16, 24)
BASE = Case(b=2, t=37, s=53, n=6, k=3, h=16, block=(16, 24))


def _case(**changes) -> Case:
    return dataclasses.replace(BASE, **changes)


# (case, static overrides, array overrides); each case covers a couple of arguments.
CASES = {
    "bias_1NTS-causal_T<S": (_case(features=("bias", "causal"), variant=0), {}, {}),
    "bias_B1TS-mask_B11S-causal_T>S": (
        _case(t=53, s=37, features=("bias", "mask", "causal"), variant=3),
        {},
        {"bias": device(np.random.default_rng(1).standard_normal((2, 1, 53, 37)), jnp.float32)},
    ),
    "bias_111S-mask_BNTS": (_case(features=("bias", "mask"), variant=2), {}, {}),
    "mask_1NTS-seq_lengths": (_case(features=("mask", "lengths"), variant=1), {}, {}),
    "zero_lengths": (
        _case(b=3),
        {},
        {
            "query_seq_lengths": device([0, 30, 37], jnp.int32),
            "key_value_seq_lengths": device([41, 53, 0], jnp.int32),
        },
    ),
    "window_pair": (_case(features=("window",)), {"local_window_size": (4, 2)}, {}),
    "window_int_T>S": (_case(t=53, s=37), {"local_window_size": 3}, {}),
    "window_causal": (_case(features=("window", "causal")), {"local_window_size": (5, 0)}, {}),
    "mqa_bias_B1TS": (_case(n=5, k=1, features=("bias", "causal"), variant=1), {}, {}),
    "no_gqa_mask_B1TS": (_case(n=3, k=3, h=24, features=("mask",), variant=0), {}, {}),
    "everything_shared": (
        _case(n=6, k=2, features=("bias", "mask", "causal", "lengths", "window"), variant=1),
        {},
        {},
    ),
    "bf16_mix": (
        _case(dtype="bfloat16", features=("bias", "mask", "causal", "lengths"), variant=3),
        {},
        {},
    ),
}


def _jax_nn(query, key, value, bias=None, mask=None, **kwargs):
    return jax.nn.dot_product_attention(query, key, value, bias, mask, implementation="xla", **kwargs)


def _inputs(case: Case, static: dict, arrays: dict) -> tuple[Inputs, np.ndarray]:
    inp = build(case)
    inp = inp._replace(static={**inp.static, **static}, arrays={**inp.arrays, **arrays})
    seen = seen_rows(inp)
    return inp._replace(w=inp.w * seen[..., None].astype(inp.w.dtype)), seen


def _compare(inp: Inputs, seen: np.ndarray, dtype) -> None:
    got = evaluate(jaxckpt.flash_attention, inp, implementation="blockwise", block_sizes=BLOCKS)
    want = evaluate(_jax_nn, inp, promotion="standard")
    assert_close(got.out[seen], want.out[seen], dtype, "fwd", "out (rows seeing a key)")
    assert_close(got.lse[seen], want.lse[seen], dtype, "fwd", "lse (rows seeing a key)")
    assert not np.any(got.out[~seen]), "rows seeing no key must be 0 in jaxckpt"
    for name, grad in want.grads.items():
        assert_close(got.grads[name], grad, dtype, "grad", name)


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[] if i % 3 == 0 else [pytest.mark.slow]) for i, n in enumerate(CASES)]
)  # every third case in the fast tier, all in the full one
def test_blockwise_matches_jax_nn(name):
    case, static, arrays = CASES[name]
    inp, seen = _inputs(case, static, arrays)
    assert seen.any()
    _compare(inp, seen, case.dtype)


def test_unbatched_3d_inputs_match_jax_nn():
    case = _case(b=1, features=("causal",))
    inp, seen = _inputs(case, {"local_window_size": (6, 3)}, {})
    inp = inp._replace(q=inp.q[0], k=inp.k[0], v=inp.v[0], w=inp.w[0])
    got = evaluate(jaxckpt.flash_attention, inp, implementation="blockwise", block_sizes=BLOCKS)
    want = evaluate(_jax_nn, inp, promotion="standard")
    assert got.out.shape == (case.t, case.n, case.h) and got.lse.shape == (case.t, case.n)
    assert_close(got.out[seen[0]], want.out[seen[0]], case.dtype, "fwd", "out")
    assert_close(got.lse[seen[0]], want.lse[seen[0]], case.dtype, "fwd", "lse")
    for name, grad in want.grads.items():
        assert_close(got.grads[name], grad, case.dtype, "grad", name)
