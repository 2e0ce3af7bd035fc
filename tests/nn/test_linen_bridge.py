"""Serving the NNX ``Transformer`` to Flax Linen code with ``flax.nnx.bridge``.

``bridge.to_linen`` takes the NNX *class* and its constructor arguments (never an
instance) and returns a ``linen.Module``::

    import jax
    from flax.nnx import bridge
    from jaxckpt.nn import Transformer, TransformerConfig

    cfg = TransformerConfig.preset("tiny", n_layers=2)
    tokens = jax.numpy.zeros((2, 8), jax.numpy.int32)
    lm = bridge.to_linen(Transformer, cfg)                    # a linen.Module
    variables = jax.jit(lm.init)(jax.random.key(0), tokens)  # {"params": {...}}
    logits = jax.jit(lm.apply)(variables, tokens)             # [B, T, V]
    logits = lm.apply(variables, tokens, remat="none")        # call keywords pass through

What to know:

- Do not pass ``rngs=``: ``ToLinen`` builds ``Transformer(cfg, rngs=nnx.Rngs(params=...))``
  from Linen's own ``"params"`` stream, so the weights are not those of
  ``Transformer(cfg, rngs=nnx.Rngs(0))`` even for ``jax.random.key(0)``.
- ``init`` returns each parameter boxed in an ``NNXMeta`` that carries its logical axis
  names (``logical_axes``, the names ``jaxckpt.train`` shards by). ``linen.meta.unbox``
  gives plain arrays: exactly ``nnx.to_pure_dict(nnx.state(model, nnx.Param))`` (the block
  stack with its leading layer axis), so weights move freely both ways:
  ``lm.apply({"params": ...}, tokens)`` serves a trained NNX model, and
  ``nnx.update(model, variables["params"])`` brings Linen-trained weights back.
- ``apply`` rebuilds the NNX module (initialising it with ``nnx.Rngs(default=0)``) and
  overwrites its weights: jit it, so XLA drops that throwaway initialisation.
- Inside a ``@linen.compact`` module, ``bridge.to_linen(Transformer, cfg, name="lm")(tokens)``
  makes the transformer a submodule, with its parameters under ``params["lm"]``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx
from flax.nnx import bridge
from tolerances import assert_close

from jaxckpt.nn import Transformer, TransformerConfig

# Odd, pairwise-distinct sizes; n_kv_heads=1 is GQA.
CFG = TransformerConfig.preset(
    "tiny", vocab_size=37, d_model=15, n_layers=3, n_heads=5, n_kv_heads=1, head_dim=4, ffn_dim=11, max_len=13
)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 7)), jnp.int32)


def loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Next-token cross-entropy."""
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()


@nnx.jit
def nnx_logits(model: Transformer, tokens: jax.Array) -> jax.Array:
    return model(tokens)


@pytest.fixture(scope="module")
def lm() -> linen.Module:
    return bridge.to_linen(Transformer, CFG)


@pytest.fixture(scope="module")
def boxed(lm):
    return jax.jit(lm.init)(jax.random.key(0), TOKENS)


@pytest.fixture(scope="module")
def variables(boxed):
    return linen.meta.unbox(boxed)


def test_init_boxes_carry_the_logical_axes(boxed):
    kernel = boxed["params"]["blocks"]["attn"]["q_proj"]["kernel"]
    assert isinstance(kernel, bridge.NNXMeta)
    assert kernel.metadata["logical_axes"] == ("embed", "heads")  # the layer axis added by the stack


def test_linen_init_and_apply(lm, variables):
    assert set(variables) == {"params"}
    params = variables["params"]
    assert params["embed"]["embedding"].shape == (CFG.vocab_size, CFG.d_model)
    assert params["blocks"]["attn"]["q_proj"]["kernel"].shape == (CFG.n_layers, CFG.d_model, 5 * 4)
    apply = jax.jit(lm.apply)
    logits = apply(variables, TOKENS)
    assert logits.shape == (*TOKENS.shape, CFG.vocab_size) and logits.dtype == jnp.float32
    np.testing.assert_array_equal(apply(variables, TOKENS), logits)  # deterministic
    # keywords of Transformer.__call__ pass through apply
    none = jax.jit(lambda v, t: lm.apply(v, t, remat="none"))(variables, TOKENS)
    np.testing.assert_allclose(none, logits, rtol=1e-6, atol=1e-6)


def test_linen_params_drive_the_nnx_model(lm, variables):
    """Linen-initialised (or Linen-trained) weights, loaded back into an NNX model."""
    model = nnx.eval_shape(lambda: Transformer(CFG, rngs=nnx.Rngs(0)))  # structure only
    nnx.update(model, variables["params"])
    np.testing.assert_array_equal(nnx_logits(model, TOKENS), jax.jit(lm.apply)(variables, TOKENS))


@pytest.mark.slow
def test_nnx_model_served_to_linen(lm):
    """A (trained) NNX model's weights, served through the Linen interface."""
    model = nnx.jit(lambda: Transformer(CFG, rngs=nnx.Rngs(0)))()
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    np.testing.assert_array_equal(jax.jit(lm.apply)({"params": params}, TOKENS), nnx_logits(model, TOKENS))


@pytest.mark.slow
def test_gradients_match_nnx(lm, variables):
    grads = jax.jit(jax.grad(lambda p: loss(lm.apply({"params": p}, TOKENS), TOKENS)))(variables["params"])
    leaves = jax.tree.leaves(grads)
    assert all(np.isfinite(g).all() for g in leaves) and any(np.abs(g).max() > 0 for g in leaves)

    model = nnx.eval_shape(lambda: Transformer(CFG, rngs=nnx.Rngs(0)))
    nnx.update(model, variables["params"])
    expected = nnx.to_pure_dict(nnx.jit(nnx.grad(lambda m: loss(m(TOKENS), TOKENS)))(model))
    assert jax.tree.structure(grads) == jax.tree.structure(expected)
    for (path, g), e in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(expected), strict=True):
        assert_close(g, e, jnp.float32, kind="grad", name=jax.tree_util.keystr(path))


class TemperatureLM(linen.Module):
    """A Linen model that uses the NNX transformer as a submodule."""

    cfg: TransformerConfig

    @linen.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        logits = bridge.to_linen(Transformer, self.cfg, name="lm")(tokens)
        temperature = self.param("temperature", linen.initializers.ones, ())
        return logits / temperature


def test_as_a_linen_submodule(variables):
    shapes = linen.meta.unbox(jax.eval_shape(TemperatureLM(CFG).init, jax.random.key(0), TOKENS))["params"]
    assert set(shapes) == {"lm", "temperature"}
    nnx_shapes = jax.tree.map(lambda a: (a.shape, a.dtype), variables["params"])
    assert jax.tree.map(lambda a: (a.shape, a.dtype), shapes["lm"]) == nnx_shapes
