"""Dispatch: which implementation ``implementation=None`` picks, the one public signature
that every entry point is built from, and the registry's ``materializes_scores`` field."""

import inspect
import pydoc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxckpt
from jaxckpt.attention import _api, _registry, implementations, normalize, register_implementation
from jaxckpt.attention._reference import reference_normalized


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


def _gpu_inputs(h=16, dtype=jnp.bfloat16, **kwargs):
    q = jnp.ones((1, 7, 3, h), dtype)
    return normalize(q, q, q, **kwargs)


@pytest.mark.parametrize(
    ("inputs", "want"),
    [
        (dict(is_causal=True), "cudnn"),
        (dict(is_causal=True, local_window_size=(3, 0)), "cudnn"),
        (dict(logits_soft_cap=5.0), "pallas"),  # Gemma 2
        (dict(segment_ids=jnp.zeros((1, 7), jnp.int32)), "pallas"),  # packed fine-tuning
        (dict(local_window_size=(3, 2)), "pallas"),  # two-sided, not causal
        (dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)), "pallas"),
        (dict(dtype=jnp.float32), "pallas"),
        (dict(h=12), "pallas"),  # cuDNN needs H % 8 == 0
        (dict(h=192), "pallas"),  # and H <= 128
        (dict(h=264), "blockwise"),  # the Pallas kernel takes H <= 256
    ],
)
def test_gpu_dispatch_is_cudnn_then_pallas_then_blockwise(inputs, want):
    """A pure function of the call's features, with the real predicates, traced for a GPU."""
    inputs = dict(inputs)
    h, dtype = inputs.pop("h", 16), inputs.pop("dtype", jnp.bfloat16)
    with jaxckpt.attention.compiling_for("gpu"):
        assert _api._auto(_gpu_inputs(h, dtype, **inputs)) == want
    assert _api._auto(_gpu_inputs(h, dtype, **inputs)) == "blockwise"  # on this CPU


# --- the one signature ----------------------------------------------------------------------------

CONTRACT = (
    "query", "key", "value", "bias", "mask", "scale", "is_causal", "query_seq_lengths",
    "key_value_seq_lengths", "local_window_size", "segment_ids", "logits_soft_cap",
    "dropout_rate", "dropout_rng",
)  # fmt: skip
PUBLIC = (*CONTRACT, "block_sizes", "implementation", "return_residual")


@pytest.mark.parametrize("fn", [jaxckpt.flash_attention, jaxckpt.attention_reference])
def test_public_functions_show_the_contract_signature(fn):
    sig = inspect.signature(fn)
    assert tuple(sig.parameters) == PUBLIC
    kinds = [p.kind for p in sig.parameters.values()]
    assert kinds[:5] == [inspect.Parameter.POSITIONAL_OR_KEYWORD] * 5
    assert set(kinds[5:]) == {inspect.Parameter.KEYWORD_ONLY}
    defaults = {
        name: p.default for name, p in sig.parameters.items() if name not in ("query", "key", "value")
    }
    assert defaults["is_causal"] is False and defaults["dropout_rate"] == 0.0
    assert defaults["return_residual"] is False and defaults["implementation"] is None
    assert "Example:" in fn.__doc__ and fn.__name__ in pydoc.render_doc(fn)


def test_the_contract_is_written_once_in_normalize():
    """flash_attention and attention_reference are built from normalize's signature."""
    assert tuple(inspect.signature(normalize).parameters) == CONTRACT
    assert inspect.signature(jaxckpt.flash_attention) == inspect.signature(jaxckpt.attention_reference)


def test_unknown_or_missing_arguments_name_the_function():
    q = jnp.ones((1, 7, 3, 16))
    with pytest.raises(TypeError, match=r"flash_attention\(\).*causal"):
        jaxckpt.flash_attention(q, q, q, causal=True)
    with pytest.raises(TypeError, match=r"attention_reference\(\).*value"):
        jaxckpt.attention_reference(q, q)
    with pytest.raises(TypeError, match=r"flash_attention\(\)"):
        jaxckpt.flash_attention(q, q, q, None, None, 0.5)  # scale is keyword-only, as in jax.nn


def test_positional_bias_and_mask_and_jit_static_argnames():
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 7, 3, 16)), jnp.float32)
    bias, mask = jnp.zeros((7, 7)), jnp.tril(jnp.ones((7, 7), bool))
    # The expectation under jit: op-by-op it dispatched a program per op (eager == jit is
    # tested in test_attention_tracing.py).
    want = jax.jit(jaxckpt.attention_reference, static_argnames=("is_causal",))(q, q, q, is_causal=True)
    got = jax.jit(jaxckpt.flash_attention, static_argnames=("is_causal",))(
        q, q, q, bias, mask, is_causal=True
    )
    np.testing.assert_allclose(got, want, atol=2e-5)


# --- the registry says which implementations materialise the scores -----------------------------


def test_materializes_scores_field():
    impls = implementations()
    assert impls["reference"].materializes_scores and impls["xla"].materializes_scores
    assert not impls["blockwise"].materializes_scores and not impls["cudnn"].materializes_scores
    register_implementation("_naive_test", lambda p, bs: reference_normalized(p), materializes_scores=True)
    try:
        assert implementations()["_naive_test"].materializes_scores
    finally:
        _registry._REGISTRY.pop("_naive_test")
    register_implementation("_flash_test", lambda p, bs: reference_normalized(p))
    try:
        assert not implementations()["_flash_test"].materializes_scores  # the default: O(T)
    finally:
        _registry._REGISTRY.pop("_flash_test")
