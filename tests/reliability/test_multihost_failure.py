"""Multi-host failures: when one process of a two-process CPU run on 127.0.0.1 dies, the
other exits non-zero within a bounded time, saying why, instead of hanging.

The survivor ends in one of two ways (see ``train.initialize``), and the test accepts both:

- gloo raises ``Connection reset by peer`` in the step's all-reduce: the survivor exits
  at once with status 4 (``LOST_PEER_EXIT``) and one line of ours as the last on stderr;
- the JAX client aborts it (SIGABRT, status -6) when the coordination service is gone or
  declares the other process dead, after glog's line ``F... Terminating process because
  the JAX distributed service detected fatal errors. This most likely indicates that
  another task died`` and a C++ stack. JAX 0.10.2 has no public hook to replace that abort.

Measured here (2 cores, ``--heartbeat-timeout 10``; then 5, the test's, on the same 2 cores
under a load of 34, at nice 19), from the signal to the survivor's exit:

- process 0 (the coordinator) SIGKILLed: 0.2-0.4 s, either way (the client's error polling
  finds the service's socket closed; or gloo raised first); 1.4 s under that load;
- process 1 SIGKILLed: the survivor was mostly blocked in a gloo all-reduce that did not
  notice (XLA:CPU's collective timeout is 30 minutes), and the coordination service
  declared process 1 dead after the heartbeat timeout: 8-10 s (60 and 92 s with JAX's
  default timeout of 100 s; 5.1 s with 5); once, gloo raised at once;
- process 0 stopped (SIGSTOP: alive, sockets open, silent): the survivor's heartbeats
  time out and its client aborts it: 9.4-10 s (5.1 s with 5).

The test's timeout is 5 s: each heartbeat case waits for it, and a live process's heartbeats
come from a C++ thread that compiles and Python do not hold up (``train.initialize``).
"""

import signal
import subprocess
import time
from pathlib import Path

import fault_harness as harness
import pytest
from ports import free_port, two_cpu_devices_env

from jaxckpt.train import _distributed
from jaxckpt.train._distributed import LOST_PEER_EXIT

HEARTBEAT_S = 5
START_DEADLINE_S = 300  # both processes start, compile and finish a step (a loaded CI machine)
EXIT_BOUND_S = HEARTBEAT_S + 50  # measured: 0.4-1.4 s (process 0 killed), 5.1 s (the heartbeat cases)
ABORT_LINE = (
    "Terminating process because the JAX distributed service detected fatal errors. "
    "This most likely indicates that another task died"
)
OUR_LINE = "lost contact with another process of the run"


def start(tmp: Path) -> list:
    """Two ``jaxckpt train`` processes of one run, long enough never to finish by themselves,
    forked warm by the fault harness's fork server (no import per process); the train step is
    ``multihost_check.py``'s, so that XLA's persistent cache serves both tests."""
    coordinator = f"127.0.0.1:{free_port()}"
    procs = []
    for i in range(2):
        argv = [tmp / f"progress{i}", "--"]
        argv += ["--coordinator", coordinator, "--num-processes", "2", "--process-id", str(i)]
        argv += ["--heartbeat-timeout", str(HEARTBEAT_S)]
        argv += ["--layers", "1", "--batch", "8", "--seq", "16", "--steps", "1000000", "--json"]
        out, err = tmp / f"out{i}.txt", tmp / f"err{i}.txt"
        err.touch()  # a process that dies at once never opens it
        procs.append(harness.fork_server().start("multihost_die", argv, out, err, env=two_cpu_devices_env()))
    return procs


def wait_for_a_step(tmp: Path, procs: list) -> None:
    """Until each process has finished at least one training step."""
    end = time.monotonic() + START_DEADLINE_S
    while not all((tmp / f"progress{i}").exists() for i in range(2)):
        for i, p in enumerate(procs):
            if p.poll() is not None:
                pytest.fail(f"process {i} exited ({p.returncode}) early:\n{log(tmp, i)}")
        if time.monotonic() > end:
            pytest.fail(f"no step within {START_DEADLINE_S} s:\n{log(tmp, 0)}\n{log(tmp, 1)}")
        time.sleep(0.2)


