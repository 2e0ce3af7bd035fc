"""One ``jaxckpt train`` process of the fault-injection harness (``tests/_support/fault_harness.py``),
and the fork server that starts such processes warm.

Usage: ``python fault_child.py PROGRESS KILL_AT ACTION -- <jaxckpt train arguments>`` (or
``fault_child.py fsize LIMIT ARGVS_JSON``: ``under_file_size_limit``)

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
- ``ACTION`` = ``KILL@<stage>[+k]`` (``KILL_AT`` = n > 0): SIGKILL just before the n-th call, over
  this process's saves, that begins ``stage`` of ``STAGES`` (a named moment of a write, so
  that a fixed list of kills covers every stage whatever the number of calls a save makes),
  or k calls after it.
- ``ACTION`` = ``ENOSPC@<stage>`` (``KILL_AT`` unused): the first save's call that begins
  ``stage`` of ``ENOSPC_STAGES`` (orbax's metadata file, its rename of the step's temporary
  directory, jaxckpt's own ``jaxckpt.json``) raises ``OSError(ENOSPC)``, as a full disk
  would there. The array data's stage is ``FULL`` at the first call (``KILL_AT`` = 1): its
  writes are tensorstore's, in C++.

Nothing here changes what ``jaxckpt train`` computes: it only watches and kills.

``python fault_child.py serve MODULE...`` is the fork server (``serve``): it imports JAX,
jaxckpt and the MODULEs once, then forks one warm process per request, so that no process
pays for Python's imports again (about 5 s of CPU each). It never starts a JAX backend: a
fork after that would copy XLA's threads' locks mid-use.
"""

import atexit
import builtins
import contextlib
import errno
import importlib
import io
import json
import os
import re
import resource
import select
import signal
import sys
import threading
import traceback

FULL_BYTES = 64 * 1024
"""``FULL``: the largest file the process may write from then on."""

ENOSPC_STAGES = {
    "metadata": lambda label, path: label == "open" and path.endswith("/_METADATA"),
    "finalize": lambda label, path: label == "os.rename" and re.search(r"/\d+\.orbax-checkpoint-tmp$", path),
    "record": lambda label, path: label == "os.replace" and path.endswith(".jaxckpt.json.tmp"),
}
"""Where ``ENOSPC@<stage>`` fails a save: a predicate on the call's label and first path."""

STAGES = {
    "start": None,  # the first call of a save (nothing of it on disk yet)
    "array-metadata": lambda label, path: label == "open" and "/array_metadatas/" in path,
    "metadata": ENOSPC_STAGES["metadata"],
    "item-rename": lambda label, path: (
        label == "os.rename" and path.endswith("/default.orbax-checkpoint-tmp")
    ),
    "finalize": ENOSPC_STAGES["finalize"],
    "step-deleted": lambda label, path: label == "os.open" and re.search(r"/\d+$", path),
    "record": ENOSPC_STAGES["record"],
    "saved": lambda label, path: label == "os.unlink" and path.endswith(".jaxckpt.json.tmp"),
}
"""Where ``KILL@<stage>`` kills a save, in the order a write passes them: its first call; the
array metadata, written while tensorstore writes the arrays; the item's metadata; the item's
rename; the step's finalizing rename; the deletion of a finished step (``shutil.rmtree``'s
first call: the step beyond the newest ``MAX_TO_KEEP``, or an unrecorded one replaced);
``jaxckpt.json``'s rename (the step recorded: the latest); its cleanup, the save complete.
``KILL@<stage>+<k>``: k calls later (inside the stage: a step half deleted)."""

WATCHED_OS_CALLS = ("rename", "replace", "makedirs", "mkdir", "remove", "unlink", "rmdir", "open")


class Watch:
    """Counts the file-system calls made while a checkpoint is written, and kills at one."""

    def __init__(self, progress: str, kill_at: int, action: str):
        self.progress, self.kill_at, self.action = progress, kill_at, action
        self.saving, self.calls, self.save_calls, self.done = False, 0, 0, False
        self.stage, _, after = action.removeprefix("KILL@").partition("+")
        self.countdown = int(after or 0) if action.startswith("KILL@") else None

    def log(self, line: str) -> None:
        with io.open(self.progress, "a") as f:  # noqa: UP020 (io's open: never wrapped, not counted)
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def at_stage(self, name: str, path: str) -> bool:
        return self.save_calls == 1 if self.stage == "start" else bool(STAGES[self.stage](name, path))

    def before(self, name: str, path: str) -> None:
        if not self.saving:
            return
        self.save_calls += 1
        if self.action.startswith("ENOSPC@"):
            if self.calls == 0 and ENOSPC_STAGES[self.action.split("@")[1]](name, path):
                self.calls += 1
                self.log(f"kill {self.action} {name} {path}")
                raise OSError(errno.ENOSPC, "No space left on device", path)
            return
        if self.kill_at <= 0 or self.done:
            return
        if self.countdown is None:  # the kill_at-th call
            self.calls += 1
            due = self.calls == self.kill_at
        elif self.calls < self.kill_at:  # KILL@stage: the kill_at-th call that begins the stage
            self.calls += self.at_stage(name, path)
            due = self.calls == self.kill_at and self.countdown == 0
        else:  # KILL@stage+k: k calls after it
            self.countdown -= 1
            due = self.countdown == 0
        if not due:
            return
        self.done = True  # once: after TERM or FULL the process goes on
        self.log(f"kill {self.action} {name} {path}")
        if self.action == "FULL":
            # Python ignores SIGXFSZ from its start: a write past the limit fails with EFBIG
            resource.setrlimit(resource.RLIMIT_FSIZE, (FULL_BYTES, resource.RLIM_INFINITY))
        else:
            os.kill(os.getpid(), signal.Signals[f"SIG{self.action.split('@')[0]}"])

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
        watch.saving, watch.save_calls = True, 0
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
    if argv[:1] == ["fsize"]:
        return under_file_size_limit(argv[1:])
    progress, kill_at, action, sep, *train_args = argv
    assert sep == "--", "usage: fault_child.py PROGRESS KILL_AT ACTION -- <train arguments>"
    from jaxckpt.cli import main as cli

    install(Watch(progress, int(kill_at), action))
    return cli(["train", *train_args])


