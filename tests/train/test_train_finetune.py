"""``train`` on data files: the model's tokenizer, packed rows, held-out evaluation, exact
resume of the packed stream, and what the checkpoint directory keeps (tokenizer files,
evaluations, data states)."""

import json

import pytest
from tokenizer_fixtures import corpus_lines, make_tokenizer_dir

from jaxckpt import nn, train
from jaxckpt.cli import main
from jaxckpt.data import load_tokenizer

SMALL = dict(n_layers=1, d_model=32, n_heads=2, ffn_dim=48, max_len=64)


def _jsonl(path, n=60):
    lines = corpus_lines(n)
    with open(path, "w") as f:
        for i, line in enumerate(lines):
            record = {"text": line} if i % 2 else {"prompt": line[:9], "completion": line[9:]}
            f.write(json.dumps(record) + "\n")
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune")
    tokdir = make_tokenizer_dir(root / "tok", "llama3", vocab_size=300)
    return {"root": root, "tokenizer": tokdir, "data": _jsonl(root / "data.jsonl")}


def _config(vocab: int = 320) -> nn.TransformerConfig:
    return nn.TransformerConfig.preset("tiny", **SMALL, vocab_size=vocab)


def _run(files, *, steps: int, data=(), batch=2, seq=24, **fields) -> train.RunConfig:
    """A run on the module's data file with its tokenizer (``data``: more data fields)."""
    data = {"path": files["data"], "tokenizer": files["tokenizer"], **dict(data)}
    return train.RunConfig(steps=steps, batch=batch, seq=seq, data=data, progress=False, **fields)


@pytest.mark.slow
def test_packed_resume_continues_on_exactly_the_uninterrupted_batches(files, tmp_path):
    run = _run(files, steps=7, seed=3)
    whole = train.train(_config(), run)
    first = train.train(_config(), run.replace(steps=4, checkpoint={"dir": tmp_path}))
    rest = train.train(_config(), run.replace(checkpoint={"dir": tmp_path, "resume": True}))
    assert [r["loss"] for r in first.steps + rest.steps] == [r["loss"] for r in whole.steps]
    assert whole.data["kind"] == "packed" and whole.data["documents"] > 0
    assert whole.data == rest.data  # the counts continue across the resume


@pytest.mark.slow  # 2 s or more with the compile cache warm
def test_eval_every_records_the_evaluations_everywhere(files, tmp_path):
    data = {"eval_split": 0.2, "eval_every": 2}
    run = train.train(_config(), _run(files, steps=5, data=data, checkpoint={"dir": tmp_path}))
    assert [e["step"] for e in run.eval] == [2, 4, 5]
    assert all(e["perplexity"] > 1 for e in run.eval)
    meta = json.loads((tmp_path / "jaxckpt.json").read_text())
    assert meta["eval"] == run.to_dict()["eval"] == run.eval
    assert meta["tokenizer"] == "files" and (tmp_path / "tokenizer.json").is_file()
    assert (
        load_tokenizer(tmp_path).encode("hello").tolist()
        == load_tokenizer(files["tokenizer"]).encode("hello").tolist()
    )
    result = train.evaluate(tmp_path, files["data"], batch=2, seq=24)
    assert result["tokens"] > 0 and result["data"]["documents"] == 60


def test_the_tokenizer_must_fit_the_vocabulary(files):
    with pytest.raises(ValueError, match=r"its 307 ids do not fit the model's vocab_size=256"):
        train.train(_config(256), _run(files, steps=1, batch=1, seq=8))
    # eval_every without held-out data is refused when the run is built
    with pytest.raises(ValueError, match=r"data\.eval_every=1 needs held-out data: give data\.eval_path="):
        train.RunConfig(steps=1, batch=1, seq=8, data={"eval_every": 1})


@pytest.mark.slow
def test_cli_train_json_and_eval(files, tmp_path, capsys):
    args = ["train", "--model", "tiny", "--layers", "1", "--data", str(files["data"]), "--seq", "24"]
    args += ["--batch", "2", "--steps", "2", "--tokenizer", "bytes", "--eval-split", "0.3", "--json"]
    args += ["--checkpoint-dir", str(tmp_path / "ckpt")]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert [e["step"] for e in out["eval"]] == [2]
    assert out["data"]["kind"] == "packed" and out["data"]["tokenizer"] == "bytes"
    assert 0 < out["data"]["padded_efficiency"] <= out["data"]["packing_efficiency"] <= 1
    assert main(["eval", str(tmp_path / "ckpt"), "--data", str(files["data"]), "--seq", "24", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["data"]["tokenizer"] == "bytes"
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"txt": "oops"}\n')
    with pytest.raises(SystemExit) as exit_:
        main(["eval", str(tmp_path / "ckpt"), "--data", str(tmp_path / "bad.jsonl"), "--seq", "24"])
    assert exit_.value.code == 2
    assert "bad.jsonl:2: " in capsys.readouterr().err


@pytest.mark.slow
def test_the_metadata_keeps_the_data_states_of_the_kept_checkpoints_only(files, tmp_path):
    train.train(_config(), _run(files, steps=5, checkpoint={"dir": tmp_path, "every": 1}))
    meta = json.loads((tmp_path / "jaxckpt.json").read_text())
    assert sorted(meta["data_states"], key=int) == ["3", "4", "5"]  # orbax keeps the newest 3