def log(tmp: Path, i: int) -> str:
    return (tmp / f"err{i}.txt").read_text(errors="replace")[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    "victim, how",
    [(0, signal.SIGKILL), (1, signal.SIGKILL), (0, signal.SIGSTOP)],
    ids=["coordinator-killed", "other-killed", "coordinator-hung"],
)
def test_survivor_exits_when_a_process_dies(tmp_path, victim, how):
    procs = start(tmp_path)
    survivor = 1 - victim
    try:
        wait_for_a_step(tmp_path, procs)
        procs[victim].send_signal(how)
        died = time.monotonic()
        try:
            procs[survivor].wait(timeout=EXIT_BOUND_S)
        except subprocess.TimeoutExpired:
            still = f"process {survivor} still running {EXIT_BOUND_S} s later"
            pytest.fail(f"{still}:\n{log(tmp_path, survivor)}")
        took = time.monotonic() - died
    finally:
        for p in procs:  # a stopped process is killed too (SIGKILL ends it even when stopped)
            if p.poll() is None:
                p.kill()
                p.wait(timeout=60)
    status, err = procs[survivor].returncode, log(tmp_path, survivor)
    print(f"survivor {survivor}: status {status} after {took:.1f} s")
    if status == LOST_PEER_EXIT:  # gloo raised first: our one line, the last on stderr
        last = err.strip().splitlines()[-1]
        assert last.startswith(f"jaxckpt: error: process {survivor} of 2 {OUR_LINE}"), err
        assert "Traceback" not in err
    else:  # the JAX client aborted the process, naming the cause
        assert status == -signal.SIGABRT, err
        assert ABORT_LINE in err
    assert took < EXIT_BOUND_S


def test_heartbeat_timeout_is_checked():
    from jaxckpt import train

    cases = ((0, "heartbeat_timeout=0 must be >= 1"), (2.5, "heartbeat_timeout=2.5 must be an int"))
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            train.initialize("127.0.0.1:1234", 2, 0, heartbeat_timeout=bad)


def test_lost_peer_message(monkeypatch):
    import jax

    gloo = jax.errors.JaxRuntimeError(
        "UNKNOWN: Gloo all-reduce failed: [pair.cc:538] Read error [127.0.0.1]:9432: Connection reset by peer"
    )
    assert _distributed.lost_peer_message(gloo) is None  # not a multi-process run
    monkeypatch.setattr(
        _distributed, "_run", {"coordinator": "127.0.0.1:1234", "num_processes": 2, "process_id": 1}
    )
    assert _distributed.lost_peer_message(gloo) == (
        "jaxckpt: error: process 1 of 2 lost contact with another process of the run (one died, or "
        "the coordinator 127.0.0.1:1234 is unreachable): UNKNOWN: Gloo all-reduce failed: [pair.cc:538] "
        "Read error [127.0.0.1]:9432: Connection reset by peer; exiting with status 4"
    )
    oom = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory")
    assert _distributed.lost_peer_message(oom) is None
    assert _distributed.lost_peer_message(RuntimeError("Gloo all-reduce failed")) is None


@pytest.mark.slow
@pytest.mark.parametrize("lost", [True, False], ids=["lost-peer", "other-error"])
def test_a_lost_peer_exits_at_once(lost, tmp_path):
    """An uncaught error in a process forked warm by the fault harness's fork server (which
    hands it to ``sys.excepthook`` and then runs the exit handlers, as Python's exit does):
    ``multihost_die.raise_uncaught``."""
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    proc = harness.fork_server().start("multihost_die", ["raise", "lost" if lost else "other"], out, err)
    returncode = proc.wait(timeout=120)
    done = subprocess.CompletedProcess("multihost_die raise", returncode, out.read_text(), err.read_text())
    assert done.stdout.startswith("before")  # what was printed is flushed
    if lost:
        assert done.returncode == LOST_PEER_EXIT, done.stderr
        assert done.stderr.strip().splitlines()[-1].startswith(f"jaxckpt: error: process 0 of 2 {OUR_LINE}")
        assert "Traceback" not in done.stderr and "exit handlers ran" not in done.stdout
    else:  # any other error: Python's usual traceback and exit
        assert done.returncode == 1
        assert "ValueError: something else" in done.stderr and "exit handlers ran" in done.stdout
