"""``jaxckpt.generate`` at the level of ids: greedy decoding through the KV cache equals the
argmax of the plain forward and, for every family ``load_hf`` reads, transformers'
``generate(do_sample=False)`` token for token; the sampling warpers equal transformers'; the
sampling knobs, finish reasons, length limits and argument errors.

The torch tests (marked) build their models in a module fixture, each family once.
"""

import importlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxckpt
from jaxckpt import data, nn
from jaxckpt.generate import Generation, Knobs, Sampling, _decode, _load, generate, warp_logits

SIZES = dict(d_model=24, n_heads=3, n_kv_heads=1, head_dim=10, ffn_dim=40, vocab_size=67, max_len=32)
PROMPT = [5, 61, 17, 3, 44]
NEW = 9


def _model(preset: str = "tiny", **overrides) -> nn.Transformer:
    cfg = nn.TransformerConfig.preset(preset, **{**SIZES, "n_layers": 2, **overrides})
    return nn.Transformer(cfg, rngs=nnx.Rngs(3))


@pytest.fixture(scope="module")
def llama():
    return _model()


@pytest.fixture(scope="module")
def greedy(llama):
    return generate(llama, PROMPT, max_new_tokens=NEW)


def _full_forward_argmax(model, prompt, new):
    """The argmax after each prefix of ``prompt + new[:-1]``, in one plain forward (greedy
    decoding gives ``new`` exactly when this equals it)."""
    ids = jnp.asarray([list(prompt) + list(new[:-1])], jnp.int32)
    logits = nnx.jit(lambda model, ids: model(ids, remat="none"))(model, ids)
    return np.asarray(jnp.argmax(logits[0, len(prompt) - 1 :], axis=-1)).tolist()


def test_greedy_equals_the_argmax_of_the_full_forward(llama, greedy):
    assert greedy.new_token_ids == _full_forward_argmax(llama, PROMPT, greedy.new_token_ids)
    assert greedy.finish_reason == "length" and greedy.completion is None
    assert greedy.prompt == PROMPT and len(greedy.new_token_ids) == NEW


def test_greedy_with_learned_positions_equals_the_full_forward():
    model = _model("gpt2", n_kv_heads=3)  # the padded prefill must not move the positions
    g = generate(model, PROMPT[:3], max_new_tokens=5)
    assert g.new_token_ids == _full_forward_argmax(model, PROMPT[:3], g.new_token_ids)


def test_temperature_zero_is_greedy_whatever_top_k_and_top_p(llama, greedy):
    g = generate(llama, PROMPT, max_new_tokens=NEW, temperature=0.0, top_k=3, top_p=0.5, seed=9)
    assert g.new_token_ids == greedy.new_token_ids


def test_top_k_1_sampling_is_greedy(llama, greedy):
    g = generate(llama, PROMPT, max_new_tokens=NEW, temperature=1.3, top_k=1, seed=4)
    assert g.new_token_ids == greedy.new_token_ids


def test_sampling_is_reproducible_with_a_seed(llama, greedy):
    run = lambda seed: generate(llama, PROMPT, max_new_tokens=NEW, temperature=2.0, top_p=0.95, seed=seed)
    first, again, other = run(7), run(7), run(8)
    assert first == again
    assert first.new_token_ids != other.new_token_ids
    assert first.new_token_ids != greedy.new_token_ids


def test_a_stop_id_ends_generation_with_it(llama, greedy):
    stop = greedy.new_token_ids[3]
    end = greedy.new_token_ids.index(stop) + 1
    g = generate(llama, PROMPT, max_new_tokens=NEW, stop_ids=[stop, 66])
    assert g.finish_reason == "eos"
    assert g.new_token_ids == greedy.new_token_ids[:end]


def test_a_stop_id_as_the_first_new_token(llama, greedy):
    g = generate(llama, PROMPT, max_new_tokens=NEW, stop_ids=[greedy.new_token_ids[0]])
    assert (g.new_token_ids, g.finish_reason) == (greedy.new_token_ids[:1], "eos")


