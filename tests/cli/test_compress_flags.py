"""``--compress int8|fp8`` and ``--compress-tags`` on ``train``, ``compare`` and ``plan``, and
``plan --allow-compress``: the flags reach the run, the spec and the planner, and bad
combinations are refused naming the flag (the library calls are replaced by recorders:
nothing is compiled here)."""

from types import SimpleNamespace

import pytest
import yaml

import jaxckpt.compare
import jaxckpt.plan
from jaxckpt import remat, train
from jaxckpt.cli import main
from jaxckpt.cli._flags import flag_message
from jaxckpt.cli._plan_table import chosen_line
from jaxckpt.remat import Tag

PLAN = ["plan", "--model", "tiny", "--batch", "1", "--seq", "16", "--budget", "1GiB"]


class Recorded(Exception):
    """Raised by a recorder in place of the library call, with its arguments."""


def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_train_run_file_records_the_compression(tmp_path, capsys):
    argv = ["train", "--remat", "save_attn", "--compress", "fp8", "--compress-tags", "attn_out"]
    assert main([*argv, "--print-config"]) == 0
    run = yaml.safe_load(capsys.readouterr().out)
    assert run["compress"] == "fp8" and run["compress_tags"] == "attn_out"
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(run))
    assert main(["train", "--config", str(path), "--print-config"]) == 0  # reads back the same
    assert yaml.safe_load(capsys.readouterr().out) == run


def test_train_trains_the_compressed_spec(monkeypatch):
    def recorder(config, run, plan=None):
        raise Recorded(run)

    monkeypatch.setattr(train, "train", recorder)
    argv = ["train", "--layers", "1", "--seq", "16", "--remat", "minimal", "--compress", "int8"]
    with pytest.raises(Recorded) as recorded:
        main([*argv, "--compress-tags", "mlp_up,attn_out"])
    (run,) = recorded.value.args
    assert run.compress == "int8" and run.compress_tags == ("attn_out", "mlp_up")
    assert run.remat_spec.compress == {Tag.ATTN_OUT: "int8", Tag.MLP_UP: "int8"}
    assert run.remat_spec.save == remat.get("minimal").save


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--compress-tags", "attn_out"], "--compress-tags attn_out needs --compress"),
        (["--compress", "int8", "--compress-tags", "mlp_up"], "--compress-tags mlp_up: "),
        (["--compress", "int8", "--compress-tags", "nope"], "unknown: nope"),
        (["--remat", "none", "--compress", "int8"], "--compress 'int8' compresses what the remat spec keeps"),
    ],
)
def test_train_refuses_bad_compression(argv, message, capsys):
    err = _error(capsys, ["train", "--layers", "1", "--seq", "16", *argv])
    assert message in err, err


def test_train_refuses_a_tag_the_spec_does_not_keep_naming_it(capsys):
    err = _error(capsys, ["train", "--seq", "16", "--compress", "int8", "--compress-tags", "mlp_up"])
    assert "'mlp_up' is recomputed, not kept" in err and "keeps layer_input" in err, err


def test_flag_table_names_the_compression_flags():
    assert flag_message("compress_tags=a needs compress=") == "--compress-tags a needs --compress"


def test_plan_checks_the_compressed_preset(monkeypatch, capsys):
    seen = []

    def measure(workload, spec, **kwargs):
        seen.append(spec)
        return SimpleNamespace(peak=1, measured_on="xla-cpu", to_dict=dict, collective_bytes=None)

    monkeypatch.setattr(jaxckpt.plan, "measure", measure)
    assert main([*PLAN, "--remat", "save_attn", "--compress", "int8", "--json"]) == 0
    assert seen[0] == remat.compressed("save_attn", "int8")
    out = yaml.safe_load(capsys.readouterr().out)
    assert out["remat"] == "save_attn+int8" and out["compress"] == {"attn_out": "int8", "layer_input": "int8"}


def test_plan_passes_the_compression_to_the_planner(monkeypatch):
    def recorder(workload, budget, **kwargs):
        raise Recorded(kwargs)

    monkeypatch.setattr(jaxckpt.plan, "preset_table", recorder)
    with pytest.raises(Recorded) as recorded:
        main([*PLAN, "--allow-compress", "--compress", "fp8"])
    (kwargs,) = recorded.value.args
    assert kwargs["allow_compress"] is True and kwargs["compress"] == "fp8"
    assert kwargs["compress_tags"] is None
    with pytest.raises(Recorded) as recorded:
        main([*PLAN, "--compress", "int8", "--compress-tags", "layer_input"])
    (kwargs,) = recorded.value.args
    assert kwargs["allow_compress"] is False and kwargs["compress_tags"] == ["layer_input"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--compress-tags", "attn_out"], "--compress-tags attn_out needs --compress"),
        (["--remat", "full", "--allow-compress"], "--allow-compress lets the solver choose"),
        (["--remat", "full", "--compress", "int8", "--compress-tags", "attn_out"], "is recomputed, not kept"),
    ],
)
def test_plan_refuses_bad_compression(argv, message, capsys):
    err = _error(capsys, [*PLAN, *argv])
    assert message in err, err


def test_plan_max_seq_searches_with_the_compression(monkeypatch):
    def recorder(workload, budget, **kwargs):
        raise Recorded(kwargs)

    monkeypatch.setattr(jaxckpt.plan, "max_seq", recorder)
    argv = ["plan", "--model", "tiny", "--batch", "1", "--max-seq", "--budget", "1GiB"]
    with pytest.raises(Recorded) as recorded:
        main([*argv, "--compress", "int8", "--compress-tags", "layer_input"])
    (kwargs,) = recorded.value.args
    assert kwargs["compress"] == "int8" and kwargs["compress_tags"] == ["layer_input"]
    assert kwargs["allow_compress"] is False
    with pytest.raises(Recorded) as recorded:
        main([*argv, "--allow-compress"])
    (kwargs,) = recorded.value.args
    assert kwargs["allow_compress"] is True and kwargs["compress"] is None


def test_chosen_line_lists_compressed_tags_and_bytes():
    chosen = {
        "remat": "solved",
        "spec": {"save": ["attn_out"], "offload": []},
        "measured_bytes": 3 * 2**20,
        "micro_batches": 1,
        "compressed": [
            {"tag": "attn_out", "format": "int8", "bytes": 2**20, "uncompressed_bytes": 2**21},
            {"tag": "layer_input", "format": "int8", "bytes": 2**19, "uncompressed_bytes": 2**20},
        ],
    }
    line = chosen_line(chosen, {"micro_batches": 1}, "XLA:CPU")
    assert "stores attn_out in int8 (1.00 MiB of 2.00 MiB), layer_input in int8 (512.00 KiB of 1.00 MiB)" in (
        line
    )


def test_compare_adds_compressed_rows(monkeypatch):
    seen = []
    monkeypatch.setattr(jaxckpt.compare, "compare", lambda config, **kwargs: seen.append(kwargs) or {})
    assert main(["compare", "--layers", "1", "--compress", "fp8", "--json"]) == 0
    assert seen[0]["compress"] == "fp8"
    rows = jaxckpt.compare._experiment.default_rows("fp8")
    assert ("flash", "save_attn+fp8") in rows and not any(r.startswith("none+") for _, r in rows)
    assert jaxckpt.compare._experiment.remat_spec("full+fp8") == remat.compressed("full", "fp8")
