"""The XLA FFI attention route (``implementation="npu_ffi"``, ``npu_backend._ffi``) against
``jaxckpt.attention_reference``.

Forward (out and lse) and gradients, float32, on the CPU kernel behind the
custom calls: plain, causal, window, causal + window, GQA, T != S, several key
blocks, rows that see no key, under jit and vmap; argument errors on both the
Python and the C++ side; and the build script. The whole module skips itself
when the C++ library cannot be built (no compiler).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import assert_close

import jaxckpt
from jaxckpt.attention import normalize
from npu_backend import _ffi
from npu_backend.ffi import build as ffi_build

F32 = jnp.float32
ffi_attention = functools.partial(jaxckpt.flash_attention, implementation="npu_ffi")


def _ffi_out(vmap_method: str):
    """The route's output, batched under vmap by ``vmap_method`` (not a flash_attention option)."""

    def attend(q, k, v, **kw):
        return _ffi.ffi_attention_normalized(normalize(q, k, v, **kw), vmap_method=vmap_method)[0]

    return attend


@pytest.fixture(scope="module", autouse=True)
def ffi_library():
    """Builds (once; later sessions find it up to date) and registers the library, or skips."""
    reason = _ffi.unavailable()
    if reason is not None:
        pytest.skip(reason)
    _ffi.register()


def _normal(shape, seed, dtype=F32) -> jax.Array:
    # numpy, not jax.random: compiling threefry for every shape would dominate the run time
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32), dtype)


def _inputs(b, t, s, n, k, h, dtype=F32, seed=0):
    return (
        _normal((b, t, n, h), seed, dtype),
        _normal((b, s, k, h), seed + 1, dtype),
        _normal((b, s, k, h), seed + 2, dtype),
    )


def _grads(fn, q, k, v, **kw):
    """Gradients of sum(out * W) for a fixed random projection W."""
    w = _normal(q.shape, 7)
    loss = lambda q, k, v: (fn(q, k, v, **kw).astype(F32) * w).sum()
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def _results(fn, q, k, v, **kw):
    """``(out, lse, (dq, dk, dv))`` of ``fn``, computed in one jitted call (fast to compile)."""

    def run(q, k, v):
        out, lse = fn(q, k, v, return_residual=True, **kw)
        return out, lse, _grads(fn, q, k, v, **kw)

    return jax.jit(run)(q, k, v)


