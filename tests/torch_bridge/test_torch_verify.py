"""``verify=True`` and ``jaxckpt convert --verify``: the converted model's logits against
transformers' own, with the largest difference reported."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import torch_models as tm  # noqa: E402

import torch_bridge  # noqa: E402
from jaxckpt.cli import main  # noqa: E402
from torch_bridge import _models  # noqa: E402
from torch_bridge._verify import TOLERANCES  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    tm.tiny_llama().save_pretrained(path)
    return path


def test_verify_passes_and_reports_the_largest_difference(llama_dir):
    converted = torch_bridge.read_checkpoint(llama_dir, verify=True)
    report = converted.report
    assert 0 <= report.verified_max_abs_diff <= report.verify_tolerance
    assert report.verified_max_abs_diff < 1e-4 and report.verify_tolerance >= TOLERANCES["float32"]
    assert report.to_dict()["verified_max_abs_diff"] == report.verified_max_abs_diff
    assert torch_bridge.load_hf(llama_dir, verify=True).config.n_kv_heads == 1


def test_bf16_is_held_to_the_bf16_tolerance(llama_dir):
    report = torch_bridge.read_checkpoint(llama_dir, dtype="bf16", verify=True).report
    assert report.verify_tolerance >= TOLERANCES["bfloat16"] and report.verified_max_abs_diff > 0


def test_verify_fails_on_a_wrong_conversion(llama_dir, monkeypatch):
    convert = _models.convert_state_dict

    def perturbed(*args, **kwargs):
        params, report = convert(*args, **kwargs)
        params["blocks"]["mlp"]["down"]["kernel"][1] *= 1.5  # one layer's MLP output, a third too large
        return params, report

    monkeypatch.setattr(_models, "convert_state_dict", perturbed)
    with pytest.raises(ValueError, match=r"llama\d*: verify=True failed: .* max_abs_diff=[\d.e-]+, above the "
                       r"float32 tolerance [\d.e-]+") as err:  # fmt: skip
        torch_bridge.load_hf(llama_dir, verify=True)
    assert str(llama_dir) in str(err.value)
    assert torch_bridge.load_hf(llama_dir).config.d_model == 25  # without verify, nothing is checked


def test_verify_needs_the_directory_s_own_config(llama_dir, tmp_path):
    config = json.loads((llama_dir / "config.json").read_text())
    with pytest.raises(ValueError, match="cannot check a checkpoint read with config="):
        torch_bridge.read_checkpoint(llama_dir, config=config, verify=True)


def _run(capsys, *argv) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_convert_verify_and_strict_flags(llama_dir, tmp_path, capsys):
    result = _run(capsys, "convert", str(llama_dir), str(tmp_path / "jax"), "--verify")
    assert 0 <= result["verified_max_abs_diff"] <= result["verify_tolerance"]
    back = _run(capsys, "convert", str(tmp_path / "jax"), str(tmp_path / "back"), "--to", "torch", "--verify")
    assert 0 <= back["verified_max_abs_diff"] < 1e-4

    unknown = tmp_path / "unknown"
    unknown.mkdir()
    for f in llama_dir.iterdir():
        (unknown / f.name).write_bytes(f.read_bytes())
    config = json.loads((unknown / "config.json").read_text()) | {"new_knob": 7}
    (unknown / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit):
        main(["convert", str(unknown), str(tmp_path / "strict"), "--strict"])
    err = capsys.readouterr().err
    assert "new_knob=7" in err and "--strict refuses" in err and not (tmp_path / "strict").exists()
    with pytest.warns(match="new_knob=7"):
        result = _run(capsys, "convert", str(unknown), str(tmp_path / "lenient"))
    assert result["unknown_fields"] == ["new_knob=7"]
    help_text = _help(capsys)
    assert "--strict" in help_text and "--verify" in help_text


def _help(capsys) -> str:
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    return capsys.readouterr().out


def test_transformers_logits_are_what_the_check_compares(llama_dir):
    from torch_bridge._verify import transformers_logits, verify_tokens

    config = torch_bridge.config_from_hf(llama_dir)
    ids = verify_tokens(config)
    theirs = transformers_logits(llama_dir, "float32", ids)
    np.testing.assert_allclose(theirs, tm.torch_logits(tm.tiny_llama(), ids), atol=1e-6)
