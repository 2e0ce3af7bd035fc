"""``benchmarks/gpu_check.py``: its ``--smoke`` dry run works end to end on the CPU, and without
``--smoke`` it refuses to run where there is no GPU backend.

The check itself is meant for one H200 run with a hard time budget; the smoke run proves, before
anyone spends GPU time on it, that every part (the bf16 attention contract, attention TFLOP/s,
the train step with the deviceless predictions beside it) runs and writes its section of the
JSON. That is all only this test checks, so the smoke runs each part on the fewest items that
write every field: every contract case on blockwise and one on each other implementation, one
sequence length, two train presets and each model once (tests/attention and tests/train check
every case and preset), in the fewest processes: one child runs every GPU job in turn (on the GPU
each is a fresh process, for its allocator peak, which the CPU does not report), and one the
predictions. The refusal without ``--smoke`` happens before any of that: it is checked by calling
the script's ``main`` in this process (the smoke test runs the real script).
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from jaxckpt import plan

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
SECTIONS = ("meta", "contract", "throughput", "pallas", "train", "jobs")
TRAIN_JOBS = [("llama3.2-1b", "none"), ("llama3.2-1b", "full"), ("small", "none")]


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    cmd = [sys.executable, str(SCRIPT), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.slow
def test_smoke_runs_every_part_and_writes_every_section(tmp_path):
    out = tmp_path / "gpu_check.json"
    # A budget far above the smoke's need: on a loaded machine no item may be skipped for time.
    proc = _run("--smoke", "--out", str(out), "--budget-s", "1500", timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert set(SECTIONS) <= set(result), sorted(result)
    assert result["meta"]["smoke"] and result["meta"]["backend"] == "cpu"
    assert all(job["rc"] == 0 for job in result["jobs"]), [(j["name"], j["rc"]) for j in result["jobs"]]

    impls = result["meta"]["implementations"]
    assert "blockwise" in impls
    for impl in impls:
        counts = result["contract"]["summary"][impl]
        assert counts["pass"] >= 1 and counts["fail"] == counts["error"] == 0, (impl, counts)
        assert counts["pass"] + counts["skipped"] == 10, (impl, counts)  # one row per case
    assert result["contract"]["summary"]["blockwise"]["pass"] == 10  # it supports every feature

    speed = result["throughput"]["rows"]
    assert {r["implementation"] for r in speed} == set(impls)
    assert all(r["status"] == "ok" and r["tflops"] > 0 for r in speed), speed

    pallas = {r["implementation"]: r for r in result["pallas"]["rows"]}  # one shape in the smoke
    for impl in ("pallas", "jax_pallas_mha"):
        assert pallas[impl]["status"] == "ok" and pallas[impl]["fwd+bwd"]["tflops"] > 0, pallas[impl]
    assert result["pallas"]["summary"]["rows"][0]["fwd_bwd_vs_jax_pallas_mha"] > 0

    train = result["train"]["rows"]  # "none": the base of the ratios; "full": the deviceless compile
    assert [(r["model"], r["remat"]) for r in train] == TRAIN_JOBS
    for row in train:
        assert row["status"] == "ok" and row["tokens_per_s"] > 0 and row["loss_finite"], row
        assert row["predict"]["total"] > 0
        assert row["measured_peak"] is None  # the CPU has no allocator statistics
        if row["remat"] == "full" and plan.gpu_aot_unavailable() is None:  # deviceless: "full" only
            assert row["deviceless"]["measured_on"] == "xla-gpu:h200-141g", row


def _main_in_process(*args: str) -> int:
    """The script's ``main(args)`` in this process, with ``_run``'s environment: its module-level
    settings (``os.environ``, ``sys.path``) are undone afterwards. The smoke test above runs the
    script as a real process, end to end; this saves a second process's start-up (imports)."""
    saved_path = list(sys.path)
    try:
        with mock.patch.dict(os.environ, {"JAX_PLATFORMS": "cpu", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}):
            sys.path.insert(0, str(SCRIPT.parent))  # as for a script: its directory first
            spec = importlib.util.spec_from_file_location("gpu_check_in_process", SCRIPT)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module.main(list(args))
    finally:
        sys.path[:] = saved_path


@pytest.mark.slow
def test_without_smoke_on_the_cpu_it_refuses_with_exit_2(tmp_path, capsys):
    out = tmp_path / "gpu_check.json"
    status = _main_in_process("--out", str(out))
    captured = capsys.readouterr()
    assert status == 2, captured.out[-2000:] + captured.err[-2000:]
    assert "needs a GPU backend" in captured.err and "--smoke" in captured.err, captured.err[-2000:]
    assert not out.exists()
