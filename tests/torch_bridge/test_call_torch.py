"""torch_bridge.call_torch: torch functions under jax.jit, jax.vmap and jax.grad."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch_bridge.interop._call_torch import VMAP_METHODS, call_torch  # noqa: E402

pytestmark = pytest.mark.torch

TOL = {"rtol": 1e-6, "atol": 1e-6}  # float32: torch and XLA sin/cos agree to ~1 ulp


def _xy(shape=(3, 5)):
    kx, ky = jax.random.split(jax.random.key(7))
    return jax.random.normal(kx, shape), jax.random.normal(ky, shape)


def _sin_times(x, y):
    return torch.sin(x) * y


def _sin_times_jax(x, y):
    return jnp.sin(x) * y


SIN_TIMES = call_torch(_sin_times, lambda x, y: x)


def test_forward_eager_and_jit_match_jax():
    x, y = _xy()
    expected = _sin_times_jax(x, y)
    np.testing.assert_allclose(SIN_TIMES(x, y), expected, **TOL)
    np.testing.assert_allclose(jax.jit(SIN_TIMES)(x, y), expected, **TOL)


def test_grad_matches_pure_jax():
    x, y = _xy()
    loss = lambda f: lambda x, y: jnp.sum(f(x, y) ** 2)
    got = jax.grad(loss(SIN_TIMES), argnums=(0, 1))(x, y)
    want = jax.grad(loss(_sin_times_jax), argnums=(0, 1))(x, y)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, **TOL)


def test_jit_of_grad_matches_pure_jax():
    x, y = _xy((7,))
    loss = lambda f: lambda x, y: jnp.sum(f(x, y) * jnp.arange(7.0))
    got = jax.jit(jax.value_and_grad(loss(SIN_TIMES), argnums=(0, 1)))(x, y)
    want = jax.value_and_grad(loss(_sin_times_jax), argnums=(0, 1))(x, y)
    np.testing.assert_allclose(got[0], want[0], **TOL)
    for g, w in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(g, w, **TOL)


def test_pytree_inputs_and_outputs():
    def fn(d):
        return {"prod": torch.sin(d["x"]) * d["y"], "stats": (d["x"].sum(), d["x"] > 0)}

    def fn_jax(d):
        return {"prod": jnp.sin(d["x"]) * d["y"], "stats": (d["x"].sum(), d["x"] > 0)}

    x, y = _xy((5,))
    out_avals = {
        "prod": jax.ShapeDtypeStruct((5,), jnp.float32),
        "stats": (jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((5,), jnp.bool_)),
    }
    f = call_torch(fn, out_avals)
    got, want = jax.jit(f)({"x": x, "y": y}), fn_jax({"x": x, "y": y})
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, **TOL), got, want)

    def loss(f):
        return lambda d: jnp.sum(f(d)["prod"]) + 3 * f(d)["stats"][0]

    jax.tree.map(
        lambda g, w: np.testing.assert_allclose(g, w, **TOL),
        jax.grad(loss(f))({"x": x, "y": y}),
        jax.grad(loss(fn_jax))({"x": x, "y": y}),
    )


@pytest.mark.parametrize("vmap_method", VMAP_METHODS)
def test_vmap_forward_and_grads(vmap_method):
    f = call_torch(_sin_times, lambda x, y: x, vmap_method=vmap_method)
    xs, _ = _xy((7, 5))
    _, y = _xy((5,))
    axes = (0, None)
    np.testing.assert_allclose(
        jax.jit(jax.vmap(f, axes))(xs, y), jax.vmap(_sin_times_jax, axes)(xs, y), **TOL
    )
    per_example = lambda g: jax.vmap(jax.grad(lambda x, y: g(x, y).sum(), argnums=(0, 1)), axes)
    for got, want in zip(per_example(f)(xs, y), per_example(_sin_times_jax)(xs, y), strict=True):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, **TOL)
    summed = lambda g: jax.grad(lambda y: jax.vmap(g, axes)(xs, y).sum())
    np.testing.assert_allclose(summed(f)(y), summed(_sin_times_jax)(y), **TOL)


@pytest.mark.parametrize(
    ("vmap_method", "calls"), [("sequential", 7), ("expand_dims", 1), ("broadcast_all", 1)]
)
def test_vmap_method_decides_how_often_fn_runs(vmap_method, calls):
    shapes = []

    def fn(x, y):
        shapes.append((tuple(x.shape), tuple(y.shape)))
        return x * y

    f = call_torch(fn, lambda x, y: x, vmap_method=vmap_method)
    jax.block_until_ready(jax.vmap(f, (0, None))(jnp.ones((7, 3)), jnp.ones(3)))
    assert len(shapes) == calls
    expected = {
        "sequential": ((3,), (3,)),
        "expand_dims": ((7, 3), (1, 3)),
        "broadcast_all": ((7, 3), (7, 3)),
    }
    assert shapes[0] == expected[vmap_method]


def test_integer_inputs_get_float0_and_unused_inputs_get_zeros():
    f = call_torch(lambda x, n, unused: x * n, lambda x, n, unused: x)
    x, unused = _xy((5,))
    n = jnp.arange(5, dtype=jnp.int32)
    out, vjp = jax.vjp(f, x, n, unused)
    gx, gn, gu = vjp(jnp.ones_like(out))
    np.testing.assert_array_equal(gx, n.astype(jnp.float32))
    assert gn.dtype == jax.dtypes.float0 and gn.shape == (5,)
    np.testing.assert_array_equal(gu, jnp.zeros(5))


def test_outputs_that_autograd_cannot_reach_give_zero_grads():
    f = call_torch(
        lambda x: (torch.ones(3), torch.argmax(x).int()), lambda x: (x, jax.ShapeDtypeStruct((), jnp.int32))
    )
    np.testing.assert_array_equal(jax.grad(lambda x: f(x)[0].sum())(jnp.ones(3)), jnp.zeros(3))


def test_bfloat16_forward_and_grad():
    x = jnp.linspace(-2.0, 2.0, 7, dtype=jnp.bfloat16)
    f = call_torch(torch.sin, lambda x: x)
    np.testing.assert_allclose(f(x).astype(jnp.float32), jnp.sin(x).astype(jnp.float32), rtol=1e-2)
    g = jax.grad(lambda x: f(x).astype(jnp.float32).sum())(x)
    assert g.dtype == jnp.bfloat16
    np.testing.assert_allclose(g.astype(jnp.float32), jnp.cos(x).astype(jnp.float32), rtol=1e-2, atol=1e-2)


def _runtime_error(f, *args, match):
    with pytest.raises(jax.errors.JaxRuntimeError, match=match):
        jax.block_until_ready(jax.jit(f)(*args))


def test_shape_mismatch_is_named():
    f = call_torch(lambda x: x[:2], lambda x: x)
    _runtime_error(f, jnp.ones(3), match=r"fn's output has shape \(2,\), out_shape_dtypes says \(3,\)")


def test_dtype_and_structure_mismatches_are_named():
    f = call_torch(lambda x: x.int(), lambda x: x)
    _runtime_error(f, jnp.ones(3), match=r"fn's output has dtype torch.int32, out_shape_dtypes says float32")
    g = call_torch(lambda x: (x, x), {"a": jax.ShapeDtypeStruct((3,), jnp.float32)})
    _runtime_error(g, jnp.ones(3), match="fn returned the structure")


def test_in_place_modification_of_an_input_is_an_error():
    f = call_torch(lambda x: x.add_(1), lambda x: x)
    _runtime_error(f, jnp.ones(3), match=r"fn modified args\[0\] in place")


def test_bad_vmap_method_lists_the_allowed_values():
    with pytest.raises(ValueError, match=r"vmap_method must be one of \('sequential'.*got 'vectorized'"):
        call_torch(torch.sin, lambda x: x, vmap_method="vectorized")


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="fn must be callable"):
        call_torch("sin", lambda x: x)
    with pytest.raises(TypeError, match=r"out_shape_dtypes\[0\] must be a jax.ShapeDtypeStruct"):
        call_torch(torch.sin, [3])(jnp.ones(3))
    with pytest.raises(ValueError, match=r"out_shape_dtypes\[1\] has dtype int64.*jax_enable_x64"):
        call_torch(torch.sin, (jax.ShapeDtypeStruct((3,), jnp.float32), jax.ShapeDtypeStruct((), jnp.int64)))(
            jnp.ones(3)
        )
    with pytest.raises(TypeError, match=r"out_shape_dtypes has dtype int4, which torch cannot exchange"):
        call_torch(torch.sin, jax.ShapeDtypeStruct((3,), jnp.int4))(jnp.ones(3))
    with pytest.raises(ValueError, match="out_shape_dtypes has no leaves"):
        call_torch(torch.sin, ())(jnp.ones(3))
    with pytest.raises(TypeError, match=r"args\[1\] is a torch.Tensor"):
        SIN_TIMES(jnp.ones(3), torch.ones(3))
    with pytest.raises(TypeError, match=r"args\[0\]\['x'\] must be an array, got str"):
        call_torch(lambda d: d["x"], lambda d: d)({"x": "text"})


def test_complex_inputs_have_no_gradient():
    f = call_torch(lambda z, x: z.real * x, lambda z, x: x)
    z, x = jnp.ones(3, jnp.complex64), jnp.ones(3)
    np.testing.assert_array_equal(f(z, x), x)
    with pytest.raises(TypeError, match=r"complex input args\[0\]"):
        jax.grad(lambda x: f(z, x).sum())(x)


def test_second_order_is_not_supported():
    f = call_torch(torch.sin, lambda x: x)
    with pytest.raises(ValueError, match="do not support JVP"):
        jax.grad(jax.grad(lambda x: f(x).sum()))(1.0)
