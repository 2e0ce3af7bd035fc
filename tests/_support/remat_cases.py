"""A small odd-sized model and a loss, shared by the remat tests."""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxckpt import nn, train

# 5 layers, so ratio_0.5 / ratio_0.25 also exercise a shorter last segment.
CONFIG = nn.TransformerConfig.preset(
    "tiny", d_model=30, n_layers=5, n_heads=5, n_kv_heads=1, head_dim=6, ffn_dim=22, max_len=64
)
B, T = 3, 13


@functools.cache
def model(config: nn.TransformerConfig = CONFIG) -> nn.Transformer:
    """The model of ``config``, built once: its random init runs eagerly, op by op, and
    every test only reads it (splits it, traces it)."""
    return nn.Transformer(config, rngs=nnx.Rngs(0))


def tokens(batch: int = B, seq: int = T) -> jax.Array:
    return jax.random.randint(jax.random.key(1), (batch, seq + 1), 0, CONFIG.vocab_size)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _loss_and_grads(graphdef, params, rest, spec, toks):
    def loss(p):
        return train.next_token_loss(nnx.merge(graphdef, p, rest), toks, spec)

    return jax.value_and_grad(loss)(params)


def loss_and_grads(m: nn.Transformer, spec, toks: jax.Array):
    """Loss and parameter gradients of ``m`` on ``toks`` under remat ``spec``."""
    graphdef, params, rest = nnx.split(m, nnx.Param, ...)
    return _loss_and_grads(graphdef, params, rest, spec, toks)


def max_abs_diff(a, b) -> float:
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in pairs)
