"""``jaxckpt convert`` and ``jaxckpt train --init-from``: atomic, never overwriting, and
round-tripping to a checkpoint that transformers loads with the same logits."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import torch_models as tm  # noqa: E402

from jaxckpt.cli import main  # noqa: E402

pytestmark = pytest.mark.torch


def _run(capsys, *argv) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _fails(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.slow
def test_convert_to_jax_train_and_back_to_torch(tmp_path, capsys):
    torch_model = tm.tiny_gpt2()
    torch_model.save_pretrained(tmp_path / "hf", max_shard_size="8KB")
    result = _run(capsys, "convert", str(tmp_path / "hf"), str(tmp_path / "jax"))
    assert result["arch"] == "gpt2" and result["tensors"] == 4 + 12 * tm.LAYERS
    meta = json.loads((tmp_path / "jax" / "jaxckpt.json").read_text())
    assert meta["kind"] == "params" and meta["config"]["vocab_size"] == tm.VOCAB

    back = _run(capsys, "convert", str(tmp_path / "jax"), str(tmp_path / "back"), "--to", "torch")
    assert back["arch"] == "gpt2"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    ids = tm.tokens(length=7)
    np.testing.assert_allclose(tm.torch_logits(reloaded, ids), tm.torch_logits(torch_model, ids), atol=1e-6)

    short = ("--steps", "2", "--batch", "2", "--seq", "9", "--tokenizer", "bytes")  # the model has none
    run = _run(capsys, "train", "--init-from", str(tmp_path / "jax"), *short)
    assert len(run["steps"]) == 2
    hf_run = _run(capsys, "train", "--init-from", str(tmp_path / "hf"), *short)
    assert hf_run["steps"][0]["loss"] == pytest.approx(run["steps"][0]["loss"], abs=1e-5)
    err = _fails(capsys, "train", "--init-from", str(tmp_path / "jax"), "--model", "tiny", "--steps", "1")
    assert "holds a different model" in err and "vocab_size" in err


def test_existing_destination_needs_force(tmp_path, capsys):
    tm.tiny_llama().save_pretrained(tmp_path / "hf")
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "keep.txt").write_text("old")
    err = _fails(capsys, "convert", str(tmp_path / "hf"), str(tmp_path / "dst"))
    assert "--force" in err and (tmp_path / "dst" / "keep.txt").read_text() == "old"
    _run(capsys, "convert", str(tmp_path / "hf"), str(tmp_path / "dst"), "--force")
    assert not (tmp_path / "dst" / "keep.txt").exists() and (tmp_path / "dst" / "jaxckpt.json").exists()


def test_a_failed_conversion_leaves_no_output(tmp_path, capsys):
    model = tm.tiny_llama()
    model.save_pretrained(tmp_path / "hf")
    state = dict(model.state_dict())
    del state["model.norm.weight"]
    torch.save(state, tmp_path / "hf" / "pytorch_model.bin")  # safetensors wins; break that too
    (tmp_path / "hf" / "model.safetensors").unlink()
    err = _fails(capsys, "convert", str(tmp_path / "hf"), str(tmp_path / "dst"))
    assert "model.norm.weight" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no dst, no temporary left over


def test_seed_block_both_ways(tmp_path, capsys):
    block = tm.tiny_seed_block()
    torch.save(block.state_dict(), tmp_path / "block.pt")
    err = _fails(capsys, "convert", str(tmp_path / "block.pt"), str(tmp_path / "jax"))
    assert "--num-heads" in err
    result = _run(capsys, "convert", str(tmp_path / "block.pt"), str(tmp_path / "jax"), "--num-heads", "3")
    assert result["arch"] == "seed-block"
    _run(capsys, "convert", str(tmp_path / "jax"), str(tmp_path / "back.pt"), "--to", "torch")
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    for key, value in block.state_dict().items():
        assert torch.equal(back[key], value), key


def test_dtype_cast_and_single_file_with_config(tmp_path, capsys):
    model = tm.tiny_llama()
    model.config.to_json_file(tmp_path / "config.json")
    torch.save(model.state_dict(), tmp_path / "weights.bin")
    err = _fails(capsys, "convert", str(tmp_path / "weights.bin"), str(tmp_path / "jax"))
    assert "--arch" in err
    config = str(tmp_path / "config.json")
    result = _run(
        capsys,
        "convert",
        str(tmp_path / "weights.bin"),
        str(tmp_path / "jax"),
        "--config",
        config,
        "--dtype",
        "bf16",
    )
    assert result["bytes"] * 2 == sum(v.numel() * 4 for v in model.state_dict().values())
    assert json.loads((tmp_path / "jax" / "jaxckpt.json").read_text())["config"]["param_dtype"] == "bfloat16"


def _mixed_llama():
    """A tiny LLaMA with fp32 norms and bf16 matrices."""
    model = tm.tiny_llama()
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.to(torch.float32 if p.ndim == 1 else torch.bfloat16)
    return model


def _safetensors(directory) -> dict:
    import safetensors.numpy

    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out |= safetensors.numpy.load_file(f)
    return out


def test_mixed_dtypes_survive_both_ways_and_casts_are_shown(tmp_path, capsys):
    _mixed_llama().save_pretrained(tmp_path / "hf")
    result = _run(capsys, "convert", str(tmp_path / "hf"), str(tmp_path / "jax"))
    assert "dtype_changes" not in result  # nothing was cast
    _run(capsys, "convert", str(tmp_path / "jax"), str(tmp_path / "back"), "--to", "torch")
    before, after = _safetensors(tmp_path / "hf"), _safetensors(tmp_path / "back")
    assert sorted(after) == sorted(before)
    for key, array in before.items():
        assert after[key].dtype == array.dtype, key
        np.testing.assert_array_equal(after[key].view(np.uint8), array.view(np.uint8), err_msg=key)

    cast = _run(capsys, "convert", str(tmp_path / "hf"), str(tmp_path / "jax32"), "--dtype", "fp32")
    matrices = sorted(k for k, a in before.items() if a.ndim == 2)
    assert sorted(k for k, _, _ in cast["dtype_changes"]) == matrices
    assert (
        main(["convert", str(tmp_path / "jax"), str(tmp_path / "back16"), "--to", "torch", "--dtype", "fp16"])
        == 0
    )
    shown = capsys.readouterr().out
    assert f"{len(matrices)} tensor(s) cast bfloat16 -> float16" in shown
    assert f"{len(before) - len(matrices)} tensor(s) cast float32 -> float16" in shown


def test_token_ids_survive_hf_to_jax_to_hf(tmp_path, capsys):
    source = tm.tiny_family("smollm2")  # SmolLM2-style: plain LLaMA, tied head
    source.config.bos_token_id, source.config.eos_token_id, source.config.pad_token_id = 1, 2, 2
    source.save_pretrained(tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (written["bos_token_id"], written["eos_token_id"], written["pad_token_id"]) == (1, 2, 2)
    _run(capsys, "convert", str(tmp_path / "hf"), str(tmp_path / "jax"))
    meta = json.loads((tmp_path / "jax" / "jaxckpt.json").read_text())
    assert meta["hf_fields"] | {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2} == meta["hf_fields"]
    _run(capsys, "convert", str(tmp_path / "jax"), str(tmp_path / "back"), "--to", "torch")
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (back["bos_token_id"], back["eos_token_id"], back["pad_token_id"]) == (1, 2, 2)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert (reloaded.config.bos_token_id, reloaded.config.eos_token_id, reloaded.config.pad_token_id) == (
        1,
        2,
        2,
    )
    ids = tm.tokens(length=7)
    np.testing.assert_allclose(tm.torch_logits(reloaded, ids), tm.torch_logits(source.eval(), ids), atol=1e-5)
