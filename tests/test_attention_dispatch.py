"""``implementation=None``: which implementation the automatic choice picks."""

import jax.numpy as jnp
import pytest

from jaxckpt.attention import _api, normalize


def _inputs(**kwargs):
    q = jnp.ones((1, 7, 3, 16), jnp.bfloat16)
    return normalize(q, q, q, **kwargs)


def test_auto_is_blockwise_on_cpu():
    assert _api._auto(_inputs(is_causal=True)) == "blockwise"


@pytest.fixture
def cudnn_accepts(monkeypatch):
    """Pretend to be on a GPU where cuDNN's shape and dtype constraints hold."""
    monkeypatch.setattr(_api, "cudnn_fits", lambda p: True)


def test_auto_prefers_cudnn_where_it_supports_the_call(cudnn_accepts):
    assert _api._auto(_inputs(is_causal=True)) == "cudnn"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"segment_ids": jnp.zeros((1, 7), jnp.int32)},
        {"logits_soft_cap": 5.0},
    ],
)
def test_auto_falls_to_blockwise_for_features_cudnn_lacks(cudnn_accepts, kwargs):
    assert _api._auto(_inputs(**kwargs)) == "blockwise"
