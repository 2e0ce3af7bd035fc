"""The ``jaxckpt`` command line."""

import json

import pytest

from jaxckpt import plan
from jaxckpt.cli import main
from jaxckpt.cli._flags import flag_message
from jaxckpt.cli._main import build_parser


def test_info_json_lists_implementations(capsys):
    assert main(["info", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    impls = report["attention_implementations"]
    assert impls["blockwise"] == "available"
    assert impls["reference"] == "available"
    assert set(impls) >= {"blockwise", "reference", "xla", "cudnn", "splash"}
    targets = report["compile_targets"]
    assert set(targets) == set(plan.TARGETS)  # the GPUs and the TPUs, each available or why not
    assert targets["tpu-v5e"].startswith("available: XLA:TPU TPU v5 lite") or "tpu-aot" in targets["tpu-v5e"]


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
        "--model",
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


@pytest.mark.slow
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
        (["train", "--model", "huge"], "unknown config preset 'huge'"),
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


def test_compare_takes_model_and_its_config_alias():
    parser = build_parser()
    for flag in ("--model", "--config"):
        assert parser.parse_args(["compare", flag, "gpt2"]).model == "gpt2"
    assert parser.parse_args(["compare"]).model == "tiny"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["compare", "--steps", "0"], "jaxckpt compare: error: --steps 0 must be a positive int"),
        (["compare", "--seq", "5000"], "--seq 5000 exceeds the model's config.max_len=1024"),
        (["compare", "--model", "huge"], "unknown config preset 'huge'"),
        (["train", "--mesh", "tensor=2", "--steps", "1"], "--mesh 'tensor=2': unknown axis 'tensor'"),
        # train.RunConfig's checks, at construction (before ByteBatches sees the batch)
        (["train", "--batch", "0", "--steps", "1"], "jaxckpt train: error: --batch 0 must be a positive int"),
        (["train", "--resume", "--steps", "1"], "--resume needs --checkpoint-dir"),
        (
            ["train", "--eval-every", "2", "--steps", "1"],
            "--eval-every 2 needs held-out data: give --eval-data or --eval-split",
        ),
    ],
)
def test_library_errors_name_the_flag(capsys, argv, message):
    """The library names the Python argument (``steps=0``); the command line, its flag."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(
    "message, expected",
    [
        ("steps=0 must be a positive int", "--steps 0 must be a positive int"),
        ("process_id=3 must be < num_processes=2", "--process-id 3 must be < --num-processes 2"),
        ("resume=True needs checkpoint_dir=", "--resume needs --checkpoint-dir"),
        ("checkpoint.resume=True needs checkpoint.dir=", "--resume needs --checkpoint-dir"),
        (
            "data.eval_every=2 needs held-out data: give data.eval_path= or data.eval_split=",
            "--eval-every 2 needs held-out data: give --eval-data or --eval-split",
        ),
        ("checkpoint.every=0 must be a positive int", "--checkpoint-every 0 must be a positive int"),
        ("init_from='x' does not exist", "--init-from 'x' does not exist"),
        ("pass force=True to replace it", "pass --force to replace it"),
        ("mesh={'data': 2} needs 2 devices", "--mesh {'data': 2} needs 2 devices"),
        (
            "needs an explicit checkpoint_dir= (a directory)",
            "needs an explicit --checkpoint-dir (a directory)",
        ),
        ("mesh='data=2,data=2': axis 'data' given twice", "--mesh 'data=2,data=2': axis 'data' given twice"),
        (
            "the mesh's 2 devices, batch=3 and seed='x' or \"seq=1\"",
            "the mesh's 2 devices, --batch 3 and --seed 'x' or \"seq=1\"",
        ),
        # Left alone: bare words, attributes, other names, comparisons.
        ("use a smaller seq", "use a smaller seq"),
        ("config.max_len=9 and q.shape=(1, 2)", "config.max_len=9 and q.shape=(1, 2)"),
        ("sub_steps=3, steps==3, num_steps=1", "sub_steps=3, steps==3, num_steps=1"),
    ],
)
def test_flag_message_rewrites_argument_names(message, expected):
    assert flag_message(message) == expected


def test_flag_message_takes_a_subcommand_table():
    assert (
        flag_message("config='c.json' and steps=1", {"config": "--config"}) == "--config 'c.json' and steps=1"
    )
    assert flag_message("steps=1", {}) == "steps=1"
