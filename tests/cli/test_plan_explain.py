"""``jaxckpt plan --explain --plot``: the top contributors at the peak, the timeline drawn.

The two runs that compile check the tiny model's ``--remat full`` step (a few seconds each);
the argument errors compile nothing.
"""

import json

import pytest

from jaxckpt.cli import main

CHECK = ["plan", "--model", "tiny", "--batch", "1", "--seq", "37", "--budget", "20MiB", "--remat", "full"]


@pytest.mark.slow
def test_explain_json_agrees_with_the_measured_peak(capsys, tmp_path):
    plot = tmp_path / "peak.png"
    assert main([*CHECK, "--explain", "--plot", str(plot), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)  # one JSON document: the drawing prints nothing
    why = result["explain"]
    assert why["peak_bytes"] == result["measured_bytes"]  # explain compiles the step measure did
    assert why["timeline_peak"] == pytest.approx(why["peak_bytes"], rel=0.02)
    assert why["attributed"] >= 0.95
    assert {"parameters", "optimizer state", "gradients", "residual: layer_input"} <= set(why["at_peak"])
    assert why["top"][0]["category"] == "optimizer state"  # AdamW's two moments
    assert plot.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_explain_prints_the_table_and_draws_the_page(capsys, tmp_path):
    page = tmp_path / "peak.html"
    assert main([*CHECK, "--explain", "--plot", str(page)]) == 0
    out = capsys.readouterr().out
    assert "At the peak (xla-cpu" in out and "optimizer state" in out and "of the compiler's peak" in out
    assert f"timeline drawn into {page}" in out
    assert "tiny full: peak " in page.read_text()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--plot", "peak.svg"], "--plot peak.svg: the suffix '.svg' is not one of .html, .png"),
        (["--force"], "--force replaces the file --plot FILE draws: give --plot"),
        (["--plot", "EXISTING"], "exists; give --force to replace it"),
    ],
)
def test_bad_plot_arguments_exit_2_before_compiling(extra, message, capsys, tmp_path):
    existing = tmp_path / "peak.html"
    existing.write_text("mine")
    extra = [str(existing) if arg == "EXISTING" else arg for arg in extra]
    with pytest.raises(SystemExit) as exc:
        main([*CHECK, "--explain", *extra])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert existing.read_text() == "mine"


def test_explain_refuses_max_seq(capsys):
    argv = ["plan", "--model", "tiny", "--batch", "1", "--max-seq", "--budget", "20MiB", "--explain"]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "--explain and --plot show one step: give --seq N, not --max-seq" in capsys.readouterr().err
