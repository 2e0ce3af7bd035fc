"""``jaxckpt plan``: the table, the JSON schema, and its errors.

Each run that plans compiles the tiny model once or twice (a few seconds each), so
there are four of them; the argument errors compile nothing.
"""

import json

import pytest

from jaxckpt import remat
from jaxckpt.cli import main

FITS = ["plan", "--model", "tiny", "--batch", "2", "--seq", "64", "--budget", "20MiB"]
"""Between full remat (15.2 MiB predicted) and none (21.4 MiB): the solver picks a spec."""
TOO_SMALL = ["plan", "--model", "tiny", "--batch", "1", "--seq", "32", "--budget", "12MiB"]
"""Below params + gradients + AdamW state (12.1 MiB; XLA measures 13.2 MiB under full remat):
nothing fits."""
ROW_KEYS = {
    "remat": str,
    "params_bytes": int,
    "grads_bytes": int,
    "optimizer_bytes": int,
    "activation_bytes": int,
    "total_bytes": int,
    "fits": bool,
    "recompute_flops": int,
}


def _run(argv, capsys):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _check_rows(rows):
    names = [r["remat"] for r in rows]
    assert set(names) >= {"none", "full", "dots", "save_attn", "minimal", "ratio_0.25"}
    assert len(names) == len(set(names))
    for row in rows:
        for key, kind in ROW_KEYS.items():
            assert type(row[key]) is kind, (row["remat"], key, row[key])
        parts = ("params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes")
        assert sum(row[k] for k in parts) <= row["total_bytes"]  # plus the token batch
    return {r["remat"]: r for r in rows}


@pytest.mark.slow
def test_json_fitting_budget_chooses_a_spec_that_xla_confirms(capsys):
    code, out, _ = _run([*FITS, "--json"], capsys)
    assert code == 0
    result = json.loads(out)
    assert {"budget_bytes", "minimum_bytes", "rows", "chosen"} <= set(result)
    assert result["budget_bytes"] == 20 * 2**20
    rows = _check_rows(result["rows"])
    chosen = result["chosen"]
    assert set(chosen) == {
        "remat", "spec", "predicted_bytes", "measured_bytes", "host_bytes", "measured_host_bytes",
        "measured_on", "recompute_flops", "devices", "batch", "micro_batches",
        "measured_flops", "measured_bytes_accessed",  # XLA's cost analysis; no roofline: no --device
    }  # fmt: skip
    assert chosen["measured_flops"] > 0 and all(r["estimated_seconds"] is None for r in result["rows"])
    assert (chosen["batch"], chosen["micro_batches"], chosen["host_bytes"]) == (2, 1, 0)
    assert chosen["measured_on"] == result["measured_on"] == "xla-cpu"
    assert all(isinstance(chosen[k], int) for k in ("predicted_bytes", "measured_bytes", "recompute_flops"))
    assert chosen["measured_bytes"] <= result["budget_bytes"]
    assert chosen["remat"] in rows and rows[chosen["remat"]]["fits"]
    assert not rows["none"]["fits"] and rows["full"]["fits"]
    # the least recompute among the rows that fit (presets included)
    fitting = [
        r["recompute_flops"] for r in rows.values() if r["fits"] and not r["remat"].startswith("offload")
    ]
    assert chosen["recompute_flops"] == min(fitting)
    assert result["minimum_bytes"] == min(r["total_bytes"] for r in rows.values())
    assert json.loads(json.dumps(chosen["spec"])) == chosen["spec"]
    (compiled,) = [a for a in result["attempts"] if a["chosen"]]
    assert compiled["measured_bytes"] == chosen["measured_bytes"]  # what was compiled


