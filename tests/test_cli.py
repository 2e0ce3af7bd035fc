"""The ``jaxckpt`` command line."""

import json

import pytest

from jaxckpt.cli import main


def test_info_json_lists_implementations(capsys):
    assert main(["info", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    impls = report["attention_implementations"]
    assert impls["blockwise"] == "available"
    assert impls["reference"] == "available"
    assert set(impls) >= {"blockwise", "reference", "xla", "cudnn"}


def test_info_text_names_usable_implementations(capsys):
    assert main(["info"]) == 0
    assert "usable here: blockwise" in capsys.readouterr().out


def test_unknown_subcommand_exits_with_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["no-such-command"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.slow
def test_compare_json_schema(capsys):
    argv = [
        "compare",
        "--config",
        "tiny",
        "--layers",
        "1",
        "--batch",
        "1",
        "--seq",
        "16",
        "--steps",
        "1",
        "--json",
    ]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["config"]["seq"] == 16 and result["config"]["n_layers"] == 1
    rows = result["rows"]
    pairs = [(r["attention"], r["remat"]) for r in rows]
    assert pairs[0] == ("reference", "none")
    for attention in ("reference", "flash"):
        for remat in ("none", "full", "dots", "save_attn", "minimal", "ratio_0.25"):
            assert (attention, remat) in pairs
    keys = {"attention", "remat", "temp_bytes", "step_seconds", "tokens_per_second", "loss", "max_grad_diff"}
    for row in rows:
        assert keys <= set(row)
        assert row["temp_bytes"] > 0 and row["step_seconds"] > 0 and row["max_grad_diff"] <= 1e-5


def test_compare_table_renders():
    from jaxckpt.cli._compare import table

    row = dict(attention="flash", remat="full", temp_bytes=2**20, memory_saved=0.5, step_seconds=0.1)
    row |= dict(tokens_per_second=10.0, speed_ratio=0.5, loss=1.0, max_grad_diff=0.0)
    config = dict(
        family="llama", d_model=8, n_layers=1, n_heads=1, ffn_dim=8, batch=1, seq=8, dtype="float32"
    )
    config |= dict(backend="cpu", steps=1)
    assert table({"config": config, "rows": [row]}).row_count == 1


def test_train_json_schema(capsys, tmp_path):
    argv = ["train", "--layers", "1", "--batch", "2", "--seq", "16", "--steps", "2", "--json"]
    assert main([*argv, "--checkpoint-dir", str(tmp_path / "c")]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [s["step"] for s in result["steps"]] == [0, 1]
    assert all({"step", "loss", "step_seconds"} <= set(s) for s in result["steps"])
    assert result["temp_bytes"] > 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--remat", "nope"], "unknown remat preset 'nope'"),
        (["train", "--config", "huge"], "unknown config preset 'huge'"),
        (["train", "--attention", "nope", "--steps", "1", "--seq", "8"], "nope"),
        (["train", "--seq", "5000"], "max_len"),
        (["train", "--data", "missing.txt", "--steps", "1"], "missing.txt"),
        (["compare", "--seq", "5000"], "max_len"),
    ],
)
def test_bad_input_exits_with_a_clear_error(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
