"""A checkpoint write that fails (a full disk) leaves the previous checkpoint intact.

``OSError(ENOSPC)`` is injected into each of the file-system calls a save makes, one at
a time; every time, the save either raises one ``CheckpointWriteError`` naming the
directory and the step, with the previous checkpoint still the latest, loadable and
unchanged, and nothing temporary left, or (a call whose failure orbax survives) it
completes. The write through orbax's C++ array writer is failed for real in
``tests/reliability/test_faults_kill.py`` (``RLIMIT_FSIZE``: a disk that fills mid-run).
"""

import builtins
import errno
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fault_harness import strays
from flax import nnx

from jaxckpt.train import (
    CHECKPOINT_LOG,
    CheckpointWriteError,
    latest_step,
    read_meta,
    restore_checkpoint,
    save_checkpoint,
)

WRITES = ("rename", "replace", "makedirs", "mkdir")
"""The ``os`` calls that change a directory; files opened for writing are failed too."""


def _state(seed: int) -> nnx.State:
    keys = jax.random.split(jax.random.key(seed), 2)
    return nnx.State(
        {"w": nnx.Param(jax.random.normal(keys[0], (7, 5))), "b": nnx.Param(jnp.arange(3.0) + seed)}
    )


class FullDisk:
    """Counts the writing file-system calls; the ``fail_at``-th raises ENOSPC (0: none do)."""

    def __init__(self, monkeypatch, fail_at: int = 0):
        self.calls, self.fail_at, self.failed = 0, fail_at, None
        for name in WRITES:
            self._wrap(monkeypatch, os, name, lambda *a, **k: True)
        self._wrap(monkeypatch, os, "open", lambda path, flags, *a, **k: flags & (os.O_WRONLY | os.O_RDWR))
        self._wrap(monkeypatch, builtins, "open", lambda f, mode="r", *a, **k: any(c in mode for c in "wax+"))

    def _wrap(self, monkeypatch, owner, name, writes):
        original = getattr(owner, name)

        def watched(*args, **kwargs):
            if writes(*args, **kwargs):
                self.calls += 1
                if self.calls == self.fail_at:
                    self.failed = f"{name}({args[0]!r})"
                    raise OSError(errno.ENOSPC, "No space left on device", str(args[0]))
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, watched)


def _orbax_threads_alive() -> list[str]:
    """Orbax's signalling threads still running (a failed save must leave none: they are not
    daemon threads, and one waiting for a signal that never comes holds the process for 300 s)."""
    from orbax.checkpoint._src.futures.future import _SignalingThread

    return [t.name for t in threading.enumerate() if isinstance(t, _SignalingThread) and t.is_alive()]


def _writing_calls(tmp_path) -> int:
    """How many writing calls the save of a second step makes."""
    save_checkpoint(tmp_path / "count", 1, _state(1), {"seed": 1})
    with pytest.MonkeyPatch.context() as monkeypatch:
        disk = FullDisk(monkeypatch)
        save_checkpoint(tmp_path / "count", 2, _state(2), {"seed": 2})
    return disk.calls


@pytest.mark.slow
def test_enospc_at_every_write_of_a_save_keeps_the_previous_checkpoint(tmp_path, capfd):
    calls = _writing_calls(tmp_path)
    assert calls >= 10, calls
    outcomes = {"error": 0, "survived": 0, "left until the next save": 0}
    for k in range(1, calls + 1):
        directory = tmp_path / f"k{k}"
        save_checkpoint(directory, 1, _state(1), {"seed": 1})
        raised, _ = False, capfd.readouterr()
        with pytest.MonkeyPatch.context() as monkeypatch:
            disk = FullDisk(monkeypatch, fail_at=k)
            try:
                save_checkpoint(directory, 2, _state(2), {"seed": 2})
            except CheckpointWriteError as err:
                message, raised = str(err), True
                assert "\n" not in message and "step 2" in message and str(directory) in message, message
                assert "No space left on device (ENOSPC)" in message and "step 1, is intact" in message
                assert err.errno == errno.ENOSPC
                log = directory / CHECKPOINT_LOG
                assert message.endswith(f"details in {log}") and "step 2" in log.read_text(), message
        printed = capfd.readouterr().err  # orbax's reports of the failure: in the log, not here
        assert printed == "", (disk.failed, printed)
        assert disk.failed, k
        assert _orbax_threads_alive() == [], disk.failed  # none waits 300 s for a signal
        latest = latest_step(directory)
        assert latest == (1 if raised else 2), disk.failed
        outcomes["error" if raised else "survived"] += 1
        _, restored = restore_checkpoint(directory, _state(0))
        np.testing.assert_array_equal(restored["w"][...], _state(latest)["w"][...])
        assert read_meta(directory)["checkpoints"][-1] == latest
        left = strays(directory)  # a failed save's temporaries: ignored, removed by the next save
        if left:
            outcomes["left until the next save"] += 1
        save_checkpoint(directory, 3, _state(3), {"seed": 3})  # the disk has room again
        assert latest_step(directory) == 3 and strays(directory) == []
    print(outcomes)
    assert outcomes["error"] >= calls // 2, outcomes


