"""A checkpoint holding NaN or Inf weights is refused at load, naming the file and the
tensor: a Hugging Face checkpoint at ``jaxckpt convert`` and ``--init-from``, and a
converted jaxckpt checkpoint (params) whose arrays were poisoned after it was written."""

import json

import numpy as np
import orbax.checkpoint as ocp
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch_models as tm  # noqa: E402

from jaxckpt.cli import main  # noqa: E402
from jaxckpt.train import save_checkpoint  # noqa: E402

pytestmark = pytest.mark.torch

POISONED = "model.layers.1.mlp.down_proj.weight"
TRAIN = ["--tokenizer", "bytes", "--steps", "1", "--batch", "1", "--seq", "8", "--json"]


@pytest.fixture(scope="module")
def poisoned_hf(tmp_path_factory):
    """A tiny LLaMA (transformers' own) with one NaN and two Infs in one tensor."""
    model = tm.tiny_llama()
    with torch.no_grad():
        weight = dict(model.named_parameters())[POISONED]
        weight[2, 3], weight[0, 0], weight[1, 1] = float("nan"), float("inf"), -float("inf")
    path = tmp_path_factory.mktemp("poisoned") / "hf"
    model.save_pretrained(path)
    return path


def _refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def test_convert_refuses_a_hugging_face_checkpoint_with_nan_weights(poisoned_hf, tmp_path, capsys):
    err = _refused(["convert", str(poisoned_hf), str(tmp_path / "out"), "--json"], capsys)
    assert f"tensor {POISONED!r} holds 1 NaN and 2 Inf value(s)" in err and "model.safetensors" in err, err
    assert not (tmp_path / "out").exists()


def test_train_init_from_refuses_it_too(poisoned_hf, tmp_path, capsys):
    err = _refused(["train", "--init-from", str(poisoned_hf), *TRAIN], capsys)
    assert f"tensor {POISONED!r} holds 1 NaN and 2 Inf value(s)" in err, err


def test_a_poisoned_jaxckpt_checkpoint_is_refused_by_convert_and_train(tmp_path, capsys):
    clean = tmp_path / "clean"
    tm.tiny_llama().save_pretrained(clean)
    assert main(["convert", str(clean), str(tmp_path / "jax"), "--json"]) == 0
    capsys.readouterr()
    meta = json.loads((tmp_path / "jax" / "jaxckpt.json").read_text())
    tree = ocp.PyTreeCheckpointer().restore((tmp_path / "jax" / "0" / "default").absolute())
    kernel = np.array(tree["blocks"]["mlp"]["down"]["kernel"])
    kernel.flat[4] = np.nan
    tree["blocks"]["mlp"]["down"]["kernel"] = kernel
    save_checkpoint(tmp_path / "bad", 0, tree, meta)
    argv = ["convert", str(tmp_path / "bad"), str(tmp_path / "hf"), "--to", "torch", "--json"]
    err = _refused(argv, capsys)
    assert "tensor 'blocks/mlp/down/kernel' holds 1 NaN and 0 Inf value(s)" in err and "bad" in err, err
    err = _refused(["train", "--init-from", str(tmp_path / "bad"), *TRAIN], capsys)
    assert "tensor 'blocks/mlp/down/kernel' holds 1 NaN" in err, err