def test_one_new_token(llama, greedy):
    g = generate(llama, PROMPT, max_new_tokens=1)
    assert (g.new_token_ids, g.finish_reason) == (greedy.new_token_ids[:1], "length")


def test_prompts_in_one_bucket_share_the_compiled_prefill_and_decode(llama):
    generate(llama, PROMPT[:3], max_new_tokens=4)
    sizes = _decode._prefill._cache_size(), _decode._decode._cache_size()
    generate(llama, PROMPT, max_new_tokens=6)
    generate(llama, PROMPT[:4], max_new_tokens=2)
    assert (_decode._prefill._cache_size(), _decode._decode._cache_size()) == sizes


def test_buckets():
    assert [_decode.bucket(n, 32) for n in (1, 16, 17, 31, 32)] == [16, 16, 32, 32, 32]
    assert _decode.bucket(20, 20) == 20


def test_a_prompt_longer_than_max_len_is_refused(llama):
    with pytest.raises(ValueError, match=r"^prompt of 33 tokens is longer than the model's max_len=32$"):
        generate(llama, [1] * 33)


def test_a_prompt_and_new_tokens_beyond_max_len_are_refused(llama):
    with pytest.raises(ValueError, match=r"prompt of 30 tokens \+ max_new_tokens=5 .* max_len=32: at most 2"):
        generate(llama, [1] * 30, max_new_tokens=5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(temperature=-0.5), r"temperature=-0\.5 must be a number >= 0"),
        (dict(temperature=float("nan")), r"temperature=nan"),
        (dict(top_k=0), r"top_k=0 must be an int >= 1"),
        (dict(top_k=2.0), r"top_k=2\.0 must be an int"),
        (dict(top_p=0.0), r"top_p=0\.0 must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p=1\.5 must be in \(0, 1\]"),
        (dict(max_new_tokens=0), r"max_new_tokens=0 must be an int >= 1"),
        (dict(prompt=[]), r"prompt has no tokens"),
        (
            dict(prompt=[3, 67]),
            r"prompt ids in \[3, 67\], outside the model's vocabulary \[0, vocab_size=67\)",
        ),
        (dict(prompt="Hi"), r"tokenizer=None: a text prompt to a model object needs a tokenizer"),
        (dict(chat=True), r"chat=True takes a text prompt"),
        (dict(dtype="bfloat16"), r"dtype= applies to a model directory"),
    ],
)
def test_bad_arguments_are_named(llama, kwargs, message):
    kwargs = {"prompt": PROMPT, **kwargs}
    with pytest.raises(ValueError, match=message):
        generate(llama, kwargs.pop("prompt"), **kwargs)


def test_bad_types_are_named(llama):
    with pytest.raises(TypeError, match=r"prompt must be a str or a 1-D sequence of ints"):
        generate(llama, [[1, 2]])
    with pytest.raises(TypeError, match=r"model must be a jaxckpt\.nn\.Transformer or a directory, got int"):
        generate(3, PROMPT)


def test_text_with_the_byte_tokenizer():
    model = _model(vocab_size=256)
    g = generate(model, "Hi", tokenizer=data.ByteTokenizer(), max_new_tokens=4)
    assert g.prompt == "Hi" and len(g.new_token_ids) == 4
    assert g.completion == data.ByteTokenizer().decode(g.new_token_ids)
    assert generate(model, "Hi", tokenizer="bytes", max_new_tokens=4) == g
    assert g.to_dict() == {
        "prompt": "Hi",
        "completion": g.completion,
        "new_token_ids": g.new_token_ids,
        "finish_reason": "length",
    }
    with pytest.raises(data.DataError, match="has no chat template"):
        generate(model, "Hi", tokenizer="bytes", chat=True)


