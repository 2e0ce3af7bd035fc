"""torch_bridge refuses bad checkpoints with an error that names the file or tensor."""

import json

import pytest

torch = pytest.importorskip("torch")

import torch_models as tm  # noqa: E402

import torch_bridge  # noqa: E402
from jaxckpt._warnings import JaxckptWarning  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    tm.tiny_llama().save_pretrained(path)
    return path


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_truncated_safetensors_names_the_file(llama_dir, tmp_path):
    bad = _copy(llama_dir, tmp_path / "bad")
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        torch_bridge.load_hf(bad)


def test_corrupt_safetensors_header_names_the_file(llama_dir, tmp_path):
    bad = _copy(llama_dir, tmp_path / "bad")
    (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        torch_bridge.load_hf(bad)


def _state(model):
    return dict(model.state_dict())


def test_missing_tensor_is_named():
    model = tm.tiny_llama()
    state = _state(model)
    del state["model.layers.1.mlp.up_proj.weight"]
    config = torch_bridge.config_from_hf(model.config.to_dict())
    with pytest.raises(ValueError, match=r"missing tensor\(s\): model\.layers\.1\.mlp\.up_proj\.weight"):
        torch_bridge.convert_state_dict(state, "llama", config)


def test_shape_mismatch_names_the_tensor_and_both_shapes():
    model = tm.tiny_llama()
    state = _state(model)
    state["model.layers.2.self_attn.k_proj.weight"] = torch.zeros(12, 25)
    config = torch_bridge.config_from_hf(model.config.to_dict())
    match = r"model\.layers\.2\.self_attn\.k_proj\.weight expected \(6, 25\) found \(12, 25\)"
    with pytest.raises(ValueError, match=match):
        torch_bridge.convert_state_dict(state, "llama", config)


def test_unexpected_tensor_is_named():
    model = tm.tiny_gpt2()
    state = _state(model) | {"transformer.h.0.adapter.weight": torch.zeros(3)}
    config = torch_bridge.config_from_hf(model.config.to_dict())
    with pytest.raises(ValueError, match=r"unexpected tensor\(s\): transformer\.h\.0\.adapter\.weight"):
        torch_bridge.convert_state_dict(state, "gpt2", config)


def _with_config(llama_dir, tmp_path, **changes):
    bad = _copy(llama_dir, tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text()) | changes
    (bad / "config.json").write_text(json.dumps(config))
    return bad


def test_unknown_architecture_is_named(llama_dir, tmp_path):
    bad = _with_config(llama_dir, tmp_path, model_type="bert")
    with pytest.raises(ValueError, match=r"config\.json: unknown architecture model_type='bert'.*llama"):
        torch_bridge.load_hf(bad)
    with pytest.raises(ValueError, match="unknown architecture 'bert'"):
        torch_bridge.architecture("bert")


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "rope_parameters.rope_type='dyn"),
        (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_scaling.rope_type='dynamic'"),
        (dict(rope_interleaved=True), "rope_interleaved=True"),
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
        (dict(sliding_window=16), "sliding_window=16"),
        (dict(quantization_config={"bits": 4}), "quantization_config"),
    ],
)
def test_config_fields_we_cannot_honour_are_named(llama_dir, tmp_path, changes, match):
    bad = _with_config(llama_dir, tmp_path, **changes)
    with pytest.raises(ValueError, match=r"config\.json: .*" + match.replace(".", r"\.").replace("(", r"\(")):
        torch_bridge.load_hf(bad)


def test_unknown_config_field_is_reported_warned_once_and_refused_when_strict(llama_dir, tmp_path):
    bad = _with_config(llama_dir, tmp_path, new_knob=7)
    with pytest.warns(JaxckptWarning, match=r"config\.json: config field\(s\) new_knob=7") as caught:
        converted = torch_bridge.read_checkpoint(bad)
    assert len(caught) == 1 and converted.report.unknown_fields == ["new_knob=7"]
    assert converted.report.to_dict()["unknown_fields"] == ["new_knob=7"]
    with pytest.raises(ValueError, match=r"config\.json: unknown config field\(s\) new_knob=7"):
        torch_bridge.load_hf(bad, strict=True)


def test_a_gguf_file_is_refused_with_how_to_convert_it(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(32))
    (tmp_path / "renamed.bin").write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(32))
    for path in (tmp_path / "model.gguf", tmp_path / "renamed.bin", tmp_path):
        with pytest.raises(ValueError, match=r"GGUF.*from_pretrained\(directory, gguf_file=NAME\)") as err:
            torch_bridge.load_hf(path, config=tm.tiny_llama().config.to_dict())
        assert str(path) in str(err.value)


def test_gpt2_features_we_cannot_honour_are_named():
    config = tm.tiny_gpt2().config.to_dict()
    for field, value in (("scale_attn_by_inverse_layer_idx", True), ("activation_function", "relu")):
        with pytest.raises(ValueError, match=field):
            torch_bridge.config_from_hf(config | {field: value})


def test_a_single_file_needs_a_config(tmp_path):
    torch.save(_state(tm.tiny_llama()), tmp_path / "weights.pt")
    with pytest.raises(ValueError, match="needs an explicit config"):
        torch_bridge.load_hf(tmp_path / "weights.pt")


def test_missing_directory_and_empty_directory(tmp_path):
    with pytest.raises(FileNotFoundError):
        torch_bridge.load_hf(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="empty"):
        torch_bridge.load_hf(tmp_path / "empty")


def test_bad_dtype_and_seed_heads(tmp_path, llama_dir):
    with pytest.raises(ValueError, match="dtype='int8'"):
        torch_bridge.load_hf(llama_dir, dtype="int8")
    torch.save(tm.tiny_seed_block().state_dict(), tmp_path / "block.pt")
    with pytest.raises(ValueError, match="num_heads=4 does not divide"):
        torch_bridge.load_seed_block(tmp_path / "block.pt", num_heads=4)


def test_shape_mismatch_names_the_file_the_tensor_and_both_shapes(tmp_path):
    import numpy as np
    import safetensors.numpy

    model = tm.tiny_llama()
    model.save_pretrained(tmp_path / "single")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="8KB")
    key = "model.layers.2.self_attn.k_proj.weight"
    for directory in (tmp_path / "single", tmp_path / "sharded"):
        index = directory / "model.safetensors.index.json"
        shard = json.loads(index.read_text())["weight_map"][key] if index.exists() else "model.safetensors"
        tensors = safetensors.numpy.load_file(directory / shard)
        tensors[key] = np.zeros((12, 25), np.float32)
        safetensors.numpy.save_file(tensors, directory / shard, metadata={"format": "pt"})
        with pytest.raises(ValueError) as err:
            torch_bridge.load_hf(directory)
        message = str(err.value)
        assert f"{key} expected (6, 25) found (12, 25)" in message, message
        assert str(directory) in message and shard in message, message


def test_hf_fields_that_could_change_the_model_are_refused_before_writing(tmp_path):
    model = torch_bridge.load_hf(tm.save(tm.tiny_llama(), tmp_path / "src", "safetensors"))
    for fields, match in (
        ({"eos_token_id": 2, "hidden_size": 8}, r"hf_fields: hidden_size=8 is not a name, id or generation"),
        ({"model_type": "bert"}, r"hf_fields: model_type='bert' is written from the model itself"),
    ):
        with pytest.raises(ValueError, match=match):
            torch_bridge.save_hf(model, tmp_path / "out", hf_fields=fields)
        assert not (tmp_path / "out").exists()