def _check(q, k, v, **kw):
    out, lse, got = _results(ffi_attention, q, k, v, **kw)
    ref_out, ref_lse, want = _results(jaxckpt.attention_reference, q, k, v, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert_close(out, ref_out, q.dtype, "fwd", "out")
    assert_close(lse, ref_lse, F32, "fwd", "lse")
    for name, g, r in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert g.shape == r.shape and g.dtype == r.dtype
        assert_close(g, r, q.dtype, "grad", name)
    return out, lse, got


CASES = {
    # name: ((B, T, S, N, K, H), kwargs)
    "plain": ((3, 5, 7, 9, 9, 11), {}),
    "scale": ((3, 5, 7, 9, 9, 11), dict(scale=0.37)),
    "causal": ((3, 5, 7, 9, 9, 11), dict(is_causal=True)),
    "causal_t_gt_s": ((3, 7, 5, 9, 9, 11), dict(is_causal=True)),
    "window": ((3, 5, 7, 9, 9, 11), dict(local_window_size=(1, 2))),
    "window_int": ((3, 7, 5, 9, 9, 11), dict(local_window_size=1)),
    "causal_window": ((3, 7, 5, 9, 9, 11), dict(is_causal=True, local_window_size=(2, 3))),
    "gqa_k2_causal": ((3, 5, 7, 6, 2, 11), dict(is_causal=True)),
    "gqa_k3_window": ((3, 7, 5, 6, 3, 11), dict(local_window_size=(1, 1))),
    "mqa": ((3, 5, 7, 6, 1, 11), {}),
    # S > 2 key blocks of 32: the online softmax rescales across blocks.
    "key_blocks": ((1, 9, 71, 3, 1, 5), {}),
    "key_blocks_window": ((1, 73, 71, 3, 1, 5), dict(is_causal=True, local_window_size=(40, 0))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name):
    shape, kw = CASES[name]
    _check(*_inputs(*shape), **kw)


@pytest.mark.parametrize(
    "shape, window",
    [((3, 7, 5, 6, 3, 11), (0, 0)), ((3, 9, 5, 6, 2, 11), (1, 0)), ((3, 7, 5, 9, 9, 11), (0, 3))],
)
def test_rows_without_keys_are_zero_with_zero_grads(shape, window):
    q, k, v = _inputs(*shape)
    t, s = shape[1], shape[2]
    empty = np.arange(t) >= s + window[0]  # top-left alignment: rows past S + left see nothing
    assert empty.any() and not empty.all()
    out, lse, (dq, _, _) = _check(q, k, v, local_window_size=window)
    assert not np.asarray(out)[:, empty].any()
    assert np.all(np.isneginf(np.asarray(lse)[:, empty]))
    assert not np.asarray(dq)[:, empty].any()
    assert np.isfinite(np.asarray(dq)).all()


def test_under_jit():
    q, k, v = _inputs(3, 5, 7, 6, 2, 11)
    kw = dict(is_causal=True, local_window_size=(2, 1))
    out = jax.jit(lambda q, k, v: ffi_attention(q, k, v, **kw))(q, k, v)
    ref_out, _, want = _results(jaxckpt.attention_reference, q, k, v, **kw)
    assert_close(out, ref_out, F32, "fwd", "out")
    got = jax.jit(lambda q, k, v: _grads(ffi_attention, q, k, v, **kw))(q, k, v)
    for name, g, r in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert_close(g, r, F32, "grad", name)


@pytest.mark.parametrize("vmap_method", ["broadcast_all", "sequential"])
@pytest.mark.parametrize("in_axes", [(0, 0, 0), (0, None, None)])
def test_under_vmap(vmap_method, in_axes):
    q, k, v = _inputs(3, 5, 7, 6, 3, 11)
    q = jnp.stack([q, 2 * q, -q, 0.5 * q, q + 1])  # a leading vmapped axis of 5
    if in_axes[1] == 0:
        k, v = jnp.stack([k, k[::-1]] * 2 + [k]), jnp.stack([v[::-1], v] * 2 + [v])
    kw = dict(is_causal=True, local_window_size=(3, 0))

    def run(fn):
        fwd = jax.vmap(lambda q, k, v: fn(q, k, v, **kw), in_axes=in_axes)
        loss = lambda q, k, v: (fwd(q, k, v) * jnp.cos(jnp.arange(11.0))[None, None, None, None]).sum()
        return jax.jit(lambda q, k, v: (fwd(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)))(q, k, v)

    out, grads = run(_ffi_out(vmap_method))
    ref_out, ref_grads = run(jaxckpt.attention_reference)
    assert out.shape == (5, 3, 5, 6, 11)
    assert_close(out, ref_out, F32, "fwd", "out")
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert_close(g, r, F32, "grad", name)


def test_low_precision_is_computed_in_float32():
    q, k, v = _inputs(3, 5, 7, 6, 2, 11, dtype=jnp.bfloat16)
    out, _, grads = _check(q, k, v, is_causal=True)
    assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)


def test_unbatched_inputs():
    q, k, v = (x[0] for x in _inputs(1, 5, 7, 6, 3, 11))
    out, lse, _ = _check(q, k, v, is_causal=True)
    assert out.shape == (5, 6, 11) and lse.shape == (5, 6)


def test_normalized_entry_point():
    q, k, v = _inputs(3, 7, 5, 6, 2, 11)
    out, lse = _ffi.ffi_attention_normalized(normalize(q, k, v, local_window_size=(2, 1)))
    ref_out, ref_lse = jaxckpt.attention_reference(q, k, v, local_window_size=(2, 1), return_residual=True)
    assert lse.shape == (3, 6, 7)  # [B, N, T], as jaxckpt's registry expects
    assert_close(out, ref_out, F32, "fwd", "out")
    assert_close(jnp.swapaxes(lse, 1, 2), ref_lse, F32, "fwd", "lse")
    with pytest.raises(NotImplementedError, match=r"\['mask'\]"):
        _ffi.ffi_attention_normalized(normalize(q, k, v, mask=jnp.ones((7, 5), bool)))


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(value=np.zeros((3, 5, 3, 11), np.float32)), ValueError, "key and value"),
        (
            dict(key=np.zeros((3, 7, 4, 11), np.float32), value=np.zeros((3, 7, 4, 11), np.float32)),
            ValueError,
            "multiple of the number of key",
        ),
        (dict(query=np.zeros((3, 5, 6, 11), np.int32)), TypeError, "query"),
        (dict(local_window_size=(-1, 2)), ValueError, "local_window_size"),
        (dict(local_window_size="wide"), TypeError, "local_window_size"),
        (dict(scale=float("nan")), ValueError, "scale"),
    ],
)
def test_argument_errors(change, error, match):
    q, k, v = _inputs(3, 5, 7, 6, 3, 11)
    args = dict(query=q, key=k, value=v) | change
    with pytest.raises(error, match=match):
        ffi_attention(**args)