def test_ids_beyond_the_tokenizer_have_no_text(llama):
    g = generate(llama, PROMPT, tokenizer=data.ByteTokenizer(), max_new_tokens=NEW)  # vocab 67 < 256
    assert g.completion == data.ByteTokenizer().decode(g.new_token_ids)
    big = _model(vocab_size=301)
    g = generate(big, [300, 299], tokenizer="bytes", max_new_tokens=3)
    assert g.completion == data.ByteTokenizer().decode([i for i in g.new_token_ids if i < 256])


def test_a_bfloat16_model_generates_in_bfloat16():
    model = _model(dtype="bfloat16", param_dtype="bfloat16")
    greedy = generate(model, PROMPT, max_new_tokens=4)
    sampled = generate(model, PROMPT, max_new_tokens=4, temperature=0.8, top_k=9, top_p=0.9)
    assert len(greedy.new_token_ids) == len(sampled.new_token_ids) == 4  # (bf16 logits tie too often
    # for a token-exact comparison with the plain forward: the fp32 tests make that one)


STORED = [
    ({"dtype": "bfloat16"}, "bfloat16"),
    ({"torch_dtype": "float16"}, "float16"),
    ({"dtype": "float64"}, None),
]


@pytest.mark.parametrize(("fields", "dtype"), [*STORED, ({}, None)])
def test_the_stored_dtype_of_an_hf_config(tmp_path, fields, dtype):
    (tmp_path / "config.json").write_text(json.dumps(fields))
    assert _load._stored_dtype(tmp_path) == dtype


def test_jaxckpt_generate_is_the_function_and_the_package_still_imports():
    assert jaxckpt.generate is generate
    package = importlib.import_module("jaxckpt.generate")
    assert package.Generation is Generation and package.generate is generate
    assert "generate" in jaxckpt.__all__


def test_sampling_knobs_are_validated_and_off_by_default():
    knobs = Sampling(temperature=0.5).knobs(67)
    assert (float(knobs.temperature), int(knobs.top_k), float(knobs.top_p)) == (0.5, 67, 1.0)
    assert int(Sampling(temperature=1.0, top_k=99).knobs(67).top_k) == 67
    assert Sampling().greedy and not Sampling(temperature=0.1).greedy
    with pytest.raises(ValueError, match=r"top_k=True"):
        Sampling(top_k=True)


# ----------------------------------------------------------------------------- vs transformers

WARPS = [(1.0, 5, None), (0.7, None, 0.9), (1.5, 9, 0.6), (0.3, 40, 0.999), (2.0, 1, 0.5), (1.0, None, 0.2)]


@pytest.mark.torch
@pytest.mark.parametrize(("temperature", "top_k", "top_p"), WARPS)
def test_warpers_equal_transformers(temperature, top_k, top_p):
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    torch = pytest.importorskip("torch")
    lp = pytest.importorskip("transformers.generation.logits_process")
    logits = np.random.default_rng(top_k or 0).normal(0, 3, (1, 61)).astype(np.float32)
    logits[0, 7] = logits[0, 11]  # a tie at the top-k boundary is kept by both
    warpers = [lp.TemperatureLogitsWarper(temperature)]
    warpers += [lp.TopKLogitsWarper(top_k)] if top_k else []
    warpers += [lp.TopPLogitsWarper(top_p)] if top_p else []
    theirs = torch.as_tensor(logits)
    for warp in warpers:
        theirs = warp(None, theirs)
    ours = jax.jit(warp_logits)(jnp.asarray(logits[0]), Sampling(temperature, top_k, top_p).knobs(61))
    theirs = theirs[0].numpy()
    np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(theirs))
    kept = np.isfinite(theirs)
    np.testing.assert_allclose(np.asarray(ours)[kept], theirs[kept], rtol=1e-6)


def test_warp_logits_at_top_p_one_keeps_every_token():
    logits = jnp.asarray([0.0, -200.0, 3.0])  # softmax underflows to 0 for the middle one
    knobs = Knobs(jnp.float32(1.0), jnp.int32(3), jnp.float32(1.0))
    assert jnp.isfinite(jax.jit(warp_logits)(logits, knobs)).all()


