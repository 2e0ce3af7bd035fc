"""``--mlp-chunk N`` on ``train``, ``compare`` and ``plan``: the tiled MLP reaches the model each
command builds (the library calls are replaced by recorders: nothing is compiled here)."""

from types import SimpleNamespace

import pytest
import yaml

import jaxckpt.compare
import jaxckpt.plan
from jaxckpt import nn, train
from jaxckpt.cli import main


class Recorded(Exception):
    """Raised by a recorder in place of the library call, with its arguments."""


def test_train_puts_the_chunk_in_the_run_and_the_model(monkeypatch, capsys):
    assert main(["train", "--mlp-chunk", "64", "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["mlp_chunk"] == 64

    def recorder(config, run, plan=None):
        raise Recorded(config, run)

    monkeypatch.setattr(train, "train", recorder)
    with pytest.raises(Recorded) as recorded:
        main(["train", "--layers", "1", "--seq", "16", "--mlp-chunk", "5"])
    config, run = recorded.value.args
    assert run.mlp_chunk == 5 and config.mlp_chunk == 5


def test_plan_measures_the_tiled_model(monkeypatch):
    seen = []

    def measure(workload, remat, **kwargs):
        seen.append(workload)
        return SimpleNamespace(peak=1, measured_on="cpu", to_dict=dict)

    monkeypatch.setattr(jaxckpt.plan, "measure", measure)
    argv = ["plan", "--model", "tiny", "--batch", "1", "--seq", "16", "--budget", "1GiB", "--remat", "full"]
    assert main([*argv, "--mlp-chunk", "7", "--json"]) == 0
    assert seen[0].config.mlp_chunk == 7


def test_compare_runs_the_tiled_model(monkeypatch):
    seen = []
    monkeypatch.setattr(jaxckpt.compare, "compare", lambda config, **kwargs: seen.append(config) or {})
    assert main(["compare", "--layers", "1", "--mlp-chunk", "9", "--json"]) == 0
    assert seen[0] == nn.TransformerConfig.preset("tiny", n_layers=1, mlp_chunk=9)


@pytest.mark.parametrize("command", ["train", "compare", "plan"])
def test_a_chunk_below_one_is_refused_by_the_flag(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--mlp-chunk", "0"])
    assert exc.value.code == 2
    assert "--mlp-chunk: must be a positive integer, got '0'" in capsys.readouterr().err
