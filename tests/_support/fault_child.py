"""One ``jaxckpt train`` process of the fault-injection harness (``tests/_support/fault_harness.py``).

Usage: ``python fault_child.py PROGRESS KILL_AT ACTION -- <jaxckpt train arguments>``

- After each step it appends ``step <n> <loss as float.hex()>`` to the file PROGRESS
  (flushed and fsynced, so that a SIGKILL loses nothing already written there).
- ``KILL_AT`` = k > 0: just before the k-th file-system call made while a checkpoint is
  being written (counted over all of this process's saves: ``os`` renames, replaces,
  makedirs, mkdirs, removes, unlinks, rmdirs and every ``open``), it appends
  ``kill <ACTION> <call>`` to PROGRESS and does ACTION: ``KILL`` or ``TERM`` send
  itself that signal (after ``TERM`` the call goes ahead: the run finishes its step and
  checkpoints); ``FULL`` fills the disk: from then on no file of the process may grow
  past ``FULL_BYTES`` (``RLIMIT_FSIZE``; the writes fail with EFBIG, in orbax's C++
  writer too). 0: nothing (the harness may kill the process from outside at any moment).
- ``ACTION`` = ``ENOSPC@<stage>`` (``KILL_AT`` unused): the first save's call that begins
  ``stage`` of ``ENOSPC_STAGES`` (orbax's metadata file, its rename of the step's temporary
  directory, jaxckpt's own ``jaxckpt.json``) raises ``OSError(ENOSPC)``, as a full disk
  would there. The array data's stage is ``FULL`` at the first call (``KILL_AT`` = 1): its
  writes are tensorstore's, in C++.

Nothing here changes what ``jaxckpt train`` computes: it only watches and kills.
"""

import builtins
import errno
import os
import re
import resource
import signal
import sys

FULL_BYTES = 64 * 1024
"""``FULL``: the largest file the process may write from then on."""

ENOSPC_STAGES = {
    "metadata": lambda label, path: label == "open" and path.endswith("/_METADATA"),
    "finalize": lambda label, path: label == "os.rename" and re.search(r"/\d+\.orbax-checkpoint-tmp$", path),
    "record": lambda label, path: label == "os.replace" and path.endswith(".jaxckpt.json.tmp"),
}
"""Where ``ENOSPC@<stage>`` fails a save: a predicate on the call's label and first path."""

WATCHED_OS_CALLS = ("rename", "replace", "makedirs", "mkdir", "remove", "unlink", "rmdir", "open")


class Watch:
    """Counts the file-system calls made while a checkpoint is written, and kills at one."""

    def __init__(self, progress: str, kill_at: int, action: str):
        self.progress, self.kill_at, self.action = progress, kill_at, action
        self.saving, self.calls = False, 0

    def log(self, line: str) -> None:
        with builtins.open(self.progress, "a") as f:  # the original open: not counted
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def before(self, name: str, path: str) -> None:
        if not self.saving:
            return
        if self.action.startswith("ENOSPC@"):
            if self.calls == 0 and ENOSPC_STAGES[self.action.split("@")[1]](name, path):
                self.calls += 1
                self.log(f"kill {self.action} {name}")
                raise OSError(errno.ENOSPC, "No space left on device", path)
            return
        if self.kill_at <= 0:
            return
        self.calls += 1
        if self.calls != self.kill_at:
            return
        self.log(f"kill {self.action} {name}")
        if self.action == "FULL":
            # Python ignores SIGXFSZ from its start: a write past the limit fails with EFBIG
            resource.setrlimit(resource.RLIMIT_FSIZE, (FULL_BYTES, resource.RLIM_INFINITY))
        else:
            os.kill(os.getpid(), signal.Signals[f"SIG{self.action}"])

    def wrap(self, owner, name: str, label: str):
        original = getattr(owner, name)

        def watched(*args, **kwargs):
            self.before(label, str(args[0]) if args else "")
            return original(*args, **kwargs)

        setattr(owner, name, watched)


def install(watch: Watch) -> None:
    """Watches the steps (through the loop's non-finite guard, called once per step) and
    the file-system calls of every checkpoint save."""
    from jaxckpt.train import _run_steps

    save, guard = _run_steps.save_checkpoint, _run_steps.guard_step

    def saving(*args, **kwargs):
        watch.saving = True
        try:
            return save(*args, **kwargs)
        finally:
            watch.saving = False

    def guarded(on_nonfinite, step, loss, *rest):
        watch.log(f"step {step} {float(loss).hex()}")
        return guard(on_nonfinite, step, loss, *rest)

    _run_steps.save_checkpoint, _run_steps.guard_step = saving, guarded
    for name in WATCHED_OS_CALLS:
        watch.wrap(os, name, f"os.{name}")
    watch.wrap(builtins, "open", "open")


def main(argv: list[str]) -> int:
    progress, kill_at, action, sep, *train_args = argv
    assert sep == "--", "usage: fault_child.py PROGRESS KILL_AT ACTION -- <train arguments>"
    from jaxckpt.cli import main as cli

    install(Watch(progress, int(kill_at), action))
    return cli(["train", *train_args])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
