"""torch_bridge: Hugging Face LLaMA / GPT-2 and the seed block, in and out, checked
against the torch models' own outputs in fp32."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402
import torch_models as tm  # noqa: E402
from flax import nnx  # noqa: E402

import torch_bridge  # noqa: E402
from jaxckpt import train  # noqa: E402
from torch_bridge._convert import flatten  # noqa: E402
from torch_bridge._models import build_model  # noqa: E402

pytestmark = pytest.mark.torch

LOGITS_ATOL = 1e-5
BUILDERS = {"llama": tm.tiny_llama, "gpt2": tm.tiny_gpt2}


def _check_logits(model, torch_model, ids):
    ours = np.asarray(model(jnp.asarray(ids, jnp.int32))).astype(np.float32)
    theirs = tm.torch_logits(torch_model, ids)
    assert ours.shape == theirs.shape
    assert np.abs(ours - theirs).max() <= LOGITS_ATOL
    np.testing.assert_array_equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize("fmt", tm.FORMATS)
@pytest.mark.parametrize("arch", BUILDERS)
def test_logits_match_torch_for_every_format(tmp_path, arch, fmt):
    torch_model = BUILDERS[arch]()
    path = tm.save(torch_model, tmp_path / "ckpt", fmt)
    options = {"config": tmp_path / "ckpt" / "config.json"} if fmt == "pt" else {}
    model = torch_bridge.load_hf(path, **options)
    assert model.config.family == arch
    assert model.config.tie_embeddings == (arch == "gpt2")
    _check_logits(model, torch_model, tm.tokens(length=13))


@pytest.mark.parametrize("arch", BUILDERS)
def test_torch_to_jax_to_torch_is_bit_identical(arch):
    torch_model = BUILDERS[arch]()
    state = torch_model.state_dict()
    config = torch_bridge.config_from_hf(torch_model.config.to_dict())
    params, report = torch_bridge.convert_state_dict(state, arch, config)
    back = dict(torch_bridge.export_state_dict(params, arch, config))
    tied = {"lm_head.weight"} if config.tie_embeddings else set()
    assert set(back) == set(state) - tied
    for key, array in back.items():
        np.testing.assert_array_equal(array, state[key].numpy(), err_msg=key)
    assert report.converted == len(back) and not report.dtype_changes


@pytest.mark.parametrize("arch", BUILDERS)
def test_save_hf_loads_in_transformers_with_the_same_logits(tmp_path, arch):
    torch_model = BUILDERS[arch]()
    torch_model.save_pretrained(tmp_path / "src")
    model = torch_bridge.load_hf(tmp_path / "src")
    out = torch_bridge.save_hf(model, tmp_path / "exported", max_shard_size="20KB")
    assert (out / "model.safetensors.index.json").exists()  # sharded
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = tm.tokens(length=9, seed=3)
    np.testing.assert_allclose(tm.torch_logits(reloaded, ids), tm.torch_logits(torch_model, ids), atol=1e-6)
    with pytest.raises(FileExistsError, match="exported"):
        torch_bridge.save_hf(model, tmp_path / "exported")


def test_bf16_stays_bf16(tmp_path):
    torch_model = tm.tiny_llama(dtype=torch.bfloat16)
    torch_model.save_pretrained(tmp_path / "src")
    model = torch_bridge.load_hf(tmp_path / "src")
    assert model.config.param_dtype == "bfloat16"
    assert model.embed.embedding[...].dtype == jnp.bfloat16
    out = torch_bridge.save_hf(model, tmp_path / "out")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    for key, value in reloaded.state_dict().items():
        assert value.dtype == torch.bfloat16, key
        assert torch.equal(value, torch_model.state_dict()[key]), key
    as_fp32 = torch_bridge.load_hf(tmp_path / "src", dtype="fp32")
    assert as_fp32.embed.embedding[...].dtype == jnp.float32


def test_seed_block_matches_exact_attention(tmp_path):
    block = tm.tiny_seed_block()
    torch.save(block.state_dict(), tmp_path / "block.pt")
    ours = torch_bridge.load_seed_block(tmp_path / "block.pt", num_heads=3)
    x = np.random.default_rng(1).standard_normal((2, 17, 21)).astype(np.float32)
    with torch.no_grad():
        expected = block(torch.as_tensor(x)).numpy()
    got = np.asarray(ours(jnp.asarray(x)))
    assert np.abs(got - expected).max() <= LOGITS_ATOL
    torch_bridge.save_seed_block(ours, tmp_path / "back.pt")
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert set(back) == set(block.state_dict())
    for key, value in block.state_dict().items():
        assert torch.equal(back[key], value), key


@pytest.mark.slow
def test_fine_tune_a_converted_model_with_remat(tmp_path):
    tm.tiny_llama().save_pretrained(tmp_path / "src")
    config = train.source_config(tmp_path / "src")
    src = tmp_path / "src"  # no tokenizer files: byte tokens, which fit its vocabulary
    run = train.RunConfig(
        steps=4,
        batch=2,
        seq=12,
        init_from=src,
        data={"tokenizer": "bytes"},
        remat="save_attn",
        progress=False,
    )
    run = train.train(config, run)
    losses = [s["loss"] for s in run.steps]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    first = torch_bridge.load_hf(tmp_path / "src")
    batch = train.ByteBatches(train.load_tokens(None), 2, 12, seed=0).batch_at(0)[0]
    expected = float(train.next_token_loss(first, jnp.asarray(batch)))
    assert losses[0] == pytest.approx(expected, abs=1e-5)  # step 0 starts from the checkpoint
    exported = torch_bridge.save_hf(run.trainer.model, tmp_path / "tuned")
    assert transformers.AutoModelForCausalLM.from_pretrained(exported) is not None


def test_conversion_report_and_allow_missing():
    torch_model = tm.tiny_gpt2()
    state = dict(torch_model.state_dict())
    state["transformer.h.0.attn.bias"] = torch.ones(1, 1, 64, 64)  # an old causal-mask buffer
    del state["transformer.ln_f.bias"]
    config = torch_bridge.config_from_hf(torch_model.config.to_dict())
    with pytest.raises(ValueError, match=r"1 missing tensor\(s\): transformer.ln_f.bias"):
        torch_bridge.convert_state_dict(state, "gpt2", config)
    params, report = torch_bridge.convert_state_dict(state, "gpt2", config, allow_missing=True)
    assert report.missing == ["transformer.ln_f.bias"]
    assert "transformer.h.0.attn.bias" in report.ignored and "lm_head.weight" in report.ignored
    assert not params["final_norm"]["bias"].any()


def test_gpt2_model_keys_without_the_transformer_prefix():
    """Checkpoints saved from ``GPT2Model`` (the hub's gpt2) lack ``transformer.``."""
    torch_model = tm.tiny_gpt2()
    full = torch_model.state_dict()
    bare = {k.removeprefix("transformer."): v for k, v in full.items() if k != "lm_head.weight"}
    config = torch_bridge.config_from_hf(torch_model.config.to_dict())
    params, report = torch_bridge.convert_state_dict(bare, "gpt2", config)
    expected, _ = torch_bridge.convert_state_dict(full, "gpt2", config)
    assert report.converted == len(bare) and not report.unexpected
    for path, leaf in flatten(expected).items():
        np.testing.assert_array_equal(flatten(params)[path], leaf, err_msg=path)


def test_to_jax_model_state_is_a_view_of_the_numpy_buffers():
    """The converted parameters move into JAX without a copy (the model is held once)."""
    torch_model = tm.tiny_llama()
    config = torch_bridge.config_from_hf(torch_model.config.to_dict())
    params, _ = torch_bridge.convert_state_dict(torch_model.state_dict(), "llama", config)
    pointer = params["embed"]["embedding"].ctypes.data
    model = build_model(torch_bridge.architecture("llama"), config, params)
    assert model.embed.embedding[...].unsafe_buffer_pointer() == pointer
    assert isinstance(model, nnx.Module)
