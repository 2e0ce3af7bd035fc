"""The one contract suite: every available attention implementation vs the reference.

Each case compares the output, the log-sum-exp (``return_residual=True``) and the
gradients wrt q, k, v and bias of ``sum(out * w)`` (``w`` random) with
``jaxckpt.attention_reference``, and checks that rows seeing no key give exactly 0.

The grid is a covering design, not a cartesian product (that would take hours):

- every feature alone, in float32 at two shapes;
- every pair of features, met in one of 11 sets of three features (``FEATURE_TRIPLES``, a
  pairwise covering of the 8 features), each kernel given the triples cut down to the
  features it supports, so that every kernel meets every pair of its features;
- all 16 (T, S) pairs over {1, 7, 129, 300} with one feature set, cycling through
  every H in {16, 40, 64}, (N, K) in {(3, 1), (6, 3), (6, 1), (3, 3)}, B and blocks, each
  pair on one compiled kernel, in turns (``(i_T + i_S) mod kernels``: every kernel still
  meets every T, every S, H, (N, K), B and block);
- every feature once in bfloat16 or float16, and all features at once in each dtype.

The full cross products (every pair of features alone on every kernel, every (T, S) pair on
every compiled kernel) are marked ``grid``: ``pytest --grid`` (or ``JAXCKPT_FULL_GRID=1``)
runs them as well.

"reference" itself is a registered implementation; checked against itself it only
tests dispatch, so it runs on the single-feature grid and the edge cases only.

Small odd block sizes (16x48, 32x64, 64x16, 48x16) are used in most cases, so
multi-block, padding and tile-skipping paths run; some cases use the defaults.
"""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import (
    FEATURES,
    Case,
    build,
    device,
    evaluate,
    features_of,
    normal,
    random_mask,
    seen_rows,
)
from tolerances import assert_close

import jaxckpt
from jaxckpt.attention import available_implementations, implementations

IMPLS = available_implementations()
# "reference" against itself only checks dispatch, so it runs on the small grids only; so do
# npu_backend's CPU stand-ins (a host-callback model of the NPU op, and the FFI CPU kernel),
# whose own suites (tests/npu_backend/) cover every feature and pair at small sizes.
SMALL_GRID_ONLY = {"reference", "npu_reference", "npu_ffi"}
KERNELS = [impl for impl in IMPLS if impl not in SMALL_GRID_ONLY]
# Off a GPU "pallas" runs its kernels in the Pallas interpreter (about 3 s a case): it takes
# every grid but the (T, S) one, where six cases keep every length, head layout and block.
INTERPRETED = [impl for impl in KERNELS if impl == "pallas" and jaxckpt.attention.platform() != "gpu"]
INTERPRETED_SHAPES = (0, 3, 5, 10, 12, 15)  # (1,1) (1,300) (7,7) (129,129) (300,1) (300,300)
LENGTHS = (1, 7, 129, 300)
HEADS = ((3, 1), (6, 3), (6, 1), (3, 3))  # (N, K)
BLOCKS = ((16, 48), (32, 64), None, (64, 16))
ALL = tuple(FEATURES)

SHAPE_A = dict(b=2, t=129, s=300, n=6, k=3, h=40, block=(32, 64))
SHAPE_B = dict(b=1, t=300, s=129, n=3, k=1, h=16, block=(48, 16))


def _feature_cases() -> list[tuple[Case, bool]]:
    singles = [()] + [(f,) for f in FEATURES]
    return [(Case(**SHAPE_A, features=f, variant=i, seed=i), False) for i, f in enumerate(singles)]


def _pair_cases() -> list[tuple[Case, bool]]:
    """Every pair of features alone (the full grid: ``--grid``)."""
    pairs = itertools.combinations(FEATURES, 2)
    shapes = itertools.cycle((SHAPE_A, SHAPE_B))
    return [
        (Case(**shape, features=f, variant=i, seed=100 + i), True)
        for i, (f, shape) in enumerate(zip(pairs, shapes, strict=False))
    ]


