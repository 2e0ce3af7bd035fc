"""``jaxckpt train --config FILE``: a run file (YAML, TOML or JSON) whose keys are the flags;
the flags typed override it; ``--print-config`` prints the resolved run, which reads back as
the same run; a run with ``--checkpoint-dir`` saves it there as ``run.yaml``."""

import json

import pytest
import yaml

from jaxckpt.cli import main

TRAIN = ["--layers", "1", "--batch", "2", "--seq", "16", "--steps", "2"]  # test_cli's tiny run


def _printed(capsys, *argv) -> dict:
    assert main(["train", *argv, "--print-config"]) == 0
    return yaml.safe_load(capsys.readouterr().out)


def _fails(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exc:
        main(["train", *argv])
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_a_printed_run_reads_back_as_the_same_run_and_flags_override_it(tmp_path, capsys):
    run = _printed(capsys, *TRAIN, "--lora", "4", "--optimizer", "sgd", "--force")
    assert run["steps"] == 2 and run["lora"] == 4 and run["optimizer"] == "sgd" and run["force"] is True
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(run))
    assert _printed(capsys, "--config", str(path)) == run
    assert _printed(capsys, "--config", str(path), "--steps", "7") == {**run, "steps": 7}


@pytest.mark.parametrize("suffix", [".toml", ".json", ".yml"])
def test_toml_json_and_yml_run_files_hold_the_same_keys(tmp_path, capsys, suffix):
    text = {
        ".toml": 'steps = 3\ncheckpoint-dir = "out"\nresume = true\n',
        ".json": json.dumps({"steps": 3, "checkpoint_dir": "out", "resume": True}),
        ".yml": "steps: 3\ncheckpoint_dir: out\nresume: true\n",
    }[suffix]
    path = tmp_path / f"run{suffix}"
    path.write_text(text)
    run = _printed(capsys, "--config", str(path))
    assert (run["steps"], run["checkpoint_dir"], run["resume"]) == (3, "out", True)


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("run.yaml", "steps: 3\nstpes: 4\n", "unknown key 'stpes'"),
        ("run.yaml", "steps: three\n", "--steps: invalid int value: 'three'"),
        ("run.yaml", "optimizer: lion\n", "--optimizer: invalid choice: 'lion'"),
        ("run.yaml", "resume: 1\n", "resume must be true or false"),
        ("run.yaml", "- 1\n- 2\n", "must hold a mapping of flags, got list"),
        ("run.yaml", "steps: [3\n", "is not valid yaml"),
        ("run.toml", "steps = \n", "is not valid toml"),
        ("run.ini", "steps=3\n", "a run file ends in .yaml, .yml, .toml, .json"),
    ],
)
def test_a_bad_run_file_is_refused_in_one_line_naming_the_file_and_key(tmp_path, capsys, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    err = _fails(capsys, "--config", str(path))
    assert message in err and "Traceback" not in err, err
    if "invalid" not in message:  # argparse's own refusals name the flag; ours name the file
        assert str(path) in err and len(err.strip().splitlines()) == 1, err


def test_a_missing_run_file_is_named(tmp_path, capsys):
    err = _fails(capsys, "--config", str(tmp_path / "nope.yaml"))
    assert "nope.yaml" in err and "Traceback" not in err


def test_training_from_a_run_file_saves_the_resolved_run_beside_the_checkpoints(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text("layers = 1\nbatch = 2\nseq = 16\nsteps = 5\njson = true\n")
    out = tmp_path / "c"
    assert main(["train", "--config", str(path), "--steps", "2", "--checkpoint-dir", str(out)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [s["step"] for s in result["steps"]] == [0, 1]  # the flag's 2, not the file's 5
    saved = yaml.safe_load((out / "run.yaml").read_text())
    assert saved == _printed(capsys, "--config", str(path), "--steps", "2", "--checkpoint-dir", str(out))
    assert saved["steps"] == 2 and saved["checkpoint_dir"] == str(out)


def test_other_subcommands_keep_their_own_config_flag(tmp_path):
    """``convert --config`` is a Hugging Face config.json, not a run file."""
    from jaxckpt.cli._main import build_parser
    from jaxckpt.cli._run_file import with_run_file

    argv = ["convert", "in.bin", "out", "--config", str(tmp_path / "config.json")]
    assert with_run_file(build_parser(), argv) == argv
