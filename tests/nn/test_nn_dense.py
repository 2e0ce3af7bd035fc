"""``dense_dot_general``: the dense projection's matmul equals ``lax.dot_general``, values and
gradients, and keeps what ``RematSpec(save_dots=True)`` saves."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

from jaxckpt import nn, remat
from jaxckpt.nn._dense import dense_dot_general

DN = (((2,), (0,)), ((), ()))


def _loss(dot):
    return lambda x, k: jnp.sum(jnp.sin(dot(x, k, DN)))


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_values_and_gradients_equal_lax(dtype, tol):
    x = jax.random.normal(jax.random.key(0), (3, 5, 7), dtype)
    k = jax.random.normal(jax.random.key(1), (7, 11), dtype)
    np.testing.assert_allclose(
        np.asarray(dense_dot_general(x, k, DN), np.float32), np.asarray(lax.dot_general(x, k, DN), np.float32)
    )
    ours = jax.grad(_loss(dense_dot_general), (0, 1))(x, k)
    theirs = jax.grad(_loss(lax.dot_general), (0, 1))(x, k)
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == b.dtype == dtype
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol)


def test_other_calls_are_lax_dot_general():
    x, k = jnp.ones((2, 3, 4)), jnp.ones((4, 5))
    # A result type asked for: the plain dot_general, untagged.
    jaxpr = jax.make_jaxpr(lambda x, k: dense_dot_general(x, k, DN, preferred_element_type=jnp.float32))(x, k)
    assert [e.primitive.name for e in jaxpr.eqns] == ["dot_general"]
    batched = (((2,), (1,)), ((0,), (0,)))
    np.testing.assert_array_equal(
        dense_dot_general(x, jnp.ones((2, 4, 5)), batched), lax.dot_general(x, jnp.ones((2, 4, 5)), batched)
    )


@pytest.mark.slow
def test_dots_preset_saves_the_projections():
    cfg = nn.TransformerConfig.preset("tiny", n_layers=1)
    model = nn.Transformer(cfg, rngs=nnx.Rngs(0))
    report = remat.describe(model, (2, 9), "dots")
    assert remat.Tag.LINEAR_OUT in report.tags
    assert remat.Tag.LINEAR_OUT not in remat.describe(model, (2, 9), "full").tags