FEATURE_TRIPLES = (
    ("bias", "mask", "segments"),
    ("bias", "causal", "dropout"),
    ("bias", "lengths", "window"),
    ("bias", "lengths", "softcap"),
    ("mask", "causal", "lengths"),
    ("mask", "window", "segments"),
    ("mask", "softcap", "dropout"),
    ("causal", "window", "softcap"),
    ("causal", "segments", "dropout"),
    ("lengths", "window", "dropout"),
    ("lengths", "segments", "softcap"),
)
"""A pairwise covering of the 8 features by 11 triples (the fewest there can be): every pair
of features is in one of them. Bias and mask are each in four, given the variants 0 to 3
(``TRIPLE_VARIANTS``): every broadcast shape of both."""
TRIPLE_VARIANTS = (0, 1, 2, 3, 1, 2, 3, 0, 1, 2, 3)


def runnable_features(impl: str) -> set[str]:
    """The features ``impl`` is checked on here (as ``_skip_unsupported`` decides): those it
    supports, less dropout where it draws its own mask (tested in its own suite)."""
    implementation = implementations()[impl]
    return set(implementation.supports) - (set() if implementation.shares_dropout_mask else {"dropout"})


def runs(impl: str, case: Case) -> bool:
    """Whether ``check_against_reference(impl, case)`` checks rather than skips."""
    return set(case.features) <= runnable_features(impl) and not (impl == "cudnn" and case.dtype == "float32")


def _triple_cases(impl: str) -> list[tuple[Case, bool]]:
    """``FEATURE_TRIPLES``, each cut down to the features ``impl`` supports (a pair it
    supports stays together), at the two shapes in turn; ``make test`` only, as the pairs
    were (the fast tier has every feature alone)."""
    runnable, cases = runnable_features(impl), []
    for i, (triple, variant) in enumerate(zip(FEATURE_TRIPLES, TRIPLE_VARIANTS, strict=True)):
        features = tuple(f for f in triple if f in runnable)
        if features:
            shape = (SHAPE_A, SHAPE_B)[i % 2]
            cases.append((Case(**shape, features=features, variant=variant, seed=600 + i), True))
    return cases


