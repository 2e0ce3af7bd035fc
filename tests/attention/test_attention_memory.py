"""flash_attention's training step needs O(T) temporary memory, not O(T * S).

Measured the house way: ``jit(grad(loss)).lower(...).compile().memory_analysis()
.temp_size_in_bytes``, on ``jax.ShapeDtypeStruct`` inputs so that nothing big is
ever allocated (only compiled).
"""

import functools

import jax
import jax.numpy as jnp
import pytest

import jaxckpt

B, N, H = 1, 2, 64


def _temp_bytes(attention, t: int, **kwargs) -> int:
    spec = jax.ShapeDtypeStruct((B, t, N, H), jnp.float32)

    def loss(q, k, v, w):
        return jnp.sum(attention(q, k, v, **kwargs) * w)

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(spec, spec, spec, spec).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@functools.cache
def _flash_temp(t: int, is_causal: bool) -> int:
    return _temp_bytes(jaxckpt.flash_attention, t, is_causal=is_causal, implementation="blockwise")


@pytest.mark.slow
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_flash_temp_memory_grows_linearly(is_causal):
    temps = {t: _flash_temp(t, is_causal) for t in (2048, 4096, 8192)}
    for t in (2048, 4096):
        ratio = temps[2 * t] / temps[t]
        assert ratio <= 2.3, f"temp bytes {temps}: T={t}->{2 * t} grew {ratio:.2f}x (O(T) allows 2x)"


@pytest.mark.slow
def test_flash_temp_memory_is_far_below_jax_nn():
    flash = _flash_temp(4096, False)
    xla = _temp_bytes(functools.partial(jax.nn.dot_product_attention, implementation="xla"), 4096)
    assert flash * 12 < xla, f"flash temp {flash:,} B vs jax.nn xla temp {xla:,} B at T=4096"
