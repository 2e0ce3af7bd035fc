"""The issue's bad inputs of fine-tuning, each through the command line: one line naming the
file, line or field, no traceback, exit status 2."""

import json
import shutil

import pytest
from tokenizer_fixtures import make_tokenizer_dir

from jaxckpt import nn, train
from jaxckpt.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A trained checkpoint with a real tokenizer (max_len 40), and one without a tokenizer."""
    root = tmp_path_factory.mktemp("bad")
    tok = make_tokenizer_dir(root / "tok", "qwen2.5", vocab_size=300)
    data = root / "ok.jsonl"
    data.write_text("".join(json.dumps({"text": f"line {i} of the data"}) + "\n" for i in range(9)))
    cfg = nn.TransformerConfig.preset("tiny", n_layers=1, d_model=32, n_heads=2, ffn_dim=48, max_len=40)
    cfg = cfg.replace(vocab_size=320)
    run = train.RunConfig(steps=1, batch=1, seq=16, data={"path": data, "tokenizer": tok}, progress=False)
    train.train(cfg, run.replace(checkpoint={"dir": root / "ckpt"}))
    shutil.copytree(root / "ckpt", root / "bare")  # the same run, without its tokenizer below
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (root / "bare" / name).unlink(missing_ok=True)
    meta = json.loads((root / "bare" / "jaxckpt.json").read_text())
    (root / "bare" / "jaxckpt.json").write_text(json.dumps({**meta, "tokenizer": "files"}))
    return root


def _error(capsys, args) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def _eval(model_dir, data):
    return ["eval", str(model_dir / "ckpt"), "--data", str(data), "--seq", "16"]


@pytest.mark.slow
def test_a_jsonl_line_that_is_not_json_names_file_and_line(model_dir, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n\n{"text": oops}\n')
    assert "bad.jsonl:3: not JSON" in _error(capsys, _eval(model_dir, bad))


@pytest.mark.slow  # 2 s or more with the compile cache warm
def test_a_record_without_the_fields_names_them_and_the_shapes(model_dir, tmp_path, capsys):
    bad = tmp_path / "fields.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no"}\n')
    err = _error(capsys, _eval(model_dir, bad))
    assert "fields.jsonl:2" in err and "body" in err and '"messages"' in err and '"prompt"' in err


def test_an_empty_dataset(model_dir, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert "empty.jsonl" in _error(capsys, _eval(model_dir, empty))


def test_a_model_without_a_tokenizer_suggests_the_flag(model_dir, capsys):
    args = ["generate", str(model_dir / "bare"), "--prompt", "hi"]
    assert "--tokenizer" in _error(capsys, args)
    data = model_dir / "ok.jsonl"
    args = [
        "train",
        "--init-from",
        str(model_dir / "bare"),
        "--data",
        str(data),
        "--steps",
        "1",
        "--seq",
        "8",
    ]
    assert "--tokenizer" in _error(capsys, args)


def test_a_chat_record_with_an_unknown_role(model_dir, tmp_path, capsys):
    bad = tmp_path / "chat.jsonl"
    bad.write_text(
        json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]})
    )
    err = _error(capsys, _eval(model_dir, bad))
    assert "chat.jsonl:1" in err and "'bot'" in err and "assistant" in err


def test_a_prompt_longer_than_max_len(model_dir, capsys):
    args = ["generate", str(model_dir / "ckpt"), "--prompt", "word " * 60, "--max-new-tokens", "2"]
    assert "longer than the model's max_len=40" in _error(capsys, args)