def _shape_cases() -> list[tuple[Case, bool]]:
    cases = []
    for i, (t, s) in enumerate(itertools.product(LENGTHS, LENGTHS)):
        n, k = HEADS[i % 4]
        case = Case(
            b=(2, 1, 3)[(i // 3) % 3],
            t=t,
            s=s,
            n=n,
            k=k,
            h=(16, 40, 64)[i % 3],
            features=("bias", "causal", "lengths"),
            block=BLOCKS[i % 4],
            variant=i,
            seed=200 + i,
        )
        cases.append((case, min(t, s) >= 129))
    return cases


def _dtype_cases() -> list[tuple[Case, bool]]:
    # Every feature once in a low precision, and all of them together in each dtype.
    # T == S for bf16, so segment ids take the single-array form there (even variant).
    bf16 = dict(b=2, t=129, s=129, n=3, k=1, h=64, dtype="bfloat16", block=(16, 48))
    f16 = dict(b=1, t=300, s=129, n=6, k=1, h=16, dtype="float16", block=(64, 32))
    bf16_sets = [("bias", "causal"), ("segments",), ("dropout",), ALL]
    f16_sets = [("mask", "lengths"), ("window",), ("softcap",), ALL]
    cases = []
    for i, f in enumerate(bf16_sets):
        cases.append((Case(**bf16, features=f, variant=2 * i, seed=300 + i), False))
    for i, f in enumerate(f16_sets):
        case = Case(**f16, features=f, variant=i, seed=400 + i)
        cases.append((case if i % 2 else dataclasses.replace(case, block=None), False))
    cases.append((Case(b=2, t=300, s=300, n=6, k=3, h=64, features=ALL, seed=500), True))
    cases.append((Case(b=1, t=7, s=7, n=3, k=3, h=16, features=ALL, block=None, seed=501), False))
    return cases


def _params(cases: list[tuple[Case, bool]], impls=IMPLS, grid=lambda impl, i: False):
    """One param per (implementation, case). ``slow`` cases run in ``make test`` only, and so
    does every other case of each family (the fast tier, ``make test-fast``, keeps the even
    ones: each family's features still meet every implementation there). ``grid(impl, i)``:
    whether the param of ``impl`` and the ``i``-th case is the full grid's only (marked
    ``grid``: ``pytest --grid`` runs it)."""
    return [
        pytest.param(
            impl,
            case,
            id=f"{impl}-{case.id}",
            marks=[pytest.mark.slow] * bool(slow or i % 2) + [pytest.mark.grid] * grid(impl, i),
        )
        for i, (case, slow) in enumerate(cases)
        for impl in impls
    ]


@functools.cache
def _expected(case: Case):
    return evaluate(jaxckpt.attention_reference, build(case))


def _skip_unsupported(impl: str, inp) -> None:
    used, implementation = features_of(inp), implementations()[impl]
    missing = used - implementation.supports
    if missing:
        pytest.skip(f"{impl!r} does not support {sorted(missing)}")
    if "dropout" in used and not implementation.shares_dropout_mask:
        pytest.skip(f"{impl!r} draws its own dropout mask (tested in its own suite)")
    if impl == "cudnn" and inp.q.dtype == np.float32:
        pytest.skip("cuDNN attention takes bfloat16/float16 only")


def check_against_reference(impl: str, case: Case) -> None:
    inp = build(case)
    _skip_unsupported(impl, inp)
    got = evaluate(jaxckpt.flash_attention, inp, implementation=impl, block_sizes=case.block_sizes)
    want = _expected(case)
    b, t, n = case.b, case.t, case.n
    assert got.out.dtype == np.dtype(case.dtype), got.out.dtype
    assert got.lse.dtype == np.float32 and got.lse.shape == (b, t, n), (got.lse.dtype, got.lse.shape)
    assert_close(got.out, want.out, case.dtype, "fwd", "out")
    assert_close(got.lse, want.lse, case.dtype, "fwd", "lse")
    for name, grad in want.grads.items():
        assert got.grads[name].dtype == grad.dtype, (name, got.grads[name].dtype)
        assert_close(got.grads[name], grad, case.dtype, "grad", name)
    empty = ~seen_rows(inp)  # [B, T, N]
    assert not np.any(got.out[empty]), "a row that sees no key must output exactly 0"
    assert not np.any(got.grads["dq"][empty]), "a row that sees no key must get dq == 0"
    assert np.all(got.lse[empty] == -np.inf), "a row that sees no key must have lse == -inf"


def test_feature_names_match_the_library():
    assert set(FEATURES) == set(jaxckpt.attention.FEATURES)


@pytest.mark.parametrize(("impl", "case"), _params(_feature_cases()))
def test_each_feature_alone(impl, case):
    check_against_reference(impl, case)


TRIPLE_PARAMS = [p for impl in KERNELS for p in _params(_triple_cases(impl), [impl])]


@pytest.mark.parametrize(("impl", "case"), TRIPLE_PARAMS)
def test_feature_triples(impl, case):
    check_against_reference(impl, case)


@pytest.mark.parametrize(("impl", "case"), _params(_pair_cases(), KERNELS, grid=lambda impl, i: True))
def test_feature_pairs(impl, case):
    check_against_reference(impl, case)


def _shape_params():
    """Each (T, S) pair on one of the compiled kernels that run its features, in turns
    (``(i_T + i_S) mod n``: each kernel meets every T, S, H, (N, K), B and block), and on
    every one of them in the full grid; the interpreted kernels (Pallas off a GPU) on
    ``INTERPRETED_SHAPES``."""
    compiled = [impl for impl in KERNELS if impl not in INTERPRETED]
    cases = _shape_cases()

    def off_turn(impl: str, i: int) -> bool:
        takers = [k for k in compiled if runs(k, cases[i][0])]
        return not takers or impl != takers[(i // len(LENGTHS) + i % len(LENGTHS)) % len(takers)]

    fewer = [c for i, c in enumerate(cases) if i in INTERPRETED_SHAPES]
    return _params(cases, compiled, grid=off_turn) + _params(fewer, INTERPRETED)


SHAPE_PARAMS = _shape_params()


@pytest.mark.parametrize(("impl", "case"), SHAPE_PARAMS)
def test_all_length_pairs(impl, case):
    check_against_reference(impl, case)


def _default_params(params) -> list[tuple[str, Case]]:
    """The (implementation, case) pairs of ``params`` that ``make test`` runs (not ``grid``)."""
    return [p.values for p in params if not any(m.name == "grid" for m in p.marks) and runs(*p.values)]


def test_the_triples_meet_every_pair_of_features_on_every_kernel():
    """The covering design keeps what the pairs grid gave: on each kernel, every pair of the
    features it runs shares a case, and bias and mask take every broadcast shape."""
    for impl in KERNELS:
        runnable = runnable_features(impl)
        cases = [case for i, case in _default_params(TRIPLE_PARAMS) if i == impl]
        met = {pair for case in cases for pair in itertools.combinations(sorted(case.features), 2)}
        assert met == set(itertools.combinations(sorted(runnable), 2)), impl
        for feature in {"bias", "mask"} & runnable:
            assert {c.variant % 4 for c in cases if feature in c.features} == {0, 1, 2, 3}, (impl, feature)


def test_every_length_pair_runs_and_every_kernel_meets_every_length():
    params = _default_params(SHAPE_PARAMS)
    assert {(c.t, c.s) for _, c in params} == set(itertools.product(LENGTHS, LENGTHS))
    for impl in {impl for impl, _ in params}:
        cases = [c for i, c in params if i == impl]
        if impl in INTERPRETED:
            continue
        for field in ("t", "s", "h", "b", "block"):
            values = {getattr(c, field) for c in cases}
            assert values == {getattr(c, field) for c, _ in _shape_cases()}, (impl, field, values)
        assert {(c.n, c.k) for c in cases} == set(HEADS), impl


@pytest.mark.parametrize(("impl", "case"), _params(_dtype_cases(), KERNELS))
def test_low_precision_and_all_features(impl, case):
    check_against_reference(impl, case)


# --- dropout -----------------------------------------------------------------------------------------

DROPOUT_IMPLS = [
    impl
    for impl in IMPLS
    if "dropout" in implementations()[impl].supports and implementations()[impl].shares_dropout_mask
]


def _softmax_np(q, k, scale, visible=None):
    """float64 probabilities ``[B, N, T, S]``; K heads repeated to N."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    k = np.repeat(k, q.shape[2] // k.shape[2], axis=2)
    logits = np.einsum("btnh,bsnh->bnts", q, k) * scale
    if visible is not None:
        logits = np.where(visible, logits, -np.inf)
    logits = logits - logits.max(-1, keepdims=True)
    p = np.exp(logits)
    return p / p.sum(-1, keepdims=True)


@pytest.mark.parametrize("impl", DROPOUT_IMPLS)
def test_dropout_equals_explicit_keep_mask(impl):
    """softmax * keep / (1 - rate) @ V, with keep = dropout_mask(rng, (B, N, T, S), rate)."""
    b, t, s, n, k, h, rate = 2, 37, 53, 6, 3, 16, 0.3
    inp = build(Case(b=b, t=t, s=s, n=n, k=k, h=h, seed=7))
    rng = jax.random.key(11)
    keep = np.asarray(jaxckpt.attention.dropout_mask(rng, (b, n, t, s), rate))
    assert keep.shape == (b, n, t, s) and keep.dtype == np.bool_
    probs = _softmax_np(inp.q, inp.k, 1 / np.sqrt(h)) * keep / (1 - rate)
    v = np.repeat(np.asarray(inp.v, np.float64), n // k, axis=2)
    want = np.einsum("bnts,bsnh->btnh", probs, v)
    blocks = jaxckpt.BlockSizes(13, 24)
    flash = functools.partial(
        jaxckpt.flash_attention, dropout_rate=rate, block_sizes=blocks, implementation=impl
    )
    got = jax.jit(flash)(inp.q, inp.k, inp.v, dropout_rng=rng)
    assert_close(got, want, jnp.float32, "fwd", "dropout out")


@pytest.mark.parametrize("impl", DROPOUT_IMPLS)
def test_dropout_mask_is_the_mask_applied_whatever_the_blocks(impl):
    """With V = one-hot(key index), out[b, t, n, :S] is the dropped-out probability row."""
    b, t, s, n, rate = 2, 21, 29, 3, 0.3
    q = normal(np.random.default_rng(0), (b, t, n, 32), jnp.float32)
    k = normal(np.random.default_rng(1), (b, s, 1, 32), jnp.float32)
    v = jnp.broadcast_to(jnp.eye(s, 32, dtype=jnp.float32)[None, :, None, :], (b, s, 1, 32))
    rng = jax.random.key(3)
    keep = np.asarray(jaxckpt.attention.dropout_mask(rng, (b, n, t, s), rate))
    for block in [(4, 8), (7, 5), None]:
        blocks = None if block is None else jaxckpt.BlockSizes(*block)
        flash = functools.partial(
            jaxckpt.flash_attention, dropout_rate=rate, block_sizes=blocks, implementation=impl
        )
        out = jax.jit(flash)(q, k, v, dropout_rng=rng)
        applied = np.asarray(out)[..., :s].transpose(0, 2, 1, 3) != 0  # [B, N, T, S]
        np.testing.assert_array_equal(applied, keep, err_msg=f"block_sizes={block}")


def test_dropout_mask_keep_fraction_and_determinism():
    rate, shape = 0.3, (2, 3, 129, 300)
    keep = np.asarray(jaxckpt.attention.dropout_mask(jax.random.key(5), shape, rate))
    assert abs(keep.mean() - (1 - rate)) < 0.01, keep.mean()
    for axis in range(4):  # every index enters the hash: no two slices along an axis are equal
        first, second = np.take(keep, 0, axis), np.take(keep, 1, axis)
        assert 0.3 < (first != second).mean() < 0.55, (axis, (first != second).mean())
    again = np.asarray(jaxckpt.attention.dropout_mask(jax.random.key(5), shape, rate))
    np.testing.assert_array_equal(keep, again)
    other = np.asarray(jaxckpt.attention.dropout_mask(jax.random.key(6), shape, rate))
    assert 0.3 < (keep != other).mean() < 0.55


# --- rows that see no key ----------------------------------------------------------------------------


@functools.cache  # shared by every implementation's test and the reference result
def _empty_row_inputs(config: str):
    b, t, s, n, k, h = 2, 29, 7, 3, 1, 16
    rng = np.random.default_rng(9)
    inp = build(Case(b=b, t=t, s=s, n=n, k=k, h=h, features=("bias",), variant=3, seed=9))
    arrays, static = dict(inp.arrays), {}
    if config == "zero_query_length":
        arrays["query_seq_lengths"] = device([0, 11], jnp.int32)
    elif config == "zero_kv_length":
        arrays["key_value_seq_lengths"] = device([s, 0], jnp.int32)
    elif config == "mask_row_all_false":
        mask = random_mask(rng, (b, n, t, s))
        mask[0, 1, 4] = mask[1, :, 20:] = False
        arrays["mask"] = device(mask)
    elif config == "causal_window":  # T > S: rows t >= S + left see nothing
        static = dict(is_causal=True, local_window_size=(3, 0))
    elif config == "window_only":
        static = dict(local_window_size=(2, 1))
    elif config == "segments_unmatched":  # query segment 7 has no keys
        q_ids = np.zeros((b, t), np.int32)
        q_ids[:, 10:] = 7
        arrays["segment_ids"] = (device(q_ids), device(np.zeros((b, s), np.int32)))
    return inp._replace(arrays=arrays, static=static)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "config",
    [
        "zero_query_length",
        "zero_kv_length",
        "mask_row_all_false",
        "causal_window",
        "window_only",
        "segments_unmatched",
    ],
)
def test_rows_seeing_no_key_give_exact_zeros(impl, config):
    inp = _empty_row_inputs(config)
    _skip_unsupported(impl, inp)
    got = evaluate(jaxckpt.flash_attention, inp, implementation=impl, block_sizes=jaxckpt.BlockSizes(8, 4))
    empty = ~seen_rows(inp)  # [B, T, N]
    assert empty.any(), "the configuration must empty some rows"
    for name, x in [("out", got.out), *got.grads.items()]:
        assert np.isfinite(x).all(), f"{name} has NaN/inf"
    assert np.isfinite(got.lse[~empty]).all()
    assert np.all(got.lse[empty] == -np.inf)
    assert not np.any(got.out[empty]) and not np.any(got.grads["dq"][empty])
    dbias = got.grads["dbias"]  # bias is [B, N, T, S]: a row's bias gets no gradient
    assert not np.any(dbias.transpose(0, 2, 1, 3)[empty])
    want = _empty_row_expected(config)
    assert_close(got.out, want.out, jnp.float32, "fwd", "out")
    for name, grad in want.grads.items():
        assert_close(got.grads[name], grad, jnp.float32, "grad", name)


@functools.cache
def _empty_row_expected(config: str):
    return evaluate(jaxckpt.attention_reference, _empty_row_inputs(config))


# --- large logits ------------------------------------------------------------------------------------


@functools.cache
def _large_logit_inputs(dtype: str):
    """q and k hold integers (exact in bf16 too) and scale = 1/4, so every logit is exact
    in float32 whatever the summation order. Cached: every kernel is checked against the
    same reference result, computed once per dtype."""
    b, t, s, n, k, h = 1, 37, 45, 3, 1, 16
    rng = np.random.default_rng(4)
    q = np.clip(np.round(60 * rng.standard_normal((b, t, n, h))), -250, 250)
    kk = np.clip(np.round(60 * rng.standard_normal((b, s, k, h))), -250, 250)
    logits = np.einsum("btnh,bsnh->bnts", q, np.repeat(kk, n, axis=2)) / 4
    case = Case(b=b, t=t, s=s, n=n, k=k, h=h, dtype=dtype, features=("causal",), block=(16, 16))
    inp = build(case)._replace(q=device(q, dtype), k=device(kk, dtype))
    return case, inp, logits, evaluate(jaxckpt.attention_reference, inp)


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_large_logits_stay_finite_and_exact(impl, dtype):
    """Logits up to ~1e4, exact in float32 (see _large_logit_inputs)."""
    case, inp, logits, want = _large_logit_inputs(dtype)
    assert np.abs(logits).max() >= 1e4
    got = evaluate(jaxckpt.flash_attention, inp, implementation=impl, block_sizes=case.block_sizes)
    for name, x in [("out", got.out), ("lse", got.lse), *got.grads.items()]:
        assert np.isfinite(x).all(), f"{name} has NaN/inf"
    assert_close(got.out, want.out, dtype, "fwd", "out")
    assert_close(got.lse, want.lse, dtype, "fwd", "lse")
    for name, grad in want.grads.items():
        assert_close(got.grads[name], grad, dtype, "grad", name)
