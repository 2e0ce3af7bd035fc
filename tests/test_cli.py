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
