"""Absurd requests are refused before anything is compiled (issue 21, section 5).

Each goes through the command line (``main``), as a user types it, and must end in one
line on stderr that names the flag, the value given and the limit, with no traceback.
``compile_count`` proves nothing was compiled on the way: it counts XLA compilations
(and persistent-cache hits) through ``jax.monitoring``, after clearing JAX's in-memory
caches so that a program an earlier test compiled cannot run unseen.

``--budget 1`` is not a refusal but the planner's answer (exit status 1, the table on
stdout): below the bytes the step holds from start to end (parameters, optimizer state,
input tokens) nothing can fit, and the planner says so from that sum, compiling nothing.
``--micro-batches`` needs to divide nothing: ``--batch`` is per micro-batch. What must
divide is the batch by a ``train --mesh``'s devices; and a count whose step's input tokens
alone exceed the machine's memory is refused.
"""

import collections

import jax
import jax.numpy as jnp
import pytest
from jax import monitoring

from jaxckpt import nn, plan, train
from jaxckpt.cli._main import main
from jaxckpt.train._sharding import check_batch_split

COMPILE_EVENTS = ("/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_hits")
"""One XLA compilation, or one program taken from the persistent compilation cache instead."""

_events: collections.Counter = collections.Counter()


def _record(event: str, *args, **kwargs) -> None:
    _events[event] += 1


monitoring.register_event_listener(_record)
monitoring.register_event_duration_secs_listener(_record)

PLAN = ["plan", "--model", "tiny"]
TRAIN = ["train", "--model", "tiny", "--steps", "1"]


@pytest.fixture
def compile_count():
    """A function returning the compilations since the test began (JAX's caches cleared)."""
    jax.clear_caches()
    start = sum(_events[e] for e in COMPILE_EVENTS)
    return lambda: sum(_events[e] for e in COMPILE_EVENTS) - start


def _refused(argv: list[str], capsys) -> str:
    """The one line ``main(argv)`` ends with (exit status 2)."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    return err.strip()


@pytest.mark.slow  # 2 s or more with the compile cache warm
def test_the_counter_sees_a_compile(compile_count):
    assert compile_count() == 0
    (jnp.arange(3) * 2).block_until_ready()  # compiled before by other tests: cleared, so compiled again
    assert compile_count() >= 1


def test_plan_batch_0(capsys, compile_count):
    err = _refused([*PLAN, "--batch", "0", "--seq", "64", "--budget", "20MiB"], capsys)
    assert err == "jaxckpt plan: error: Workload: --batch 0 must be a positive int"
    assert compile_count() == 0


def test_plan_seq_over_max_len(capsys, compile_count):
    err = _refused([*PLAN, "--batch", "2", "--seq", str(10**9), "--budget", "20MiB"], capsys)
    assert "--seq 1000000000 exceeds the model's config.max_len=1024" in err
    assert compile_count() == 0


@pytest.mark.parametrize("budget", ["1", "1B"])
def test_plan_budget_below_the_state_is_answered_without_compiling(budget, capsys, compile_count):
    assert main([*PLAN, "--batch", "2", "--seq", "64", "--budget", budget]) == 1  # "does not fit"
    out, err = capsys.readouterr()
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    w = plan.Workload(nn.TransformerConfig.preset("tiny"), 2, 64)
    held = plan.format_bytes(sum(plan.state_bytes(w)) + w.input_bytes)
    assert err.startswith(
        f"jaxckpt plan: no remat spec fits --budget 1 B: the parameters, optimizer state and input tokens "
        f"alone take {held} for the whole step (nothing compiled)"
    )
    assert "(predicted)" in out  # the table's smallest peak: nothing was measured
    assert compile_count() == 0


def test_plan_budget_from_the_device_names_the_device(capsys, compile_count):
    argv = ["plan", "--model", "llama2-7b", "--batch", "8", "--seq", "2048", "--device", "ascend-910"]
    assert main([*argv, "--json"]) == 1
    out, err = capsys.readouterr()
    assert err.startswith("jaxckpt plan: no remat spec fits --device ascend-910's 29.80 GiB: the parameters")
    assert '"minimum_source": "predicted"' in out
    assert compile_count() == 0


def test_plan_unknown_device_lists_the_known_ones(capsys, compile_count):
    err = _refused([*PLAN, "--batch", "2", "--seq", "64", "--device", "nosuchgpu"], capsys)
    assert err.startswith("jaxckpt plan: error: --device 'nosuchgpu' is unknown; valid devices: ")
    assert all(name in err for name in plan.DEVICES)
    assert compile_count() == 0


def test_train_micro_batches_past_the_machines_memory(capsys, compile_count):
    err = _refused([*TRAIN, "--seq", "32", "--batch", "2", "--micro-batches", str(10**9)], capsys)
    assert err.startswith(
        "jaxckpt train: error: --micro-batches 1000000000 x --batch 2 windows of --seq 32 + 1 tokens take "
        "245.87 GiB per step as int32, more than this machine's "
    )
    assert err.endswith("of memory; use fewer micro-batches")
    assert compile_count() == 0


def test_train_seq_over_max_len(capsys, compile_count):
    err = _refused([*TRAIN, "--seq", "100000"], capsys)
    assert (
        err == "jaxckpt train: error: --seq 100000 exceeds the model's config.max_len=1024; use a shorter seq"
    )
    assert compile_count() == 0


@pytest.mark.parametrize(
    ("mesh", "size", "hint"),
    [
        ("fsdp=64", 64, ""),
        ("data=2,fsdp=8", 16, ""),
        ("fsdp=4", 4, ": a mesh spans every device, e.g. fsdp=8"),
    ],
)
def test_train_mesh_other_than_the_devices(mesh, size, hint, capsys, compile_count):
    devices = len(jax.devices())  # conftest: 8 CPU devices
    err = _refused([*TRAIN, "--seq", "32", "--mesh", mesh], capsys)
    assert err.startswith(
        f"jaxckpt train: error: --mesh '{mesh}' needs {size} devices; this process sees {devices}{hint}"
    )
    assert compile_count() == 0


def test_micro_batches_need_not_divide_the_batch():
    """``--batch`` is per micro-batch (``sequences per micro-batch``): 3 micro-batches of 8."""
    w = plan.Workload(nn.TransformerConfig.preset("tiny"), batch=8, seq=16, micro_batches=3)
    assert w.input_shape == (3, 8, 17)


def test_plan_batch_the_devices_do_not_split(capsys, compile_count):
    err = _refused([*PLAN, "--batch", "3", "--seq", "64", "--budget", "20MiB", "--devices", "2"], capsys)
    assert "Workload: --batch 3 must be a multiple of --devices 2" in err
    assert compile_count() == 0


def test_batch_split_over_the_mesh_is_checked_by_arithmetic():
    mesh = train.make_mesh({"fsdp": 8})
    check_batch_split(16, mesh)
    with pytest.raises(
        ValueError, match=r"batch=3 must be a multiple of the mesh's 8 devices \(data 1 x fsdp 8\)"
    ):
        check_batch_split(3, mesh)


def test_train_batch_the_mesh_does_not_split(capsys, compile_count):
    err = _refused([*TRAIN, "--layers", "1", "--seq", "16", "--batch", "3", "--mesh", "fsdp=8"], capsys)
    assert "--batch 3 must be a multiple of the mesh's 8 devices (data 1 x fsdp 8)" in err
    assert compile_count() == 0
