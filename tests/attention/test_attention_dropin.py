"""Drop-in cases that jax.nn.dot_product_attention handles and flash_attention must too.

- Under ``jax_enable_x64``, float32 attention with a ``mask`` or a ``bias`` (and every
  other feature) runs, forward and gradient, and equals the result without x64. (It
  used to raise: Python ``0`` start indices became int64 next to int32 tile indices
  in ``dynamic_slice``.)
- Inside ``jax.shard_map`` with ``check_vma=True`` (how tensor- and data-parallel
  users call attention): forward and gradient run, eagerly and under jit, and equal
  the unsharded call. (It used to raise: custom_vjp symbolic zeros are unsupported
  there, and the loop carries lacked the inputs' varying-mesh-axes type.)
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import Case, build, device, evaluate, features_of
from jax.sharding import PartitionSpec as P
from tolerances import assert_close

import jaxckpt
from jaxckpt.attention import available_implementations, implementations

IMPLS = [
    impl for impl in ("blockwise", "reference", "xla", "npu_reference") if impl in available_implementations()
]


def _skip_unsupported(impl: str, inp) -> None:
    missing = features_of(inp) - implementations()[impl].supports
    if missing:
        pytest.skip(f"{impl!r} does not support {sorted(missing)}")


# --- jax_enable_x64 ----------------------------------------------------------------------------------

X64_FEATURES = [("mask",), ("bias",), ("bias", "mask", "causal", "lengths", "segments", "window")]


X64_CASES = [
    pytest.param(
        impl,
        features,
        id=f"{impl}-{'+'.join(features)}",
        marks=[] if impl == "blockwise" and len(features) == 1 else [pytest.mark.slow],
    )
    for impl in IMPLS
    for features in X64_FEATURES
]


@pytest.mark.parametrize(("impl", "features"), X64_CASES)
def test_float32_under_x64_with_mask_or_bias(impl, features):
    case = Case(b=2, t=9, s=13, n=6, k=3, h=16, features=features, block=(4, 8), variant=1, seed=3)
    inp = build(case)
    _skip_unsupported(impl, inp)
    want = evaluate(jaxckpt.flash_attention, inp, implementation=impl, block_sizes=case.block_sizes)
    with jax.enable_x64(True):
        got = evaluate(jaxckpt.flash_attention, inp, implementation=impl, block_sizes=case.block_sizes)
    assert got.out.dtype == np.float32 and got.lse.dtype == np.float32
    assert_close(got.out, want.out, jnp.float32, "fwd", "out")
    assert_close(got.lse, want.lse, jnp.float32, "fwd", "lse")
    for name, grad in want.grads.items():
        assert got.grads[name].dtype == np.float32, name
        assert_close(got.grads[name], grad, jnp.float32, "grad", name)


def test_the_issue_reproducer_under_x64():
    with jax.enable_x64(True):
        q = jnp.ones((1, 9, 2, 16), jnp.float32)
        out = jaxckpt.flash_attention(q, q, q, mask=jnp.ones((9, 9), bool))
        grad = jax.grad(lambda q: jaxckpt.flash_attention(q, q, q, bias=jnp.zeros((9, 9))).sum())(q)
    assert out.dtype == grad.dtype == jnp.float32
    np.testing.assert_allclose(out, 1.0, rtol=1e-6)


@pytest.mark.slow
def test_dropout_under_x64_draws_the_same_mask():
    case = Case(b=1, t=11, s=7, n=3, k=1, h=16, features=("dropout", "bias"), block=(4, 4), seed=5)
    inp = build(case)
    want = evaluate(jaxckpt.flash_attention, inp, implementation="blockwise", block_sizes=case.block_sizes)
    with jax.enable_x64(True):
        got = evaluate(jaxckpt.flash_attention, inp, implementation="blockwise", block_sizes=case.block_sizes)
    assert_close(got.out, want.out, jnp.float32, "fwd", "out")
    for name, grad in want.grads.items():
        assert_close(got.grads[name], grad, jnp.float32, "grad", name)


# --- jax.shard_map -----------------------------------------------------------------------------------

SPEC = P("dp", None, "tp", None)  # batch over dp, heads over tp


@functools.cache
def _mesh() -> jax.sharding.Mesh:
    devices = jax.devices()[:4]
    if len(devices) < 4:
        pytest.skip(f"needs 4 devices; this process has {len(jax.devices())} (conftest sets 8 CPU devices)")
    return jax.sharding.Mesh(np.array(devices).reshape(2, 2), ("dp", "tp"))


def _sharded(fn, in_specs):
    return jax.shard_map(fn, mesh=_mesh(), in_specs=in_specs, out_specs=SPEC, check_vma=True)


def _value_and_grads(fn, args, argnums, w):
    """``fn(*args)`` and the gradients of ``sum(fn(*args) * w)`` wrt ``args[argnums]``, from one
    ``jax.vjp`` with cotangent ``w`` (that loss's gradient): the forward runs once, where
    ``fn(*args)`` beside ``jax.grad`` ran it twice (eagerly, a third of the test's time)."""

    def of_differentiated(*diff):
        full = list(args)
        for i, x in zip(argnums, diff, strict=True):
            full[i] = x
        return fn(*full)

    out, pullback = jax.vjp(of_differentiated, *(args[i] for i in argnums))
    return out, pullback(w)


# One jitted driver for the module: called with the same (static) function object and
# shapes it reuses its compiled program, so a test's unsharded expectation is compiled once.
_jit_value_and_grads = jax.jit(_value_and_grads, static_argnums=(0, 2))


def _compare(sharded, unsharded, args, argnums, w, jit: bool):
    run = _jit_value_and_grads if jit else _value_and_grads
    out, grads = run(sharded, args, argnums, w)
    # The expectation is the unsharded call, under jit: eager == jit is tested in
    # test_attention_tracing.py, and eager op-by-op dispatch here doubled the test's time.
    want_out, want_grads = _jit_value_and_grads(unsharded, args, argnums, w)
    assert_close(out, want_out, jnp.float32, "fwd", "out")
    for i, g, e in zip(argnums, grads, want_grads, strict=True):
        assert_close(g, e, jnp.float32, "grad", f"d(arg {i})")


SHARD_MAP_CASES = [
    pytest.param(
        impl,
        jit,
        id=f"{impl}-{'jit' if jit else 'eager'}",
        marks=[] if (impl, jit) == ("blockwise", True) else [pytest.mark.slow],  # the issue's case is fast
    )
    for impl in ("blockwise", "reference", "xla")
    for jit in (False, True)
    if impl in IMPLS and (jit or impl == "blockwise")  # eager shard_map is slow: the kernel only
]


@functools.cache  # one function object per implementation, so jit's cache hits across tests
def _causal(impl: str):
    return functools.partial(jaxckpt.flash_attention, is_causal=True, implementation=impl)


@functools.cache  # the same arrays in every test, so the unsharded program compiles once an impl
def _issue_inputs():
    rng = np.random.default_rng(0)
    return tuple(device(rng.standard_normal((4, 128, 4, 64)), jnp.float32) for _ in range(4))


@pytest.mark.parametrize(("impl", "jit"), SHARD_MAP_CASES)
def test_causal_inside_shard_map(impl, jit):
    """The issue's case: q, k, v [4, 128, 4, 64], P("dp", None, "tp", None), is_causal."""
    q, k, v, w = _issue_inputs()
    attend = _causal(impl)
    _compare(_sharded(attend, (SPEC,) * 3), attend, (q, k, v), (0, 1, 2), w, jit)


@pytest.mark.slow
def test_every_mask_feature_inside_shard_map():
    """GQA, odd sizes, small blocks, and a bias, a mask, lengths, segment ids and a window,
    each sharded with the batch (and the bias with the heads too)."""
    b, t, n, kh, h = 4, 37, 4, 2, 16
    rng = np.random.default_rng(1)
    normal = lambda *shape: device(rng.standard_normal(shape), jnp.float32)
    q, k, v, w = normal(b, t, n, h), normal(b, t, kh, h), normal(b, t, kh, h), normal(b, t, n, h)
    bias = normal(b, n, t, t)
    mask = device(rng.random((b, 1, t, t)) < 0.8)
    lengths = device([37, 20, 5, 30], jnp.int32)
    segments = device(np.sort(rng.integers(0, 3, (b, t)), axis=1), jnp.int32)

    def attend(q, k, v, bias, mask, lengths, segments):
        return jaxckpt.flash_attention(
            q, k, v, bias, mask, is_causal=True, query_seq_lengths=lengths, segment_ids=segments,
            local_window_size=(9, 3), implementation="blockwise", block_sizes=jaxckpt.BlockSizes(8, 16),
        )  # fmt: skip

    specs = (SPEC, SPEC, SPEC, P("dp", "tp", None, None), P("dp", None, None, None), P("dp"), P("dp", None))
    args = (q, k, v, bias, mask, lengths, segments)
    _compare(_sharded(attend, specs), attend, args, (0, 1, 2, 3), w, jit=True)


@pytest.mark.slow
def test_dropout_runs_inside_shard_map():
    """Dropout runs there too. Its mask is a function of the shard's *local* (b, n, t, s)
    indices, so it equals the unsharded mask only where those are the global ones: with
    the batch and heads replicated (P()), sharded calls equal the unsharded call."""
    rng = np.random.default_rng(2)
    q, k, v, w = (device(rng.standard_normal((3, 21, 2, 16)), jnp.float32) for _ in range(4))
    attend = functools.partial(
        jaxckpt.flash_attention, dropout_rate=0.3, dropout_rng=jax.random.key(4), implementation="blockwise"
    )
    sharded = jax.shard_map(attend, mesh=_mesh(), in_specs=(P(),) * 3, out_specs=P(), check_vma=True)
    want_out, want_grads = _jit_value_and_grads(attend, (q, k, v), (0, 1, 2), w)
    out, grads = _jit_value_and_grads(sharded, (q, k, v), (0, 1, 2), w)
    assert_close(out, want_out, jnp.float32, "fwd", "out")
    for g, e in zip(grads, want_grads, strict=True):
        assert_close(g, e, jnp.float32, "grad", "grad")
