"""The suite's own strictness is on: what conftest.py and pyproject.toml promise, checked."""

import os
import warnings

import jax
import jax.numpy as jnp
import pytest

from jaxckpt._warnings import JaxckptWarning


def test_a_jaxckpt_warning_fails_a_test():
    with pytest.raises(JaxckptWarning, match="unknown field"):
        warnings.warn("unknown field", JaxckptWarning, stacklevel=1)


def test_other_warnings_stay_warnings():
    with pytest.warns(DeprecationWarning):
        warnings.warn("someone else's", DeprecationWarning, stacklevel=1)


def test_implicit_dtype_promotion_raises():
    with pytest.raises(jax.dtypes.TypePromotionError, match="strict"):
        jnp.ones(3, jnp.bfloat16) + jnp.ones(3, jnp.float32)
    assert (jnp.ones(3, jnp.bfloat16) * 2).dtype == jnp.bfloat16  # weak Python scalars are fine


def test_implicit_rank_promotion_raises():
    with pytest.raises(ValueError, match="jax_numpy_rank_promotion"):
        jnp.ones((2, 3)) + jnp.ones(3)


def test_eight_cpu_devices_for_the_sharded_tests():
    assert len(jax.devices()) == 8


def test_tests_compile_with_the_cheap_xla_cpu_options():
    assert "--xla_backend_optimization_level=0" in os.environ["XLA_FLAGS"]
    assert "--xla_cpu_use_fusion_emitters=false" in os.environ["XLA_FLAGS"]
