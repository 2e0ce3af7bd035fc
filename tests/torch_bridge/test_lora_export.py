"""LoRA out and in: the merged export and the PEFT adapter format, with peft as the oracle.

A tiny random Hugging Face LLaMA (2 layers, GQA, odd sizes) is the base. A jaxckpt LoRA model
on it with random adapters is written (1) as a PEFT adapter, which ``peft.PeftModel`` puts
on the transformers base with equal logits, and whose tensor names and shapes are those
``peft.get_peft_model_state_dict`` gives; (2) merged, equal to peft's ``merge_and_unload``.
An adapter peft wrote is read back (``load_peft_adapter``, ``jaxckpt convert --lora-from``),
trained further with ``jaxckpt train`` and exported again.
"""

import json
import os

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

import torch_bridge  # noqa: E402
from jaxckpt import nn  # noqa: E402
from jaxckpt.cli import main  # noqa: E402
from torch_bridge._convert import unflatten  # noqa: E402

pytestmark = pytest.mark.torch

VOCAB, LAYERS = 259, 2  # >= 256: jaxckpt train's byte tokenizer fits
IDS = np.array([[3, 250, 17, 41, 5, 99, 128], [7, 1, 200, 58, 13, 77, 31]])
OURS = nn.LoraConfig(rank=3, alpha=5, targets=("q", "v", "o", "down"))
THEIRS = dict(r=5, lora_alpha=7, target_modules=["k_proj", "gate_proj", "up_proj"])


def _hf_llama(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=21,
        intermediate_size=23,
        num_hidden_layers=LAYERS,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=32,
        rope_theta=500.0,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config).eval()


def _torch_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(IDS)).logits.float().numpy()


def _logits(model) -> np.ndarray:
    return np.asarray(model(jnp.asarray(IDS, jnp.int32)), np.float32)


def _randomize_adapters(model, seed: int):
    """Every adapter matrix random (b too), so the adapters change the logits."""
    state = nnx.state(model, nnx.LoRAParam)
    rng = np.random.default_rng(seed)
    pure = {p: rng.normal(0, 0.3, a.shape).astype(a.dtype) for p, a in _flat(nnx.to_pure_dict(state)).items()}
    nnx.replace_by_pure_dict(state, unflatten(pure))
    nnx.update(model, state)
    return model


def _flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        out |= _flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
    return out


def _run(capsys, *argv) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora") / "hf"
    _hf_llama().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ours(base):
    """A jaxckpt LoRA model on the base, random adapters on q, v, o and down."""
    converted = torch_bridge.read_checkpoint(base)
    config = converted.config.replace(lora=OURS)
    return _randomize_adapters(nn.from_params(nn.Transformer, config, converted.params), seed=1)


@pytest.fixture(scope="module")
def theirs(base, tmp_path_factory):
    """An adapter peft wrote (random B: init_lora_weights=False) and its PeftModel."""
    model = peft.get_peft_model(
        transformers.LlamaForCausalLM.from_pretrained(base),
        peft.LoraConfig(**THEIRS, init_lora_weights=False, task_type="CAUSAL_LM"),
    ).eval()
    path = tmp_path_factory.mktemp("peft") / "adapter"
    model.save_pretrained(path)
    return path, model


def test_adapter_loads_in_peft_with_our_logits(ours, base, tmp_path):
    out = torch_bridge.save_peft_adapter(ours, tmp_path / "adapter", base_model_name_or_path=str(base))
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
    fields = json.loads((out / "adapter_config.json").read_text())
    assert fields["peft_type"] == "LORA" and fields["task_type"] == "CAUSAL_LM" and fields["bias"] == "none"
    assert (fields["r"], fields["lora_alpha"], fields["lora_dropout"]) == (3, 5, 0.0)
    assert fields["target_modules"] == [nn.HF_MODULES[t] for t in OURS.targets]
    # the names and shapes are peft's own
    reference = peft.get_peft_model(
        transformers.LlamaForCausalLM.from_pretrained(base),
        peft.LoraConfig(r=3, lora_alpha=5, target_modules=fields["target_modules"]),
    )
    expected = {k: tuple(v.shape) for k, v in peft.get_peft_model_state_dict(reference).items()}
    written = load_file(out / "adapter_model.safetensors")
    assert {k: v.shape for k, v in written.items()} == expected
    assert all(v.dtype == np.float32 for v in written.values())

    loaded = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(base), out).eval()
    logits = _logits(ours)
    np.testing.assert_allclose(_torch_logits(loaded), logits, atol=1e-5, rtol=1e-5)
    plain = _torch_logits(transformers.LlamaForCausalLM.from_pretrained(base))
    assert np.abs(plain - logits).max() > 100 * 1e-5  # the adapters matter


