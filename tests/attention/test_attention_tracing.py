"""JAX transformations of flash_attention: jit, vmap, grad, jvp, second derivatives.

jit, vmap and grad must work and agree with the untransformed call (and with the
reference). Forward mode and second derivatives of a ``custom_vjp`` either work,
and then match the reference, or raise an error a user can act on.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import Case, build, device, evaluate, normal, random_mask
from tolerances import assert_close

import jaxckpt

BLOCKS = jaxckpt.BlockSizes(16, 8)
CASE = Case(b=2, t=37, s=29, n=6, k=3, h=16, features=("bias",), variant=1, block=(16, 8))
CLEAR_ERROR = re.compile(r"custom_vjp|forward-mode|jvp|Reverse-mode|while_loop|fori_loop", re.I)


def _flash(q, k, v, bias=None, **kw):
    return jaxckpt.flash_attention(q, k, v, bias, is_causal=True, block_sizes=BLOCKS, **kw)


def _reference(q, k, v, bias=None, **kw):
    return jaxckpt.attention_reference(q, k, v, bias, is_causal=True, **kw)


def test_jit_matches_eager():
    inp = build(CASE)
    bias = inp.arrays["bias"]
    eager = _flash(inp.q, inp.k, inp.v, bias)
    jitted = jax.jit(_flash)(inp.q, inp.k, inp.v, bias)
    assert_close(jitted, eager, jnp.float32, "fwd", "jit vs eager")
    want = jax.jit(_reference)(inp.q, inp.k, inp.v, bias)
    assert_close(jitted, want, jnp.float32, "fwd", "jit vs reference")


@pytest.mark.slow
def test_grad_and_jit_grad_match_reference():
    inp = build(CASE)
    loss = lambda fn: lambda q, k, v, b: jnp.sum(fn(q, k, v, b) * inp.w)
    args = (inp.q, inp.k, inp.v, inp.arrays["bias"])
    eager = jax.grad(loss(_flash), argnums=(0, 1, 2, 3))(*args)
    jitted = jax.jit(jax.grad(loss(_flash), argnums=(0, 1, 2, 3)))(*args)
    want = jax.jit(jax.grad(loss(_reference), argnums=(0, 1, 2, 3)))(*args)
    for name, e, j, r in zip(("dq", "dk", "dv", "dbias"), eager, jitted, want, strict=True):
        assert_close(j, e, jnp.float32, "grad", f"{name}: jit(grad) vs grad")
        assert_close(e, r, jnp.float32, "grad", f"{name}: grad vs reference")


def _stacked_inputs(v_axis: int = 3):
    rng = np.random.default_rng(2)
    c = CASE
    q = normal(rng, (v_axis, c.b, c.t, c.n, c.h), jnp.float32)
    k = normal(rng, (v_axis, c.b, c.s, c.k, c.h), jnp.float32)
    v = normal(rng, (v_axis, c.b, c.s, c.k, c.h), jnp.float32)
    return q, k, v


@pytest.mark.slow
def test_vmap_over_an_extra_leading_axis():
    q, k, v = _stacked_inputs()
    bias = build(CASE).arrays["bias"]  # shared by every slice: in_axes None
    got = jax.jit(jax.vmap(_flash, in_axes=(0, 0, 0, None)))(q, k, v, bias)
    flash, ref = jax.jit(_flash), jax.jit(_reference)  # jit == eager is tested above
    for i in range(q.shape[0]):
        assert_close(got[i], flash(q[i], k[i], v[i], bias), jnp.float32, "fwd", f"vmap slice {i}")
        assert_close(got[i], ref(q[i], k[i], v[i], bias), jnp.float32, "fwd", f"vs ref {i}")
    loss = lambda fn: lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v, bias)))
    grads = jax.jit(jax.vmap(jax.grad(loss(_flash), argnums=(0, 1, 2))))(q, k, v)
    ref_grad = jax.jit(jax.grad(loss(_reference), argnums=(0, 1, 2)))
    for i in range(q.shape[0]):
        want = ref_grad(q[i], k[i], v[i])
        for name, g, r in zip(("dq", "dk", "dv"), grads, want, strict=True):
            assert_close(g[i], r, jnp.float32, "grad", f"vmap(grad) {name} slice {i}")


@pytest.mark.slow
def test_vmap_over_per_example_lengths_and_masks():
    q, k, v = _stacked_inputs()
    c, rng = CASE, np.random.default_rng(3)
    lengths = device([[c.t, 5], [0, 17], [30, c.t]], jnp.int32)  # [V, B]
    mask = device(random_mask(rng, (3, c.b, 1, c.t, c.s)))
    call = lambda fn: lambda q, k, v, lens, m: fn(q, k, v, mask=m, query_seq_lengths=lens)
    got = jax.jit(jax.vmap(call(_flash)))(q, k, v, lengths, mask)
    loss = lambda fn: lambda *a: jnp.sum(jnp.sin(call(fn)(*a)))
    grads = jax.jit(jax.vmap(jax.grad(loss(_flash))))(q, k, v, lengths, mask)
    ref, ref_grad = jax.jit(call(_reference)), jax.jit(jax.grad(loss(_reference)))
    for i in range(3):
        args = (q[i], k[i], v[i], lengths[i], mask[i])
        assert_close(got[i], ref(*args), jnp.float32, "fwd", f"vmap slice {i}")
        assert_close(grads[i], ref_grad(*args), jnp.float32, "grad", f"dq {i}")


def _works_or_explains(transform, check):
    """Runs ``transform()``; if it raises, the message must say what is unsupported.
    ``check`` computes its reference itself: it is compiled only when there is a result to
    compare with it (a transform that raises leaves nothing to compare)."""
    try:
        result = transform()
    except (TypeError, ValueError, NotImplementedError) as e:
        assert CLEAR_ERROR.search(str(e)), f"unclear error for an unsupported transform: {e!r}"
        return
    check(result)


def test_jvp_works_or_raises_a_clear_error():
    inp = build(CASE)
    bias, tangent = inp.arrays["bias"], inp.w
    fwd = lambda fn: lambda q: fn(q, inp.k, inp.v, bias)

    def check(result):
        want = jax.jit(lambda q, t: jax.jvp(fwd(_reference), (q,), (t,)))(inp.q, tangent)
        assert_close(result[0], want[0], jnp.float32, "fwd", "jvp primal")
        assert_close(result[1], want[1], jnp.float32, "grad", "jvp tangent")

    _works_or_explains(lambda: jax.jvp(fwd(_flash), (inp.q,), (tangent,)), check)


def _tiny():
    case = Case(b=1, t=5, s=7, n=2, k=1, h=8, features=("bias",), variant=1)
    inp = build(case)
    loss = lambda fn: lambda q: jnp.sum(jnp.sin(fn(q, inp.k, inp.v, inp.arrays["bias"])))
    return inp, loss


def test_hessian_works_or_raises_a_clear_error():
    inp, loss = _tiny()
    want = lambda: jax.jit(jax.hessian(loss(_reference)))(inp.q)
    check = lambda got: assert_close(got, want(), jnp.float32, "grad", "hessian wrt q")
    _works_or_explains(lambda: jax.jit(jax.hessian(loss(_flash)))(inp.q), check)


def test_grad_of_grad_works_or_raises_a_clear_error():
    inp, loss = _tiny()
    u = jnp.cos(inp.q)  # a fixed direction: d/dq <grad(loss)(q), u>
    second = lambda fn: jax.grad(lambda q: jnp.sum(jax.grad(loss(fn))(q) * u))
    want = lambda: jax.jit(second(_reference))(inp.q)
    check = lambda got: assert_close(got, want(), jnp.float32, "grad", "grad of grad")
    _works_or_explains(lambda: jax.jit(second(_flash))(inp.q), check)


@pytest.mark.parametrize("impl", jaxckpt.attention.available_implementations())
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_output_and_gradient_dtypes_follow_the_input(impl, dtype):
    case = Case(b=1, t=9, s=11, n=3, k=1, h=8, dtype=dtype, features=("bias",), block=(4, 8))
    if impl == "cudnn" and case.h % 8:
        pytest.skip("cuDNN needs H % 8 == 0")
    if "bias" not in jaxckpt.attention.implementations()[impl].supports:
        pytest.skip(f"{impl!r} does not support a bias")
    got = evaluate(jaxckpt.flash_attention, build(case), implementation=impl, block_sizes=BLOCKS)
    assert got.out.dtype == jnp.dtype(dtype)
    assert got.lse.dtype == jnp.float32
    assert {n: g.dtype for n, g in got.grads.items()} == dict.fromkeys(got.grads, jnp.dtype(dtype))
