"""BlockSizes: validation, clamping, and the automatic choice for many heads."""

import jax
import jax.numpy as jnp
import pytest

import jaxckpt
from jaxckpt.attention._block_sizes import MIN_AUTO_BLOCK, TILE_BUDGET_BYTES


@pytest.mark.parametrize("rows", [1, 8, 64, 65, 256, 4096, 10**6])
def test_auto_fits_the_tile_budget_or_stops_at_the_minimum(rows):
    bs = jaxckpt.BlockSizes.auto(rows)
    fits = rows * bs.block_q * bs.block_k * 4 <= TILE_BUDGET_BYTES
    assert fits or bs.block_q == bs.block_k == MIN_AUTO_BLOCK, bs
    assert bs.block_q <= jaxckpt.BlockSizes().block_q and bs.block_k <= jaxckpt.BlockSizes().block_k


def test_auto_keeps_the_defaults_up_to_256_rows():
    assert jaxckpt.BlockSizes.auto(8) == jaxckpt.BlockSizes.auto(256) == jaxckpt.BlockSizes()


def test_clamp_never_exceeds_the_sequence():
    assert jaxckpt.BlockSizes(512, 512).clamp(7, 300) == jaxckpt.BlockSizes(7, 300)


def _temp_bytes(block_sizes, b=16, n=64, t=1024, h=64):
    x = jax.ShapeDtypeStruct((b, t, n, h), jnp.float32)

    def loss(q, k, v):
        return jaxckpt.flash_attention(q, k, v, is_causal=True, block_sizes=block_sizes).sum()

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return step.lower(x, x, x).compile().memory_analysis().temp_size_in_bytes


def test_many_heads_get_smaller_tiles_and_less_memory():
    """B*N = 1024 rows: the automatic blocks use less temp memory than 512 x 512."""
    assert _temp_bytes(None) < _temp_bytes(jaxckpt.BlockSizes(512, 512))
