"""TPU compile targets: the train step compiled by XLA:TPU (libtpu) on this CPU-only machine.

The tests that compile are marked ``tpu_compile``: they need the ``tpu-aot`` extra (``make
test`` installs it) and skip, with the reason, without it. A deviceless TPU executable
cannot be read back from the persistent compile cache, so every compile here is shared:
``compile_step`` and ``compile_report`` are cached per process, and the workloads are the
ones the ``jaxckpt plan`` flags below build, so the CLI's compiles are the tests' too.
"""

import importlib.util
import json

import pytest

from jaxckpt import nn, plan, remat
from jaxckpt.cli import main
from jaxckpt.plan._tpu_targets import hbm_overflow

TINY = nn.TransformerConfig.preset("tiny", dtype="bfloat16", param_dtype="bfloat16")
PLAN_TINY = ["plan", "--model", "tiny", "--batch", "3", "--seq", "40", "--dtype", "bfloat16",
             "--param-dtype", "bfloat16", "--json"]  # fmt: skip
"""``tiny()`` as ``jaxckpt plan`` flags (odd sizes: a padded or transposed axis shows)."""


def tiny(**kw) -> plan.Workload:
    return plan.Workload(TINY, batch=kw.pop("batch", 3), seq=kw.pop("seq", 40), **kw)


def test_every_tpu_target_has_a_device_preset_and_a_slice_shape():
    tpus = {n: t for n, t in plan.TARGETS.items() if t.platform == "tpu"}
    assert set(tpus) == {"tpu-v5e", "tpu-v5p", "tpu-v6e", "tpu-v4"}
    for name, target in tpus.items():
        assert name in plan.DEVICES and plan.DEVICES[name].hbm_bandwidth > 0, name
        assert target.measured_on == f"xla-tpu:{name.removeprefix('tpu-')}"
        assert target.caveat == plan.TPU_CAVEAT
    assert plan.TARGETS["tpu-v5e"].topology_name(1) == "v5e:1x1"
    assert plan.TARGETS["tpu-v6e"].topology_name(16) == "v6e:4x4"
    assert plan.TARGETS["tpu-v5p"].topology_name(8) == "v5p:2x2x2"
    assert plan.TARGETS["tpu-v4"].topology_name(8) == "v4:2x2x1"  # two TensorCores a chip
    with pytest.raises(ValueError, match="devices=6: a tpu-v5e slice has a power of two of devices"):
        plan.target_devices("tpu-v5e", 6)
    with pytest.raises(ValueError, match=r"target='tpu-v7' is not a compile target; valid targets: .*v5e"):
        plan.compile_target("tpu-v7")
    with pytest.raises(ValueError, match="target='tpu-v5e' is not a GPU compile target"):
        plan.gpu_target("tpu-v5e")


def test_without_libtpu_the_reason_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real(name, *a)
    )
    reason = plan.tpu_aot_unavailable()
    assert 'pip install "jaxckpt[tpu-aot]"' in reason and "libtpu" in reason
    with pytest.raises(RuntimeError, match=r"jaxckpt\[tpu-aot\]"):
        plan.target_devices("tpu-v5p", 2)


def test_the_overflow_message_is_parsed_to_bytes():
    err = RuntimeError(
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
        "(20.89G) exceeds available HBM (15.75G)."
    )
    assert hbm_overflow(err) == (int(20.89 * 2**30), int(15.75 * 2**30))
    assert hbm_overflow(RuntimeError("RESOURCE_EXHAUSTED: something else")) is None
    assert hbm_overflow(ValueError("exceeds available HBM (15.75G)")) is None  # not the compiler's error


@pytest.mark.tpu_compile
@pytest.mark.parametrize("name", ["tpu-v5e", "tpu-v5p", "tpu-v6e", "tpu-v4"])
def test_compile_only_devices_of_every_generation(name):
    devices = plan.target_devices(name, 4)
    assert len(devices) == 4 and devices[0].device_kind == plan.TARGETS[name].device_kind


@pytest.mark.tpu_compile
def test_measure_reads_xla_tpu_peak_and_cost():
    workload = tiny()
    report = plan.measure(workload, "none", target="tpu-v5e")
    # called as ``compile_report`` calls it (the same ``lru_cache`` key), so this is measure's compile
    compiled = plan.compile_step(
        workload, remat.get("none"), target=plan.TARGETS["tpu-v5e"], gemm="default", autotune_results=None
    )
    analysis = compiled.memory_analysis()
    assert report.measured_on == "xla-tpu:v5e" and report.overflow is None
    hbm = analysis.argument_size_in_bytes + analysis.output_size_in_bytes - analysis.alias_size_in_bytes
    assert report.peak == hbm + analysis.temp_size_in_bytes  # what XLA:TPU's own HBM check adds up
    assert report.compiler_peak == analysis.peak_memory_in_bytes != report.peak  # kept, not trusted
    assert "tpu_custom_call" in compiled.as_text() or "T(8,128)" in compiled.as_text()  # real TPU HLO
    flops, moved = plan.xla_step_cost(report.flops, report.bytes_accessed, workload, "none", target="tpu-v5e")
    assert report.flops < 0.6 * plan.step_flops(workload)  # XLA counts the layer loop's body once
    # made whole, XLA's count is the matmuls' and more (elementwise work, the update): 1.20x here
    assert 0.9 < flops / plan.step_flops(workload) < 1.5 and moved > report.params


@pytest.mark.slow
@pytest.mark.tpu_compile
def test_an_hbm_overflow_is_an_answer_with_the_bytes_needed():
    big = plan.Workload(nn.TransformerConfig.preset("llama2-7b", n_layers=4), batch=1, seq=128)
    report = plan.measure(big, "full", target="tpu-v5e")
    assert report.overflow is not None and "exceeds available HBM (15.75G)" in report.overflow
    assert report.peak > plan.DEVICES["tpu-v5e"].memory  # fp32 params + AdamW: ~13 GiB of state alone
    assert report.peak >= report.params + report.optimizer


def _plan_json(capsys, *flags) -> dict:
    status = main([*PLAN_TINY, *flags])
    assert status == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.tpu_compile
def test_plan_cli_on_a_tpu_names_xla_tpu_and_estimates_time(capsys):
    result = _plan_json(capsys, "--device", "tpu-v5e")
    assert result["measured_on"] == "xla-tpu:v5e" and result["chosen"]["measured_on"] == "xla-tpu:v5e"
    assert result["caveat"] == plan.TPU_CAVEAT
    chosen = result["chosen"]
    assert chosen["measured_flops"] > 0 and chosen["roofline_seconds"] > 0
    assert all(r["estimated_seconds"] > 0 for r in result["rows"])
    none, full = (next(r for r in result["rows"] if r["remat"] == n) for n in ("none", "full"))
    assert full["estimated_seconds"] > none["estimated_seconds"]  # recompute costs time