def test_merged_export_equals_peft_merge_and_unload(ours, base, tmp_path):
    peft_dir = torch_bridge.save_peft_adapter(ours, tmp_path / "adapter")
    merged = torch_bridge.save_hf(ours, tmp_path / "merged")
    tensors = load_file(merged / "model.safetensors")
    assert not [k for k in tensors if "lora" in k]
    assert "lora" not in json.loads((merged / "config.json").read_text())
    base_model = transformers.LlamaForCausalLM.from_pretrained(base)
    unloaded = peft.PeftModel.from_pretrained(base_model, peft_dir).merge_and_unload().state_dict()
    assert sorted(tensors) == sorted(unloaded)
    for key, value in unloaded.items():
        np.testing.assert_allclose(tensors[key], value.numpy(), atol=1e-6, rtol=1e-6, err_msg=key)
    reloaded = transformers.LlamaForCausalLM.from_pretrained(merged).eval()
    np.testing.assert_allclose(_torch_logits(reloaded), _logits(ours), atol=1e-5, rtol=1e-5)


def test_bf16_base_merges_in_fp32_and_bf16_adapters_stay_bf16(tmp_path):
    cfg = nn.TransformerConfig.preset("tiny", n_layers=1, d_model=18, n_heads=3, n_kv_heads=1, ffn_dim=11)
    cfg = cfg.replace(
        param_dtype="bfloat16", lora=nn.LoraConfig(rank=2, alpha=3, targets="up", dtype="bfloat16")
    )
    rng = np.random.default_rng(2)
    a, b = (rng.normal(0, 0.3, shape).astype(jnp.bfloat16) for shape in ((1, 18, 2), (1, 2, 11)))
    kernel = rng.normal(0, 0.1, (1, 18, 11)).astype(jnp.bfloat16)
    up = {"kernel": kernel, "lora": {"lora_a": a, "lora_b": b}}
    merged, plain = torch_bridge.merge_lora({"blocks": {"mlp": {"up": up}}}, cfg)
    exact = kernel.astype(np.float32) + 1.5 * np.matmul(a.astype(np.float32), b.astype(np.float32))
    assert plain.lora is None and merged["blocks"]["mlp"]["up"].keys() == {"kernel"}
    np.testing.assert_array_equal(merged["blocks"]["mlp"]["up"]["kernel"], exact.astype(jnp.bfloat16))

    out = torch_bridge.write_peft_adapter({"blocks": {"mlp": {"up": up}}}, cfg, tmp_path / "bf16")
    with torch_bridge.open_tensors(out / "adapter_model.safetensors") as source:
        assert {k: str(source.dtype(k)) for k in source.keys()} == {  # noqa: SIM118
            "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": "bfloat16",
            "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight": "bfloat16",
        }
        np.testing.assert_array_equal(
            source["base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"], b[0].T
        )


def test_peft_adapter_loads_into_our_model(theirs, base):
    path, peft_model = theirs
    converted = torch_bridge.read_checkpoint(base)
    lora = torch_bridge.peft_lora_config(path, converted.config)
    assert (lora.rank, lora.alpha, lora.targets, lora.dtype) == (5, 7.0, ("k", "gate", "up"), "float32")
    model = nn.from_params(nn.Transformer, converted.config.replace(lora=lora), converted.params)
    torch_bridge.load_peft_adapter(model, path)
    np.testing.assert_allclose(_logits(model), _torch_logits(peft_model), atol=1e-5, rtol=1e-5)


def test_mismatched_adapter_is_refused_by_name(theirs, base):
    path, _ = theirs
    config = torch_bridge.read_checkpoint(base).config
    wrong = config.replace(lora=nn.LoraConfig(rank=4, alpha=7, targets="k,up"))
    with pytest.raises(ValueError, match=r"r: 5 in the adapter, 4 in config.lora.rank; target modules"):
        torch_bridge.read_peft_adapter(path, wrong)
    short = config.replace(n_layers=1, lora=torch_bridge.peft_lora_config(path, config))
    with pytest.raises(ValueError, match=r"no 1-layer jaxckpt llama adapter holds: .*layers\.1\."):
        torch_bridge.read_peft_adapter(path, short)


