"""``Transformer`` on packed rows (segment ids, positions restarting per document) and with a
KV cache: both must equal the plain forward of each document alone, in fp32, for every
position scheme (RoPE, partial rotary, learned positions, NoPE layers, sliding windows)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxckpt import nn

SIZES = dict(d_model=24, n_heads=3, n_kv_heads=1, head_dim=10, ffn_dim=40, vocab_size=67, max_len=32)

CASES = {
    "llama": ("tiny", dict(n_layers=2)),
    "gpt2": ("gpt2", dict(n_layers=2, n_kv_heads=3)),  # learned positions
    "gemma2": ("gemma2-2b", dict(n_layers=2, sliding_window=4)),  # windows, soft caps, post norms
    "gemma3": ("gemma3-1b", dict(n_layers=3, sliding_window=3)),  # pattern, local RoPE base
    "phi3": ("phi3-mini", dict(n_layers=2, rotary_fraction=0.4, sliding_window=5, n_kv_heads=3)),
    "smollm3": ("tiny", dict(family="smollm3", n_layers=2, layer_pattern=("full", "full_nope"))),
}
CASE_PARAMS = [
    pytest.param(case, marks=pytest.mark.slow) if case == "gemma2" else case for case in sorted(CASES)
]
"""The cases as test parameters: Gemma 2's two tests take 2 s or more with the compile cache warm."""


def _model(case: str) -> nn.Transformer:
    preset, overrides = CASES[case]
    cfg = nn.TransformerConfig.preset(preset, **{**SIZES, **overrides, "dtype": "float32"})
    return nn.Transformer(cfg.replace(param_dtype="float32"), rngs=nnx.Rngs(3))


REMAT = "none"  # the calls without a cache run eagerly: no remat to trace


def _docs(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.integers(0, SIZES["vocab_size"], (1, n)), jnp.int32) for n in lengths]


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_packed_row_equals_each_document_alone(case):
    model = _model(case)
    lengths = (5, 7, 3)
    docs = _docs(lengths)
    pad = 4
    tokens = jnp.concatenate([*docs, jnp.zeros((1, pad), jnp.int32)], axis=1)
    segments = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] + [np.zeros(pad)])
    positions = np.concatenate([np.arange(n) for n in lengths] + [np.zeros(pad)])
    packed = model(
        tokens,
        segment_ids=jnp.asarray(segments[None], jnp.int32),
        positions=jnp.asarray(positions[None], jnp.int32),
        remat=REMAT,
    )
    start = 0
    for doc, n in zip(docs, lengths, strict=True):
        alone = model(doc, remat=REMAT)
        np.testing.assert_allclose(packed[:, start : start + n], alone, atol=1e-5, rtol=1e-5)
        start += n


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_prefill_and_decode_equal_the_full_forward(case):
    model = _model(case)
    (tokens,) = _docs((9,), seed=1)
    full = model(tokens, remat=REMAT)
    cache = model.init_cache(1, 12)
    prefill, cache = model(tokens[:, :4], cache=cache)
    steps = [prefill]
    for i in range(4, 9):
        logits, cache = model(tokens[:, i : i + 1], cache=cache)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=1e-5, rtol=1e-5)
    assert int(cache.start) == 9


def test_decode_step_is_one_compiled_function_of_the_cache():
    model = _model("llama")
    graphdef, state = nnx.split(model)

    @jax.jit
    def decode(state, token, cache):
        return nnx.merge(graphdef, state)(token, cache=cache)

    cache = model.init_cache(1, 8)
    for i in range(3):
        _, cache = decode(state, jnp.full((1, 1), i, jnp.int32), cache)
    assert decode._cache_size() == 1


def test_bad_positions_and_cache_arguments_are_named():
    model = _model("llama")
    tokens = jnp.zeros((1, 5), jnp.int32)
    with pytest.raises(ValueError, match="positions must be an integer array shaped like tokens"):
        model(tokens, positions=jnp.zeros((1, 4), jnp.int32))
    with pytest.raises(ValueError, match="segment_ids must be"):
        model(tokens, segment_ids=jnp.zeros((1, 5)))
    with pytest.raises(ValueError, match=r"init_cache: max_len=40 exceeds config\.max_len=32"):
        model.init_cache(1, 40)
    with pytest.raises(ValueError, match="with a cache"):
        model(tokens, segment_ids=jnp.ones((1, 5), jnp.int32), cache=model.init_cache(1, 8))