def test_vmap_method_errors():
    q, k, v = _inputs(3, 5, 7, 6, 3, 11)
    with pytest.raises(ValueError, match="vmap_method"):
        _ffi.ffi_attention_normalized(normalize(q, k, v), vmap_method="expand_dims")


def test_is_causal_reaches_the_kernel_as_a_bool():
    """normalize turns a truthy is_causal into the C++ attribute's bool (was: a TypeError)."""
    q, k, v = _inputs(3, 5, 7, 6, 3, 11)
    want = ffi_attention(q, k, v, is_causal=True)
    for truthy in (1, np.bool_(True), jnp.array(True)):
        np.testing.assert_array_equal(ffi_attention(q, k, v, is_causal=truthy), want)


def test_features_outside_the_route_say_which():
    q, k, v = _inputs(3, 5, 7, 6, 3, 11)
    with pytest.raises(NotImplementedError, match="npu_ffi"):
        ffi_attention(q, k, v, mask=jnp.ones((5, 7), bool))


def test_handler_checks_shapes():
    q, k, v = _inputs(3, 5, 7, 6, 3, 11)
    wrong_lse = jax.ShapeDtypeStruct((3, 5, 6), F32)  # [B, T, N] instead of [B, N, T]
    call = jax.ffi.ffi_call(_ffi.FORWARD_TARGET, (jax.ShapeDtypeStruct(q.shape, F32), wrong_lse))
    attrs = dict(scale=np.float32(0.3), is_causal=False, window_left=np.int64(-1), window_right=np.int64(-1))
    with pytest.raises(Exception, match=r"lse must have shape \[3, 6, 5\]"):
        jax.block_until_ready(call(q, k, v, **attrs))


def test_handler_takes_scale_as_f32_or_f64():
    q, k, v = _inputs(3, 5, 7, 6, 3, 11)
    types = (jax.ShapeDtypeStruct(q.shape, F32), jax.ShapeDtypeStruct((3, 6, 5), F32))
    call = jax.ffi.ffi_call(_ffi.FORWARD_TARGET, types)
    attrs = dict(is_causal=True, window_left=np.int64(-1), window_right=np.int64(-1))
    out32, _ = call(q, k, v, scale=np.float32(0.25), **attrs)
    out64, _ = call(q, k, v, scale=np.float64(0.25), **attrs)
    np.testing.assert_array_equal(out32, out64)
    assert_close(out64, jaxckpt.attention_reference(q, k, v, scale=0.25, is_causal=True), F32, "fwd", "out")


def test_build_is_cached_and_reports_missing_compiler(monkeypatch, capsys):
    path = _ffi.build()
    assert path == _ffi.library_path() and path.parent.name == "build"
    stamp = path.stat().st_mtime_ns
    assert ffi_build.is_up_to_date() and _ffi.build().stat().st_mtime_ns == stamp  # no rebuild

    monkeypatch.setattr(ffi_build, "find_compiler", lambda: None)
    monkeypatch.setattr(ffi_build, "is_up_to_date", lambda: False)
    monkeypatch.setitem(_ffi._state, "lib", None)
    assert "no C++ compiler (g++)" in _ffi.unavailable()
    assert ffi_build.main([]) == 0 and "skipped: no C++ compiler" in capsys.readouterr().err
    assert ffi_build.main(["--strict"]) == 1


def test_ascend_kernel_is_compiled_only_with_cann(monkeypatch, tmp_path):
    monkeypatch.delenv("ASCEND_TOOLKIT_HOME", raising=False)
    args = ffi_build.compile_args(tmp_path / "lib.so")
    assert not any("kernel_ascend" in a for a in args) and "-DJAXCKPT_WITH_ASCEND" not in args
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(tmp_path))
    assert ffi_build.ascend_home() is None  # no include/ folder: not a CANN install
    (tmp_path / "include").mkdir()
    args = ffi_build.compile_args(tmp_path / "lib.so")
    assert "-DJAXCKPT_WITH_ASCEND" in args and any(a.endswith("kernel_ascend.cc") for a in args)
    assert "-lascendcl" in args