def test_refusals(ours, tmp_path):
    cfg = nn.TransformerConfig.preset("tiny", n_layers=1, d_model=18, n_heads=3, n_kv_heads=1, ffn_dim=11)
    with pytest.raises(ValueError, match=r"config\.lora is None: the model has no LoRA adapters"):
        torch_bridge.write_peft_adapter({}, cfg, tmp_path / "none")
    with pytest.raises(ValueError, match=r"quantize_base='nf4'.*--adapter-only"):
        torch_bridge.merge_lora({}, cfg.replace(lora=2, quantize_base="nf4"))
    gpt2 = nn.TransformerConfig.preset("gpt2", n_layers=1, d_model=9, n_heads=3, vocab_size=13, max_len=8)
    with pytest.raises(ValueError, match=r"'q' adapter .*c_attn holds q, k, v.*o,up,down"):
        torch_bridge.write_peft_adapter({}, gpt2.replace(lora=2), tmp_path / "g")
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError, match="force=True"):
        torch_bridge.save_peft_adapter(ours, tmp_path / "taken")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # nothing half-written
    with pytest.raises(ValueError, match=r"adapters at blocks\.attn\.out_proj, .*config\.lora is None"):
        torch_bridge.write_hf(nnx.state(ours, nnx.Param), ours.config.replace(lora=None), tmp_path / "x")