def under_file_size_limit(argv: list[str]) -> int:
    """``fault_child.py fsize LIMIT ARGVS_JSON``: runs each ``jaxckpt`` command line of
    ``ARGVS_JSON`` in this process under ``RLIMIT_FSIZE`` = LIMIT bytes (every write past it
    fails with EFBIG, tensorstore's C++ writes too), printing ``exit <code>`` for each that
    exits (``tests/reliability/test_torch_write_faults.py``). XLA's persistent cache is off: a
    write of it past the limit is not what the command does."""
    import jax

    from jaxckpt.cli import main as cli

    jax.config.update("jax_enable_compilation_cache", False)
    limit, argvs = int(argv[0]), json.loads(argv[1])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # SIGXFSZ: Python ignores it, so EFBIG
    for args in argvs:
        try:
            cli(args)
        except SystemExit as exit_info:
            print("exit", exit_info.code, flush=True)
    return 0


WARM_MODULES = (
    *("jax", "jaxckpt", "jaxckpt.cli", "jaxckpt.train", "orbax.checkpoint"),
    *("torch_bridge", "npu_backend", "jaxlib.mlir.dialects.mhlo"),  # imported lazily by each run
)
"""What the fork server imports before its first fork (none of it starts a backend)."""


def serve(modules: list[str]) -> None:
    """The fork server: reads one JSON request a line on stdin (``module``, ``argv``, ``env``,
    ``stdout``, ``stderr``: files), forks a process that runs ``module.main(argv)`` and answers
    ``pid <pid>``, then ``exit <pid> <status>`` (as ``Popen.returncode``: -N for signal N)
    when it ends. EOF on stdin: the children still running are killed and it exits."""
    for name in (*WARM_MODULES, *modules):
        importlib.import_module(name)
    from jax._src import xla_bridge  # noqa: TID251 (no public way to ask whether a backend started)

    assert not xla_bridge._backends, "a backend started before the fork: children would inherit its threads"
    answers, pending, children = os.fdopen(os.dup(1), "w", buffering=1), b"", set()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # a stray print must not corrupt the answers
    print("ready", file=answers)
    while True:
        readable, _, _ = select.select([0], [], [], 0.02)
        while children:  # reap: answer every child that ended
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            print(f"exit {pid} {os.waitstatus_to_exitcode(status)}", file=answers)
        if not readable:
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            for pid in children:
                os.kill(pid, signal.SIGKILL)
            return
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            pid = os.fork()
            if pid == 0:
                os.close(answers.fileno())  # the child never answers: the server's pipe only
                run_forked(json.loads(line))  # never returns
            children.add(pid)
            print(f"pid {pid}", file=answers)


def run_forked(request: dict) -> None:
    """In the forked child: its stdio and environment, then ``module.main(argv)``, and the exit
    a Python process makes (non-daemon threads joined, exit handlers run)."""
    code = 1
    try:
        for fd, path, flags in (
            (0, os.devnull, os.O_RDONLY),
            (1, request.get("stdout") or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_APPEND),
            (2, request.get("stderr") or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_APPEND),
        ):
            os.dup2(os.open(path, flags, 0o644), fd)
        os.environ.update(request.get("env", {}))
        sys.argv = [request["module"], *request["argv"]]
        try:
            code = importlib.import_module(request["module"]).main(request["argv"])
        except SystemExit as stop:
            code = stop.code
        except BaseException:  # as Python's own exit on an uncaught exception: sys.excepthook
            sys.excepthook(*sys.exc_info())  # (train.initialize's exits at once on a lost peer)
            code = 1
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed stream: nothing to flush
                stream.flush()
        os._exit(code or 0)


if __name__ == "__main__":
    from gc_tuning import tune_gc  # beside this file

    tune_gc()
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2:])
    else:
        sys.exit(main(sys.argv[1:]))
