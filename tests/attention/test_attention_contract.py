"""The one contract suite: every available attention implementation vs the reference.

Each case compares the output, the log-sum-exp (``return_residual=True``) and the
gradients wrt q, k, v and bias of ``sum(out * w)`` (``w`` random) with
``jaxckpt.attention_reference``, and checks that rows seeing no key give exactly 0.

The grid is a covering design, not a cartesian product (that would take hours). Each
feature is a factor (present or absent), and on every kernel every value of each factor
and every pair of values of two factors meets in some case (pairwise covering):

- no feature, in float32 (each feature alone: ``--grid``);
- every pair of features, met in one of 11 sets of three features (``FEATURE_TRIPLES``, a
  pairwise covering of the 8 features), each kernel given the triples cut down to the
  features it supports, so that every kernel meets every pair of its features; a cut-down
  triple whose pairs (and bias and mask shapes) the kernel's other triples already meet
  runs under ``--grid`` only (``covering_triples``). A triple holds each of its features
  beside the five absent ones, so the features alone add no pair;
- all 16 (T, S) pairs over {1, 7, 129, 300} with one feature set, cycling through
  every H in {16, 40, 64}, (N, K) in {(3, 1), (6, 3), (6, 1), (3, 3)}, B and blocks, each
  pair on one compiled kernel, in turns (``(i_T + i_S) mod kernels``: every kernel still
  meets every T, every S, H, (N, K), B and block);
- every feature once in bfloat16 or float16, and all features at once in each dtype; on a
  kernel that runs all of them at once in a dtype, each feature is met there present (the
  all-features case) and absent (the others), and the one-feature cases that add neither
  (bf16 dropout, fp16 soft cap) run under ``--grid`` only.

The full cross products (every feature alone and every pair of features alone on every
kernel, every (T, S) pair on every compiled kernel) and the cases above left to it are
marked ``grid``: ``pytest --grid`` (or ``JAXCKPT_FULL_GRID=1``) runs them as well.

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


def _single_beyond_the_covering(impl: str, i: int) -> bool:
    """A feature alone (not the plain case) on a kernel: its pairs of factor values are met by
    the kernel's triples (``--grid`` runs it). ``reference`` and the CPU stand-ins, which
    run no triples, keep every feature alone."""
    return i > 0 and impl in KERNELS


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


FAST_TRIPLES = (0, 7, 9)
"""The triples of the fast tier (``make test-fast``): together they hold all 8 features."""


def _triple_cases(impl: str) -> list[tuple[int, Case]]:
    """``(i, case)``: ``FEATURE_TRIPLES[i]`` cut down to the features ``impl`` supports (a
    pair it supports stays together), at the two shapes in turn."""
    runnable, cases = runnable_features(impl), []
    for i, (triple, variant) in enumerate(zip(FEATURE_TRIPLES, TRIPLE_VARIANTS, strict=True)):
        features = tuple(f for f in triple if f in runnable)
        if features:
            shape = (SHAPE_A, SHAPE_B)[i % 2]
            cases.append((i, Case(**shape, features=features, variant=variant, seed=600 + i)))
    return cases


def _shapes_met(cases) -> set[tuple]:
    """The broadcast shapes (variant mod 4) of bias and of mask that ``cases`` meet."""
    return {(f, c.variant % 4) for c in cases for f in ("bias", "mask") if f in c.features}


def _pairs_met(cases) -> set[tuple]:
    """What ``cases`` meet: each feature, each pair of features, each shape of bias and mask."""
    met = _shapes_met(cases)
    for case in cases:
        features = sorted(case.features)
        met |= {(f,) for f in features} | set(itertools.combinations(features, 2))
    return met


def _without_the_covered(cases: dict[int, Case], met) -> set[int]:
    """The indices of ``cases`` left once each case whose ``met([case])`` the others meet is
    dropped, one at a time, the fewest features first, then the last first."""
    kept = dict(cases)
    for i in sorted(kept, key=lambda i: (len(kept[i].features), -i)):
        if met([kept[i]]) <= met([case for j, case in kept.items() if j != i]):
            del kept[i]
    return set(kept)


def covering_triples(impl: str) -> set[int]:
    """The indices of the cut-down triples ``make test`` runs on ``impl``: all but those whose
    features, pairs and bias and mask shapes the others already meet. Cut down to a kernel's
    features, some triples become pairs or single features that others hold (splash: 6 of 11
    are left, xla: 10, the kernels that run all 8 features: the 11)."""
    return _without_the_covered(dict(_triple_cases(impl)), _pairs_met)


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


def _values_met(impl: str):
    """``met(cases)``: each feature ``impl`` runs, present and absent, each block size, and each
    shape of bias and mask that ``cases`` meet."""
    runnable = runnable_features(impl)

    def met(cases) -> set[tuple]:
        found = _shapes_met(cases) | {("block", c.block) for c in cases}
        return found | {(f, f in c.features) for c in cases for f in runnable}

    return met


def covering_low_precision(impl: str) -> set[int]:
    """The indices of ``_dtype_cases()`` that ``make test`` runs on ``impl``: in each low
    precision, all that ``impl`` runs but those whose values (each feature present and absent,
    block, bias and mask shapes) the dtype's other cases meet. On a kernel that runs the
    all-features case, that drops bf16 dropout and fp16 soft cap; float32 keeps its two."""
    cases = list(enumerate(c for c, _ in _dtype_cases()))
    kept = {i for i, c in cases if c.dtype == "float32" or not runs(impl, c)}  # those skip
    for dtype in ("bfloat16", "float16"):
        runnable = {i: c for i, c in cases if c.dtype == dtype and runs(impl, c)}
        kept |= _without_the_covered(runnable, _values_met(impl))
    return kept


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


SINGLE_PARAMS = _params(_feature_cases(), grid=_single_beyond_the_covering)


@pytest.mark.parametrize(("impl", "case"), SINGLE_PARAMS)
def test_each_feature_alone(impl, case):
    check_against_reference(impl, case)


def _triple_params() -> list:
    """``make test`` runs the covering triples of each kernel (``FAST_TRIPLES`` in the fast
    tier too), ``--grid`` every cut-down triple."""
    params = []
    for impl in KERNELS:
        covering = covering_triples(impl)
        for i, case in _triple_cases(impl):
            marks = [pytest.mark.slow] * (i not in FAST_TRIPLES) + [pytest.mark.grid] * (i not in covering)
            params.append(pytest.param(impl, case, id=f"{impl}-{case.id}", marks=marks))
    return params


TRIPLE_PARAMS = _triple_params()


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


FLOAT32_KERNELS = [impl for impl in KERNELS if runs(impl, Case())]
"""The kernels the float32 feature grids run on: all but cuDNN (bfloat16 and float16 only)."""


def test_the_triples_meet_every_pair_of_features_on_every_kernel():
    """The covering design keeps what the pairs grid gave: on each kernel, every pair of the
    features it runs shares a case, and bias and mask take every broadcast shape."""
    for impl in FLOAT32_KERNELS:
        runnable = runnable_features(impl)
        cases = [case for i, case in _default_params(TRIPLE_PARAMS) if i == impl]
        met = {pair for case in cases for pair in itertools.combinations(sorted(case.features), 2)}
        assert met == set(itertools.combinations(sorted(runnable), 2)), impl
        for feature in {"bias", "mask"} & runnable:
            assert {c.variant % 4 for c in cases if feature in c.features} == {0, 1, 2, 3}, (impl, feature)


def test_every_pair_of_feature_values_meets_on_every_kernel():
    """Each feature a factor, present or absent: on each kernel, the float32 feature cases of
    ``make test`` (no feature, the covering triples) meet every pair of values of two of its
    features, so the features alone (``--grid``) add none."""
    for impl in FLOAT32_KERNELS:
        runnable = sorted(runnable_features(impl))
        cases = [c for i, c in _default_params(SINGLE_PARAMS + TRIPLE_PARAMS) if i == impl]
        met = set()
        for case in cases:
            values = [(f, f in case.features) for f in runnable]
            met |= set(itertools.combinations(values, 2))
        pairs, both = itertools.combinations(runnable, 2), list(itertools.product((False, True), repeat=2))
        every = {((a, x), (b, y)) for a, b in pairs for x, y in both}
        assert met == every, (impl, sorted(every - met))


def test_low_precision_cases_meet_what_the_full_grid_meets():
    """In bfloat16 and in float16, on each kernel, the cases of ``make test`` meet every value
    the dtype's cases meet under ``--grid``: each feature present and absent, each block and
    each shape of bias and mask."""
    params = _default_params(LOW_PRECISION_PARAMS)
    for impl in KERNELS:
        for dtype in ("bfloat16", "float16"):
            everything = [c for c, _ in _dtype_cases() if c.dtype == dtype and runs(impl, c)]
            kept = [c for i, c in params if i == impl and c.dtype == dtype]
            assert _values_met(impl)(kept) == _values_met(impl)(everything), (impl, dtype)


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


LOW_PRECISION_PARAMS = _params(
    _dtype_cases(), KERNELS, grid=lambda impl, i: i not in covering_low_precision(impl)
)


@pytest.mark.parametrize(("impl", "case"), LOW_PRECISION_PARAMS)
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