def test_gpt2_conv1d_adapter_loads_in_peft(tmp_path):
    torch.manual_seed(3)
    hf = transformers.GPT2Config(vocab_size=VOCAB, n_embd=15, n_layer=LAYERS, n_head=3, n_positions=16)
    hf.bos_token_id = hf.eos_token_id = 0
    transformers.GPT2LMHeadModel(hf).save_pretrained(tmp_path / "gpt2")
    converted = torch_bridge.read_checkpoint(tmp_path / "gpt2")
    config = converted.config.replace(lora=nn.LoraConfig(rank=2, alpha=3, targets="o,up,down"))
    model = _randomize_adapters(nn.from_params(nn.Transformer, config, converted.params), seed=4)
    out = torch_bridge.save_peft_adapter(model, tmp_path / "adapter")
    fields = json.loads((out / "adapter_config.json").read_text())
    assert fields["target_modules"] == ["attn.c_proj", "c_fc", "mlp.c_proj"] and fields["fan_in_fan_out"]
    base = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2")
    loaded = peft.PeftModel.from_pretrained(base, out).eval()
    np.testing.assert_allclose(_torch_logits(loaded), _logits(model), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_cli_lora_from_train_and_export(theirs, base, tmp_path, capsys):
    path, peft_model = theirs
    jax_dir, trained = tmp_path / "jax", tmp_path / "trained"
    _run(capsys, "convert", str(base), str(jax_dir), "--lora-from", str(path))
    assert json.loads((jax_dir / "jaxckpt.json").read_text())["config"]["lora"]["rank"] == 5
    # the adapter goes back out as peft wrote it, bit for bit
    back = _run(capsys, "convert", str(jax_dir), str(tmp_path / "back"), "--to", "torch", "--adapter-only")
    assert back["adapter_only"] and back["target_modules"] == ["k_proj", "gate_proj", "up_proj"]
    original, written = (load_file(p / "adapter_model.safetensors") for p in (path, tmp_path / "back"))
    assert sorted(original) == sorted(written)
    assert all(np.array_equal(original[k], written[k]) for k in original)
    # merged: transformers reads it with peft's logits
    merged = _run(capsys, "convert", str(jax_dir), str(tmp_path / "merged"), "--to", "torch")
    assert any("merged the LoRA adapters" in note for note in merged["notes"])
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged").eval()
    np.testing.assert_allclose(_torch_logits(reloaded), _torch_logits(peft_model), atol=1e-5, rtol=1e-5)

    short = ("--steps", "2", "--batch", "2", "--seq", "9", "--tokenizer", "bytes", "--lr", "1e-2")
    _run(capsys, "train", "--init-from", str(jax_dir), *short, "--checkpoint-dir", str(trained))
    out = tmp_path / "out"
    _run(capsys, "convert", str(trained), str(out), "--to", "torch", "--adapter-only")
    with pytest.raises(SystemExit):
        main(["convert", str(trained), str(out), "--to", "torch", "--adapter-only"])
    assert "--force" in capsys.readouterr().err
    after = load_file(out / "adapter_model.safetensors")
    assert sorted(after) == sorted(original) and not all(np.array_equal(after[k], original[k]) for k in after)
    model = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(base), out).eval()
    merged_trained = _run(capsys, "convert", str(trained), str(tmp_path / "m2"), "--to", "torch")
    assert merged_trained["arch"] == "llama"
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "m2").eval()
    np.testing.assert_allclose(_torch_logits(reloaded), _torch_logits(model), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_a_lora_trained_on_a_bf16_base_exports_merged_float32_exactly(tmp_path, capsys):
    """The bug of issue 30: a bf16 base's merged kernels were rounded through bf16 before the
    float32 write (the existing tests merged fp32 bases, or asked for bf16 output). Trained
    adapters on a bf16 base, exported merged with --dtype float32 and as a PEFT adapter: every
    merged kernel is W0 + scale * B @ A to 1e-6, and peft's logits on the adapter are the
    merged export's to 1e-4; a bf16 export reports what its rounding loses."""
    hf = _hf_llama(seed=5)
    with torch.no_grad():  # bf16-exact weights in an fp32 file: the base is kept in bf16 losslessly
        for weight in hf.parameters():
            weight.copy_(weight.to(torch.bfloat16).float())
    hf.save_pretrained(tmp_path / "base")
    trained, merged, adapter = (tmp_path / name for name in ("trained", "merged", "adapter"))
    _run(
        capsys, "train", "--init-from", str(tmp_path / "base"), "--lora", "4", "--lora-alpha", "8",
        "--param-dtype", "bfloat16", "--steps", "3", "--lr", "1e-2", "--batch", "2", "--seq", "9",
        "--tokenizer", "bytes", "--checkpoint-dir", str(trained),
    )  # fmt: skip
    full = _run(capsys, "convert", str(trained), str(merged), "--to", "torch", "--dtype", "float32")
    assert "lora_rounding" not in full  # nothing rounded
    _run(capsys, "convert", str(trained), str(adapter), "--to", "torch", "--adapter-only")

    base = load_file(tmp_path / "base" / "model.safetensors")
    written, lora = load_file(merged / "model.safetensors"), load_file(adapter / "adapter_model.safetensors")
    scale = 8 / 4
    adapted = sorted(k.removesuffix(".lora_A.weight") for k in lora if k.endswith(".lora_A.weight"))
    assert len(adapted) == 4 * LAYERS  # q, k, v and o: the default targets
    for key in adapted:
        name = key.removeprefix("base_model.model.") + ".weight"
        delta = scale * lora[f"{key}.lora_B.weight"] @ lora[f"{key}.lora_A.weight"]
        assert written[name].dtype == np.float32 and np.abs(delta).max() > 1e-4, name  # trained
        np.testing.assert_allclose(written[name], base[name] + delta, atol=1e-6, rtol=0, err_msg=name)

    plain = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base").eval()
    theirs = _torch_logits(peft.PeftModel.from_pretrained(plain, adapter).eval())
    ours = _torch_logits(transformers.LlamaForCausalLM.from_pretrained(merged).eval())
    effect = np.abs(theirs - _torch_logits(transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base")))
    assert effect.max() >= 1e-3, effect.max()
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)

    bf16 = _run(capsys, "convert", str(trained), str(tmp_path / "bf16"), "--to", "torch")
    rounding = bf16["lora_rounding"]  # the base is bf16: so is the merged export, by default
    assert rounding["dtype"] == "kept" and 0 < rounding["relative_delta_error"] <= 1, rounding
    assert rounding["worst"].startswith("blocks.attn."), rounding
    with capsys.disabled():  # the figures of the closing note (printed last: _run reads stdout)
        print(f"\nadapter effect {effect.max():.3g}, peft vs merged fp32 {np.abs(ours - theirs).max():.3g}")
        print("bf16 merge:", rounding)
