"""GPU compile targets: the train step compiled by XLA:GPU on this CPU-only machine.

Every test but the first few is marked ``gpu_compile``: it needs the ``gpu-aot`` extra
(``make test`` installs it) and skips, with the reason, without it.
"""

import json

import jax
import pytest

from jaxckpt import attention, nn, plan, remat
from jaxckpt.cli import main
from jaxckpt.plan._compile import compile_report

TINY = nn.TransformerConfig.preset("tiny", dtype="bfloat16", param_dtype="bfloat16")
PLAN_TINY = ["plan", "--model", "tiny", "--batch", "2", "--seq", "32", "--dtype", "bfloat16",
             "--param-dtype", "bfloat16", "--json"]  # fmt: skip
"""``tiny()`` as ``jaxckpt plan`` flags. The step every test here compiles is the one the planner
compiles first (no remat): ``compile_report`` and ``compile_step`` are cached per process, and a
deviceless XLA:GPU compile (seconds) is never written to the persistent cache, so the tests and
the CLI share them (``compiled`` keys ``compile_step`` as ``plan.measure`` does)."""


def tiny(**kw) -> plan.Workload:
    return plan.Workload(TINY, batch=kw.pop("batch", 2), seq=kw.pop("seq", 32), **kw)


def compiled(workload: plan.Workload, target: str, gemm: str = "default") -> jax.stages.Compiled:
    """``plan.compile_step`` without remat (the spec the planner tries first) for a GPU target,
    called as ``compile_report`` calls it, so that ``plan.measure``'s compile is this one."""
    return plan.compile_step(
        workload, remat.get("none"), target=plan.gpu_target(target), gemm=gemm, autotune_results=None
    )


def test_every_target_is_shipped_with_its_source_and_a_device_preset():
    for name, target in plan.TARGETS.items():
        if target.platform != "gpu":
            continue
        text = target.config_text()
        assert "Source: openxla/xla, xla/backends/gpu/target_config/specs/" in text, name
        assert "collective_memory_granularity" not in text.replace("`collective_memory_granularity", ""), name
        assert f'device_description_str: "{target.description}"' in text, name
        assert name in plan.DEVICES, name  # the planner's budget and FLOP rate for it


def test_unknown_targets_and_platforms_are_refused_by_name():
    with pytest.raises(
        ValueError, match="target='h100' is not a GPU compile target; valid targets: h100-80g"
    ):
        plan.gpu_target("h100")
    with pytest.raises(ValueError, match="target='cuda' is not a platform"), attention.compiling_for("cuda"):
        pass
    with pytest.raises(FileNotFoundError, match=r"autotune_results='no-such\.pb'"):
        plan.measure(tiny(), "full", target="h100-80g", autotune_results="no-such.pb")
    with pytest.raises(ValueError, match="autotune_results are XLA:GPU's"):
        plan.measure(tiny(), "full", autotune_results="no-such.pb")


def test_compiling_for_restores_the_platform():
    before = attention.platform()
    with attention.compiling_for("gpu"):
        assert attention.platform() == "gpu"
    assert attention.platform() == before


@pytest.mark.gpu_compile
@pytest.mark.parametrize("name", [n for n, t in plan.TARGETS.items() if t.platform == "gpu"])
def test_compile_step_on_each_target(name):
    devices = plan.target_devices(name)
    assert devices[0].device_kind == plan.TARGETS[name].description
    step = compiled(tiny(), name)
    analysis = step.memory_analysis()
    assert analysis.temp_size_in_bytes > 0 and analysis.alias_size_in_bytes > 0  # the state is donated
    assert "__triton_nested_gemm_fusion" in step.as_text()  # XLA:GPU's matmuls


@pytest.mark.gpu_compile
def test_measure_brackets_the_gemm_emitters_and_says_where_it_came_from():
    report = plan.measure(tiny(), "none", target="h100-80g")  # compiles "default" and "cublas"
    assert report.measured_on == "xla-gpu:h100-80g"
    low, high = report.peak_range
    assert low <= high == report.peak
    cublas = compiled(tiny(), "h100-80g", gemm="cublas").as_text()  # measure's compile
    assert "__cublas$" in cublas and "__triton_nested_gemm_fusion" not in cublas
    assert plan.measure(tiny(), "none").measured_on == "xla-cpu"


@pytest.mark.gpu_compile
def test_fsdp_compiles_over_a_gpu_topology():
    one, two = (compiled(tiny(devices=d), "h100-80g") for d in (1, 2))
    one, two = one.memory_analysis(), two.memory_analysis()
    assert two.argument_size_in_bytes < 0.75 * one.argument_size_in_bytes  # each holds its shard


@pytest.mark.gpu_compile
def test_offloaded_activations_leave_the_gpu_and_are_reported_in_host_memory():
    workload = plan.Workload(TINY.replace(n_layers=2), batch=2, seq=40)
    kept = compile_report(workload, remat.get("minimal"), plan.gpu_target("h100-80g"))
    moved = compile_report(workload, remat.get("offload_minimal"), plan.gpu_target("h100-80g"))
    assert kept.host_temp == 0 and moved.host_temp > 0
    assert moved.temp < kept.temp  # what went to the host is off the device's figure


def _plan_json(capsys, *flags) -> dict:
    status = main([*PLAN_TINY, *flags])
    assert status == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.gpu_compile
def test_plan_cli_names_the_compiler_of_every_figure(capsys):
    gpu = _plan_json(capsys, "--device", "h100-80g")
    assert gpu["measured_on"] == "xla-gpu:h100-80g" and gpu["chosen"]["measured_on"] == "xla-gpu:h100-80g"
    assert {a["measured_on"] for a in gpu["attempts"]} == {"xla-gpu:h100-80g"}
    assert gpu["caveat"] == plan.AUTOTUNE_CAVEAT and gpu["offload_rows"] == "shown"
    assert _plan_json(capsys, "--device", "ascend-910")["measured_on"] == "xla-cpu"
    checked = _plan_json(capsys, "--device", "a100-40g", "--remat", "none")
    assert checked["measured_on"] == "xla-gpu:a100-40g"
    budget = gpu["chosen"]["measured_bytes"] - 1  # --budget with --device: that GPU, a smaller budget
    tight = _plan_json(capsys, "--device", "h100-80g", "--budget", str(budget))
    assert tight["chosen"]["measured_bytes"] <= budget == tight["budget_bytes"]
    assert tight["measured_on"] == "xla-gpu:h100-80g"


def test_plan_cli_without_the_extra_says_it_measured_with_xla_cpu(capsys, monkeypatch):
    monkeypatch.setattr(plan, "aot_unavailable", lambda target: "the JAX CUDA plugin is not installed")
    result = _plan_json(capsys, "--device", "h100-80g")
    assert result["measured_on"] == "xla-cpu"
    assert "measured with XLA:CPU, not XLA:GPU: the JAX CUDA plugin is not installed" in result["notes"]


def test_autotune_results_need_a_gpu_device(capsys):
    flags = ["--model", "tiny", "--batch", "2", "--seq", "32", "--device", "cpu", "--autotune-results", "f"]
    with pytest.raises(SystemExit) as exit_:
        main(["plan", *flags])
    assert exit_.value.code == 2
    assert "--autotune-results needs a GPU --device" in capsys.readouterr().err


def test_cpu_compile_step_refuses_more_devices_than_the_process_has():
    with pytest.raises(ValueError, match=r"workload.devices=16 but this process has 8 devices"):
        plan.compile_step(tiny(batch=16, devices=16), "full")
    assert len(jax.devices()) == 8