@pytest.mark.slow
def test_table_marks_the_chosen_row_with_its_measured_peak(capsys):
    code, out, _ = _run(FITS, capsys)
    assert code == 0
    starred = [line for line in out.splitlines() if line.strip().startswith("* ")]
    assert len(starred) == 2  # the row, and the line that says what it keeps
    assert "compiled (predicted -> XLA:CPU): " in out
    assert starred[0].rstrip().endswith("MiB") and "yes" in starred[0]
    lines = out.splitlines()
    for name in remat.PRESETS:  # one unwrapped line per row: name, sizes, fits, recompute
        if remat.has_pinned_host() or not remat.PRESETS[name].offload:
            assert any(f" {name} " in line and line.rstrip().endswith("%") for line in lines), name
    for text in ("Budget 20.00 MiB", "smallest peak", "XLA:CPU", "recompute"):
        assert text in out
    if remat.has_pinned_host():  # the offload rows' host memory in a column of its own
        header = next(line for line in lines if "recompute" in line and "remat" in line)
        assert " host " in header


@pytest.mark.slow
def test_infeasible_budget_prints_the_table_then_minimum_and_exits_1(capsys):
    code, out, err = _run(TOO_SMALL, capsys)
    assert code == 1
    rows = [line for line in out.splitlines() if line.rstrip().endswith("%")]
    assert len(rows) >= 8 and all(" no " in line for line in rows)
    assert "no remat spec fits --budget 12.00 MiB" in err and "smallest peak is" in err
    assert "What would fit" in err
    assert "What would fit: --optimizer adafactor" in err  # the planner's optimizer=adafactor, as a flag
    assert "Traceback" not in err


@pytest.mark.slow
def test_infeasible_budget_json_has_no_choice_and_the_error(capsys):
    code, out, _ = _run([*TOO_SMALL, "--json"], capsys)
    assert code == 1
    result = json.loads(out)
    assert result["chosen"] is None
    assert "smallest peak is" in result["error"]
    assert "What would fit: --optimizer adafactor" in result["error"]
    rows = _check_rows(result["rows"])
    assert not any(r["fits"] for r in rows.values())
    assert result["minimum_bytes"] > result["budget_bytes"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--budget", "1GB", "--devices", "2"], "Workload: --batch 1 must be a multiple of --devices 2"),
        (["--budget", "12XB"], "--budget: size '12XB'"),
        (["--device", "tpu-v9"], "--device 'tpu-v9' is unknown; valid devices: ascend-910,"),
        (["--budget", "1GB", "--optimizer", "lion"], "--optimizer: invalid choice"),
        (["--budget", "1GB", "--micro-batches", "0"], "Workload: --micro-batches 0 must be a positive int"),
        (["--budget", "1GB", "--headroom", "1"], "--headroom: must be a fraction in [0, 1)"),
        ([], "give --device (its memory is the budget) or --budget, or both"),
    ],
)
def test_bad_arguments_exit_2_naming_the_argument(extra, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--model", "tiny", "--batch", "1", "--seq", "16", *extra])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.slow
def test_devices_plans_per_device_compiled_over_simulated_devices(capsys):
    """Per device over 2 of the test process's 8 CPU devices (a process with fewer compiles in
    a subprocess: ``test_plan_measure`` checks that path against this one)."""
    code, out, _ = _run(["plan", "--model", "tiny", "--batch", "2", "--seq", "64", "--budget", "12MiB",
                         "--devices", "2", "--json"], capsys)  # fmt: skip
    assert code == 0
    result = json.loads(out)
    one_device = json.loads(_run([*FITS, "--json"], capsys)[1])
    rows, single = _check_rows(result["rows"]), _check_rows(one_device["rows"])
    assert rows["full"]["params_bytes"] * 2 == single["full"]["params_bytes"]
    assert rows["full"]["optimizer_bytes"] < single["full"]["optimizer_bytes"] * 0.51
    assert rows["none"]["activation_bytes"] < single["none"]["activation_bytes"] * 0.6  # batch split too
    chosen = result["chosen"]
    assert chosen["devices"] == 2 and chosen["measured_bytes"] <= 12 * 2**20
    assert result["config"]["devices"] == 2