def test_a_failed_save_is_not_taken_as_latest_by_a_resume(tmp_path):
    """The metadata write fails after orbax finished the step: that step is removed."""
    directory = tmp_path / "run"
    save_checkpoint(directory, 1, _state(1), {"seed": 1})
    with pytest.MonkeyPatch.context() as monkeypatch:
        original = os.replace

        def full(src, dst, *args, **kwargs):
            if str(dst).endswith("jaxckpt.json"):
                raise OSError(errno.ENOSPC, "No space left on device", str(dst))
            return original(src, dst, *args, **kwargs)

        monkeypatch.setattr(os, "replace", full)
        with pytest.raises(CheckpointWriteError, match=r"step 2 .*the previous one, step 1, is intact"):
            save_checkpoint(directory, 2, _state(2), {"seed": 2})
    assert latest_step(directory) == 1 and not (directory / "2").exists() and strays(directory) == []


def test_a_complete_step_is_not_overwritten(tmp_path):
    save_checkpoint(tmp_path, 4, _state(4), {"seed": 4})
    with pytest.raises(FileExistsError, match="already holds a complete checkpoint, step 4"):
        save_checkpoint(tmp_path, 4, _state(5), {"seed": 5})


def test_orbax_reports_of_a_failed_save_go_to_the_log_unless_verbose(tmp_path, capfd, caplog):
    """A failure inside orbax's threads (the item's metadata file): orbax logs it from each
    thread; none of it is printed or reaches a log handler, all of it is in the log file the
    error names; with the ``jaxckpt.checkpoint`` logger at DEBUG (``--verbose``) the records
    reach the handlers as they come."""
    import logging

    from jaxckpt.train import VERBOSE_LOGGER

    def fail_metadata(monkeypatch):
        original = builtins.open

        def full(path, mode="r", *args, **kwargs):
            if str(path).endswith("/_METADATA") and "w" in mode:
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            return original(path, mode, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", full)

    reported = "_SignalingThread.run() raised an exception"
    save_checkpoint(tmp_path / "warm", 0, _state(0))  # the backend's start-up lines, before capfd
    for verbose in (False, True):
        directory = tmp_path / f"verbose-{verbose}"
        capfd.readouterr()
        caplog.clear()
        with pytest.MonkeyPatch.context() as monkeypatch:
            fail_metadata(monkeypatch)
            if verbose:
                caplog.set_level(logging.DEBUG, logger=VERBOSE_LOGGER)  # restored after the test
            with pytest.raises(CheckpointWriteError) as raised:
                save_checkpoint(directory, 1, _state(1), {"seed": 1})
        log = (directory / CHECKPOINT_LOG).read_text()
        assert str(raised.value).endswith(f"details in {directory / CHECKPOINT_LOG}")
        assert "could not write checkpoint step 1" in log and "Traceback" in log
        assert (" ERROR absl [" in log) is not verbose, (
            log
        )  # orbax's records: held for the file, or handed on
        assert any(reported in r.getMessage() for r in caplog.records) is verbose, caplog.records
        assert capfd.readouterr().err == "" or verbose
    save_checkpoint(directory, 2, _state(2), {"seed": 2})  # the disk has room again
    assert latest_step(directory) == 2
