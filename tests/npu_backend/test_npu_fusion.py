"""The NPU route (JAX -> call_torch -> npu_fusion_attention(_grad) -> custom_vjp) against
``jaxckpt.attention_reference``: outputs, log-sum-exps and gradients.

On this CPU the op contract's plain-torch reference (``npu_backend.emulator``) stands in
for torch_npu (``implementation="npu_reference"``). The same cases run against the real
kernels (``implementation="npu"``), marked ``npu``, wherever torch_npu sees an NPU.
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from attention_cases import Case, build, evaluate, seen_rows, visible_np  # noqa: E402
from tolerances import assert_close  # noqa: E402

import jaxckpt  # noqa: E402
import npu_backend  # noqa: E402
from jaxckpt.attention import normalize  # noqa: E402
from npu_backend._fusion import npu_attention  # noqa: E402

pytestmark = pytest.mark.torch

IMPLS = ["npu_reference", pytest.param("npu", marks=pytest.mark.npu)]
FEATURES = ("bias", "mask", "causal", "lengths", "window", "segments")
SHAPES = (dict(b=2, t=9, s=13, n=6, k=3, h=8), dict(b=3, t=11, s=7, n=6, k=2, h=16))
SQUARE = dict(b=2, t=11, s=11, n=3, k=1, h=8)


def _singles() -> list[Case]:
    """Each feature alone at both shapes: ``--grid`` only, since the pairs meet every pair of
    values (present, absent) of two features, each feature at both shapes, and every broadcast
    shape of bias and mask (``test_the_cases_meet_every_pair_of_feature_values``)."""
    return [
        Case(**shape, features=(feature,), block=None, variant=variant + i, seed=10 + i)
        for i, feature in enumerate(FEATURES)
        for variant, shape in enumerate(SHAPES)
    ]


def _cases() -> list[Case]:
    """No feature at both shapes, every pair of features, and bfloat16: ``make test``."""
    cases = [Case(**shape, features=(), block=None, seed=i) for i, shape in enumerate(SHAPES)]
    for i, pair in enumerate(itertools.combinations(FEATURES, 2)):
        same_starts = set(pair) == {"causal", "segments"}  # TND: one array of ids (T == S, even variant)
        shape, variant = (SQUARE, 2 * i) if same_starts else (SHAPES[i % 2], i)
        cases.append(Case(**shape, features=pair, block=None, variant=variant, seed=100 + i))
    bf16 = dict(SQUARE, dtype="bfloat16")
    cases += [
        Case(**bf16, features=f, block=None, seed=200 + i) for i, f in enumerate([("causal",), FEATURES])
    ]
    return cases


CASES = _cases()
CASE_PARAMS = [pytest.param(c, id=c.id) for c in CASES] + [
    pytest.param(c, id=c.id, marks=pytest.mark.grid) for c in _singles()
]


def _check(impl: str, case: Case) -> None:
    inp = build(case)
    got = evaluate(jaxckpt.flash_attention, inp, implementation=impl)
    want = evaluate(jaxckpt.attention_reference, inp)
    assert got.out.dtype == np.dtype(case.dtype)
    assert_close(got.out, want.out, case.dtype, "fwd", "out")
    assert_close(got.lse, want.lse, case.dtype, "fwd", "lse")
    for name, grad in want.grads.items():
        assert got.grads[name].dtype == grad.dtype, name
        assert_close(got.grads[name], grad, case.dtype, "grad", name)
    empty = ~seen_rows(inp)
    assert not np.any(got.out[empty]) and not np.any(got.grads["dq"][empty])


@pytest.mark.parametrize("case", CASE_PARAMS)
@pytest.mark.parametrize("impl", IMPLS)
def test_matches_the_reference(impl, case):
    _check(impl, case)


def test_the_cases_meet_every_pair_of_feature_values():
    """Each feature a factor (present or absent): the float32 cases of ``make test`` meet every
    pair of values of two features, each feature at both shapes, every broadcast shape of
    bias and mask, and both forms of segment ids."""
    cases = [c for c in CASES if c.dtype == "float32"]
    met = set()
    for case in cases:
        met |= set(itertools.combinations([(f, f in case.features) for f in FEATURES], 2))
    values = list(itertools.product((False, True), repeat=2))
    assert met == {((a, x), (b, y)) for a, b in itertools.combinations(FEATURES, 2) for x, y in values}
    for feature in FEATURES:
        assert {(c.t, c.s) for c in cases if feature in c.features} >= {(s["t"], s["s"]) for s in SHAPES}
    for feature in ("bias", "mask"):
        assert {c.variant % 4 for c in cases if feature in c.features} == {0, 1, 2, 3}, feature
    segments = [build(c).arrays["segment_ids"] for c in cases if "segments" in c.features]
    assert {isinstance(ids, tuple) for ids in segments} == {False, True}


@pytest.mark.parametrize(
    "features", [("mask", "lengths"), ("window", "segments", "bias"), ("causal", "mask", "lengths")]
)
def test_the_op_masks_exactly_what_visible_hides(features):
    """The atten_mask handed to npu_fusion_attention is jaxckpt's own mask, built in JAX from
    the one predicate: True exactly where the independent NumPy oracle says a pair is hidden."""
    seen = []
    ref = npu_backend.reference_ops()

    def forward(*args, **kwargs):
        seen.append(kwargs)
        return ref.forward(*args, **kwargs)

    inp = build(Case(**SHAPES[1], features=features, block=None, variant=1, seed=40))
    p = normalize(inp.q, inp.k, inp.v, **inp.arrays, **inp.static)
    out, _ = npu_attention(p, dataclasses.replace(ref, forward=forward))
    jax.block_until_ready(out)
    (kwargs,) = seen
    hidden = np.asarray(kwargs["atten_mask"])
    assert kwargs["sparse_mode"] == 0 and hidden.dtype == np.bool_
    hides = ~visible_np(inp)  # [B, N, T, S]
    np.testing.assert_array_equal(np.broadcast_to(hidden, hides.shape), hides)
    assert_close(out, jaxckpt.attention_reference(inp.q, inp.k, inp.v, **inp.arrays, **inp.static), "float32")


def _dropout(impl: str, rng, rate=0.3):
    """The inputs and ``loss(q, k, v) = sum(attention(q, k, v) * w)`` with dropout."""
    inp = build(Case(**SQUARE, block=None, seed=5))

    def loss(q, k, v):
        out = jaxckpt.flash_attention(q, k, v, dropout_rate=rate, dropout_rng=rng, implementation=impl)
        return jnp.sum(out * inp.w)

    return inp, loss


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_dropout_is_seeded_and_its_gradient_is_consistent(impl):
    """The kernel's own dropout mask (not jaxckpt's): a function of dropout_rng, the same
    in the forward and the backward, so the gradient is the derivative of the forward."""
    inp, loss = _dropout(impl, jax.random.key(1))
    qkv = (inp.q, inp.k, inp.v)
    first, grads = loss(*qkv), jax.grad(loss, argnums=(0, 1, 2))(*qkv)
    again = _dropout(impl, jax.random.key(1))[1](*qkv)
    other = _dropout(impl, jax.random.key(2))[1](*qkv)
    undropped = _dropout(impl, jax.random.key(1), rate=0.0)[1](*qkv)
    assert float(first) == float(again) and float(first) != float(other) != float(undropped)
    direction = [jax.random.normal(jax.random.key(i), x.shape) for i, x in enumerate((inp.q, inp.k, inp.v))]
    eps = 1e-3
    plus = loss(*(x + eps * d for x, d in zip((inp.q, inp.k, inp.v), direction, strict=True)))
    minus = loss(*(x - eps * d for x, d in zip((inp.q, inp.k, inp.v), direction, strict=True)))
    numeric = (float(plus) - float(minus)) / (2 * eps)
    analytic = sum(float(jnp.vdot(g, d)) for g, d in zip(grads, direction, strict=True))
    assert numeric == pytest.approx(analytic, rel=2e-2, abs=2e-2)


def test_unsupported_arguments_raise_not_implemented():
    q = jnp.ones((1, 5, 2, 8))
    with pytest.raises(NotImplementedError, match="softcap"):
        jaxckpt.flash_attention(q, q, q, logits_soft_cap=5.0, implementation="npu_reference")
    with pytest.raises(NotImplementedError, match="logits_soft_cap"):  # the route's own check
        npu_attention(normalize(q, q, q, logits_soft_cap=5.0), npu_backend.reference_ops())


@pytest.mark.parametrize("is_causal", [False, True])
def test_segments_that_cannot_become_tnd_take_the_full_mask(is_causal):
    """Segment 0 split into two runs (and, causal, key runs that start apart)."""
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((2, 5, 2, 8)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((2, 7, 1, 8)), jnp.float32)
    ids = (
        jnp.array([[0, 0, 1, 1, 0], [2, 2, 2, 3, 3]]),
        jnp.array([[1, 0, 0, 1, 1, 0, 0], [3, 2, 2, 2, 2, 3, 3]]),
    )

    def grads(impl):
        def loss(q, kv):
            out = jaxckpt.flash_attention(
                q, kv, kv, segment_ids=ids, is_causal=is_causal, implementation=impl
            )
            return jnp.sum(out * jnp.cos(out))

        return jax.value_and_grad(loss, argnums=(0, 1))(q, kv)

    (got, got_grads), (want, want_grads) = grads("npu_reference"), grads("reference")
    assert float(got) == pytest.approx(float(want), abs=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5)


@pytest.mark.skipif(npu_backend.is_available(), reason="torch_npu is usable here")
def test_npu_without_torch_npu_is_a_clear_error_not_a_fallback():
    q = jnp.ones((1, 5, 2, 8))
    with pytest.raises(ValueError, match=r"npu.*unavailable.*torch_npu"):
        jaxckpt.flash_attention(q, q, q, implementation="npu")
    with pytest.raises(RuntimeError, match="Ascend NPU backend is unavailable"):
        npu_backend.torch_npu_ops()
    assert "npu" not in jaxckpt.attention.available_implementations()


def test_a_model_runs_on_the_npu_route():
    from flax import nnx

    cfg = jaxckpt.nn.TransformerConfig.preset(
        "tiny", n_layers=1, d_model=24, n_heads=3, n_kv_heads=1, ffn_dim=40
    )
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 9)), jnp.int32)
    logits = {}
    for impl in ("npu_reference", "reference"):
        model = jaxckpt.nn.Transformer(cfg, rngs=nnx.Rngs(0), attention=impl)
        logits[impl] = np.asarray(model(tokens))
    np.testing.assert_allclose(logits["npu_reference"], logits["reference"], atol=2e-5)


def test_availability_survives_a_broken_torch_npu(monkeypatch):
    """Without CANN, `import torch_npu` raises OSError on libhccl.so: reported, not raised."""
    from npu_backend import _availability

    real_import = _availability.importlib.import_module

    def broken(name, *args):
        if name == "torch_npu":
            raise OSError("libhccl.so: cannot open shared object file: No such file or directory")
        return real_import(name, *args)

    monkeypatch.setattr(_availability.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(_availability.importlib, "import_module", broken)
    _availability._probe.cache_clear()
    try:
        assert npu_backend.is_available() is False
        info = npu_backend.info()
        assert info["available"] is False and "libhccl.so" in info["reason"]
        assert info["reason"].startswith("import torch_npu failed: OSError")
        assert npu_backend.device_count() == 0
    finally:
        _availability._probe.cache_clear()  # probed afresh once monkeypatch restores the imports
