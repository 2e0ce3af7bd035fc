"""Multi-host training: two processes on 127.0.0.1 with two CPU devices each (gloo
collectives), against a single-process, single-device run; and the argument checks.

The two processes (``tests/_support/multihost_check.py``) are forked warm by the fault
harness's fork server, like every process of ``tests/reliability``'s multi-process tests."""

import json
import time

import fault_harness as harness
import pytest
from multihost_check import BATCH, LAYERS, SEQ, STEPS
from ports import free_port, two_cpu_devices_env

from jaxckpt import nn, train

PROCESSES = 2
DEADLINE_S = 240  # a hang (a process that never joins) fails the test instead of blocking CI


def reference_losses() -> list[float]:
    """The same model, data and seed on one device in this process (steps 0..STEPS)."""
    cfg = nn.TransformerConfig.preset("tiny", n_layers=LAYERS)
    run = train.train(cfg, train.RunConfig(steps=STEPS + 1, batch=BATCH, seq=SEQ, progress=False))
    return [s["loss"] for s in run.steps]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("multihost")
    coordinator = f"127.0.0.1:{free_port()}"
    procs = []
    try:
        for i in range(PROCESSES):  # forked warm (JAX imported, no backend): no import per process
            args = [coordinator, PROCESSES, i, tmp / "checkpoints", tmp / f"report{i}.json"]
            log = tmp / f"log{i}.txt"
            procs.append(
                harness.fork_server().start("multihost_check", args, log, log, env=two_cpu_devices_env())
            )
        reference = reference_losses()  # while the two processes start
        end = time.monotonic() + DEADLINE_S
        for p in procs:
            p.wait(timeout=max(end - time.monotonic(), 1))
    finally:
        for p in procs:  # a failed or hung process must not leave its partner waiting
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"process {i}: {(tmp / f'log{i}.txt').read_text()[-3000:]}"
    reports = [json.loads((tmp / f"report{i}.json").read_text()) for i in range(PROCESSES)]
    return {"reference": reference, "reports": reports}


@pytest.mark.slow
def test_two_processes_form_one_mesh(runs):
    for i, r in enumerate(runs["reports"]):
        assert (r["process_index"], r["process_count"], r["global_devices"], r["local_devices"]) == (
            i,
            2,
            4,
            2,
        )
        # The default mesh: data over the processes, fsdp over each one's own devices.
        assert r["default_mesh"] == {"data": 2, "fsdp": 2}
        assert r["default_mesh_processes"] == [[0, 0], [1, 1]]


@pytest.mark.slow
def test_losses_match_one_process(runs):
    first, second = runs["reports"]
    cli = json.loads(first["cli_stdout"])  # the CLI's --json output, data=2,fsdp=2, steps 0..2
    losses = [s["loss"] for s in cli["steps"]] + [first["resumed_steps"][0]["loss"]]
    assert [s["step"] for s in cli["steps"]] + [first["resumed_steps"][0]["step"]] == list(range(STEPS + 1))
    assert losses == pytest.approx(runs["reference"], abs=1e-5)
    # The loss is replicated: every process reads the same value.
    assert [(s["step"], s["loss"]) for s in second["resumed_steps"]] == [(STEPS, losses[-1])]


@pytest.mark.slow
def test_only_process_zero_prints(runs):
    first, second = runs["reports"]
    assert first["cli_status"] == second["cli_status"] == 0
    assert second["cli_stdout"] == "" and second["progress_stdout"] == ""
    assert "train" in first["progress_stdout"]


@pytest.mark.slow
def test_state_is_split_across_processes(runs):
    for r in runs["reports"]:
        total, mine = r["total_bytes"], r["bytes_per_device"]
        assert len(mine) == 2  # this process holds shards on its own two devices only
        # fsdp=4: each device a quarter, each process half (the scalars stay whole everywhere).
        assert max(mine.values()) <= total / 4 * 1.02
        assert sum(mine.values()) <= total / 2 * 1.02
        assert "fsdp" in r["up_kernel_spec"]


@pytest.mark.slow
def test_checkpoints_resume_across_meshes(runs):
    # Saved by both processes on data=2,fsdp=2 at step 3, restored onto fsdp=4, saved at step 4.
    assert [r["latest_step"] for r in runs["reports"]] == [4, 4]


@pytest.mark.parametrize(
    "coordinator, num_processes, process_id, match",
    [
        ("127.0.0.1:1234", 2, 3, "process_id=3 must be < num_processes=2"),
        ("127.0.0.1:1234", 2, 2, "process_id=2 must be < num_processes=2"),
        ("127.0.0.1:1234", 2, -1, "process_id=-1 must be >= 0"),
        ("127.0.0.1:1234", 0, 0, "num_processes=0 must be >= 1"),
        ("127.0.0.1:1234", 2.0, 0, "num_processes=2.0 must be an int"),
        ("127.0.0.1:1234", 2, True, "process_id=True must be an int"),
        ("127.0.0.1", 2, 0, "coordinator='127.0.0.1' must be HOST:PORT"),
        (":1234", 2, 0, "must be HOST:PORT"),
        ("127.0.0.1:0", 2, 0, "port in 1..65535"),
        ("127.0.0.1:65536", 2, 0, "port in 1..65535"),
        ("127.0.0.1:http", 2, 0, "port in 1..65535"),
    ],
)
def test_initialize_checks_its_arguments(coordinator, num_processes, process_id, match):
    with pytest.raises(ValueError, match=match):
        train.initialize(coordinator, num_processes, process_id)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--coordinator", "127.0.0.1:1234"], "--coordinator given without --num-processes, --process-id"),
        (["--num-processes", "2", "--process-id", "0"], "without --coordinator: "),
        (
            ["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "5"],
            "--process-id 5 must be < --num-processes 2",
        ),
        (["--heartbeat-timeout", "5"], "--heartbeat-timeout needs --coordinator"),
        (
            [
                "--coordinator",
                "127.0.0.1:1234",
                "--num-processes",
                "2",
                "--process-id",
                "0",
                *["--heartbeat-timeout", "0"],
            ],
            "--heartbeat-timeout 0 must be >= 1",
        ),
    ],
)
def test_cli_multi_host_flags_are_checked(flags, message, capsys):
    from jaxckpt.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["train", *flags, "--steps", "1", "--json"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
