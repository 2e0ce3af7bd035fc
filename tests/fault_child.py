"""One ``jaxckpt train`` process of the fault-injection harness (``tests/fault_harness.py``).

Usage: ``python fault_child.py PROGRESS KILL_AT SIGNAL -- <jaxckpt train arguments>``

- After each step it appends ``step <n> <loss as float.hex()>`` to the file PROGRESS
  (flushed and fsynced, so that a SIGKILL loses nothing already written there).
- ``KILL_AT`` = k > 0: just before the k-th file-system call made while a checkpoint is
  being written (counted over all of this process's saves: ``os`` renames, replaces,
  makedirs, mkdirs, removes, unlinks, rmdirs and every ``open``), it appends
  ``kill <call>`` to PROGRESS and sends itself ``SIGNAL`` (``KILL`` or ``TERM``). With
  ``TERM`` the call then goes ahead: the run finishes its step and checkpoints. 0: no
  self-kill (the harness may kill the process from outside at any moment).

Nothing here changes what ``jaxckpt train`` computes: it only watches and kills.
"""

import builtins
import os
import signal
import sys

WATCHED_OS_CALLS = ("rename", "replace", "makedirs", "mkdir", "remove", "unlink", "rmdir", "open")


class Watch:
    """Counts the file-system calls made while a checkpoint is written, and kills at one."""

    def __init__(self, progress: str, kill_at: int, sig: signal.Signals):
        self.progress, self.kill_at, self.sig = progress, kill_at, sig
        self.saving, self.calls = False, 0

    def log(self, line: str) -> None:
        with builtins.open(self.progress, "a") as f:  # the original open: not counted
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def before(self, name: str) -> None:
        if not self.saving or self.kill_at <= 0:
            return
        self.calls += 1
        if self.calls == self.kill_at:
            self.log(f"kill {self.sig.name} {name}")
            os.kill(os.getpid(), self.sig)

    def wrap(self, owner, name: str, label: str):
        original = getattr(owner, name)

        def watched(*args, **kwargs):
            self.before(label)
            return original(*args, **kwargs)

        setattr(owner, name, watched)


def install(watch: Watch) -> None:
    """Watches the steps (through the loop's non-finite guard, called once per step) and
    the file-system calls of every checkpoint save."""
    from jaxckpt.train import _loop

    save, guard = _loop.save_checkpoint, _loop.guard_step

    def saving(*args, **kwargs):
        watch.saving = True
        try:
            return save(*args, **kwargs)
        finally:
            watch.saving = False

    def guarded(on_nonfinite, step, loss, *rest):
        watch.log(f"step {step} {float(loss).hex()}")
        return guard(on_nonfinite, step, loss, *rest)

    _loop.save_checkpoint, _loop.guard_step = saving, guarded
    for name in WATCHED_OS_CALLS:
        watch.wrap(os, name, f"os.{name}")
    watch.wrap(builtins, "open", "open")


def main(argv: list[str]) -> int:
    progress, kill_at, sig, sep, *train_args = argv
    assert sep == "--", "usage: fault_child.py PROGRESS KILL_AT SIGNAL -- <train arguments>"
    from jaxckpt.cli import main as cli

    install(Watch(progress, int(kill_at), signal.Signals[f"SIG{sig}"]))
    return cli(["train", *train_args])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