HF_PROMPT = [7, 300, 12, 45, 99]
HF_NEW = 8


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """family -> (torch model, its save_pretrained directory), each family once."""
    pytest.importorskip("torch")
    tm = importlib.import_module("torch_models")
    root = tmp_path_factory.mktemp("generate_families")
    return {family: (model := tm.tiny_family(family), tm.save(model, root / family, "safetensors"))
            for family in tm.FAMILIES}  # fmt: skip


def _transformers_greedy(torch_model, prompt, n, eos=None):
    import torch

    with torch.no_grad():
        out = torch_model.generate(
            torch.as_tensor([prompt]), do_sample=False, max_new_tokens=n, eos_token_id=eos,
            pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


FAMILIES = {  # torch_models.FAMILIES; the four that bring the most distinct features run fast
    "llama3": (),  # llama3 rope scaling, tied head
    "gemma2": (),  # soft caps, windows, post norms
    "gemma3": (),  # 2 local : 1 global (a switch in the cached scan), local rope base
    "phi3": (),  # longrope: 5 + 8 tokens pass original_max_position_embeddings=8 (prefilled again)
    "qwen3": (pytest.mark.slow,),  # (its eos test runs fast)
    "smollm2": (pytest.mark.slow,),
    "qwen2": (pytest.mark.slow,),
    "mistral": (pytest.mark.slow,),
    "smollm3": (pytest.mark.slow,),
}


@pytest.mark.torch
def test_the_grid_has_every_family(hf_models):
    assert sorted(FAMILIES) == sorted(hf_models)


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.parametrize("family", [pytest.param(f, marks=m) for f, m in FAMILIES.items()])
def test_greedy_equals_transformers(hf_models, family):
    torch_model, path = hf_models[family]
    theirs = _transformers_greedy(torch_model, HF_PROMPT, HF_NEW)
    ours = generate(path, HF_PROMPT, max_new_tokens=HF_NEW, stop_ids=())
    assert ours.new_token_ids == theirs
    assert ours.finish_reason == "length"


@pytest.mark.slow  # 2 s or more with the compile cache warm
@pytest.mark.torch
def test_longrope_is_prefilled_unpadded_and_again_where_transformers_drops_its_cache(hf_models):
    torch_model, path = hf_models["phi3"]  # original_max_position_embeddings=8
    model = _load.load_model(path)
    assert _decode.prompt_bucket(3, 16, model.config) == 3  # padded to 16 it would take the long factors
    assert _decode.rope_switch(model.config, 5, HF_NEW) == 4  # 5 + 4 tokens = 9: prefilled again
    assert _decode.rope_switch(model.config, 3, 5) is None  # 3 + 5 stay within 8: short factors
    assert generate(model, HF_PROMPT[:3], max_new_tokens=5).new_token_ids == _transformers_greedy(
        torch_model, HF_PROMPT[:3], 5
    )
    free = generate(model, HF_PROMPT, max_new_tokens=HF_NEW).new_token_ids
    early = generate(model, HF_PROMPT, max_new_tokens=HF_NEW, stop_ids=[free[1]])  # a stop before the switch
    assert early.new_token_ids == free[: free.index(free[1]) + 1] and early.finish_reason == "eos"
    run = lambda: generate(model, HF_PROMPT, max_new_tokens=HF_NEW, temperature=1.0, seed=2).new_token_ids
    assert run() == run() and len(run()) == HF_NEW


@pytest.mark.torch
def test_an_eos_stops_both_alike(hf_models):
    torch_model, path = hf_models["qwen3"]
    free = _transformers_greedy(torch_model, HF_PROMPT, HF_NEW)
    eos = free[3]
    assert free.index(eos) == 3  # (the fixture's seed gives one: 3 tokens, then the eos)
    theirs = _transformers_greedy(torch_model, HF_PROMPT, HF_NEW, eos=eos)
    ours = generate(path, HF_PROMPT, max_new_tokens=HF_NEW, stop_ids=[eos])
    assert ours.new_token_ids == theirs == free[: free.index(eos) + 1]
    assert ours.finish_reason == "eos"
