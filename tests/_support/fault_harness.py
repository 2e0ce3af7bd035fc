"""The fault-injection harness: ``jaxckpt train`` killed at random moments, then resumed.

A *round* trains one checkpoint directory to the end through killed processes: each
process runs ``jaxckpt train ... --checkpoint-dir D --resume`` and is killed, with
SIGKILL, either from outside after a random delay, or by itself just before a random
file-system call of a checkpoint write (``tests/_support/fault_child.py``). The next process
resumes. When one finishes, the round is checked against an uninterrupted run of the
same command:

- every process ended by the kill or finished (exit 0): every resume succeeded;
- after each kill, the latest step is a complete checkpoint (orbax finished it and
  ``jaxckpt.json`` records it, with its data state for a packed stream);
- every loss any process logged is bit-identical to the uninterrupted run's at that step,
  and the final checkpoint's arrays are bit-identical to its final checkpoint's;
- no temporary directory or file is left in the directory.

``tests/reliability/test_faults_kill.py`` runs 10 kills; ``benchmarks/reliability/bench_faults.py`` runs 100.
"""

import atexit
import dataclasses
import json
import os
import random
import select
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np

CHILD = Path(__file__).with_name("fault_child.py")

TRAIN_ARGS = ("--layers", "1", "--batch", "2", "--seq", "16", "--remat", "none", "--json")
"""The tiny model of ``jaxckpt train``, with one layer and no rematerialisation (the step
each process traces is the cheapest; odd sizes are not needed: the harness checks the
checkpoints, not the model)."""

TEMPORARY = ("*.orbax-checkpoint-tmp*", ".*.tmp")
"""What a killed save can leave in a checkpoint directory (orbax's and ours)."""

WRITE_KILL_CALLS = 90
"""Self-kills pick one of the first N file-system calls of the process's saves (a save
makes about 40: one or two saves' worth)."""


@dataclasses.dataclass
class Process:
    """One ``jaxckpt train`` process of a round."""

    how: str  # "reference", "kill after 1.23 s", "kill at os.rename", "finished", ...
    returncode: int
    losses: dict[int, str]  # step -> loss (float.hex)
    stderr: str
    seconds: float

    @property
    def killed(self) -> bool:
        return self.returncode in (-signal.SIGKILL, -signal.SIGTERM)


class ForkServer:
    """A client of ``fault_child.py serve``: one warm Python (JAX, jaxckpt and ``modules``
    imported, no backend started) that forks every process of the harness, so that each
    starts in milliseconds instead of importing for seconds."""

    def __init__(self, modules: tuple = ()):
        self.server = subprocess.Popen(
            [sys.executable, str(CHILD), "serve", *modules],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=child_env(),
        )
        self.exits: dict[int, int] = {}
        self.pending = b""
        if self._answer(None) != "ready":
            raise RuntimeError(f"the fork server did not start (exit {self.server.wait()})")

    def start(self, module: str, argv: list, stdout=None, stderr=None, env=None) -> "Forked":
        """Forks a process running ``module.main(argv)``, its stdout and stderr to those files
        (None: /dev/null), with ``env`` added to the environment."""
        request = {"module": module, "argv": [str(a) for a in argv], "env": env or {}}
        request |= {"stdout": stdout and str(stdout), "stderr": stderr and str(stderr)}
        self.server.stdin.write(json.dumps(request).encode() + b"\n")
        self.server.stdin.flush()
        line = self._answer(None)
        while not line.startswith("pid "):
            line = self._answer(None)
        return Forked(self, int(line.split()[1]))

    def _answer(self, timeout: float | None) -> str:
        """The server's next answer (an ``exit`` is recorded), or "" after ``timeout`` seconds.
        Read from the pipe unbuffered: a buffered reader would hide lines from ``select``."""
        while b"\n" not in self.pending:
            if timeout is not None and not select.select([self.server.stdout], [], [], timeout)[0]:
                return ""
            chunk = os.read(self.server.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"the fork server died (exit {self.server.wait()})")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        if line.startswith(b"exit "):
            _, pid, code = line.split()
            self.exits[int(pid)] = int(code)
        return line.decode()

    def close(self) -> None:
        """Ends the server (and kills any process it forked that is still running)."""
        if self.server.poll() is None:
            self.server.stdin.close()
            self.server.wait(timeout=60)


class Forked:
    """One process forked by a ``ForkServer``: the ``subprocess.Popen`` calls the tests use."""

    def __init__(self, server: ForkServer, pid: int):
        self.server, self.pid = server, pid

    @property
    def returncode(self) -> int | None:
        return self.server.exits.get(self.pid)

    def poll(self) -> int | None:
        while self.returncode is None and self.server._answer(0):
            pass
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"forked process {self.pid}", timeout)
            self.server._answer(left)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_SERVER: ForkServer | None = None


def fork_server() -> ForkServer:
    """This process's fork server, started at the first call (ended at exit)."""
    global _SERVER
    if _SERVER is None or _SERVER.server.poll() is not None:
        _SERVER = ForkServer(("fault_child", "multihost_check", "multihost_die"))
        atexit.register(_SERVER.close)
    return _SERVER


def run_process(
    workdir: Path,
    train_args: tuple,
    checkpoint_dir: Path,
    *,
    kill_at: int = 0,
    action: str = "KILL",
    kill_after: float | None = None,
    after_step: int | None = None,
    timeout: float = 300,
) -> Process:
    """Runs one ``jaxckpt train --resume`` process (see ``fault_child.py``, forked warm by
    ``fork_server``): ``action`` (``KILL``, ``TERM``, or ``FULL``: the disk fills; ``KILL@stage``)
    at its ``kill_at``-th checkpoint file-system call, or the signal ``action`` from the harness
    ``kill_after`` seconds after it started (``after_step``: after it logged that step), or
    neither."""
    n = len(list(workdir.glob("progress-*.txt")))
    progress, stderr = workdir / f"progress-{n}.txt", workdir / f"stderr-{n}.txt"
    progress.touch()
    stderr.touch()  # a process killed at once never opens it
    argv = [str(progress), str(kill_at), action, "--", *train_args]
    argv += ["--checkpoint-dir", str(checkpoint_dir), "--resume"]
    t0 = time.perf_counter()
    proc = fork_server().start("fault_child", argv, stderr=stderr)
    try:
        while after_step is not None and proc.poll() is None and not logged(progress, after_step):
            time.sleep(0.01)
        if kill_after is not None:
            try:
                proc.wait(timeout=kill_after)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.Signals[f"SIG{action}"])
        proc.wait(timeout=timeout)
    finally:
        proc.kill()  # a process past its timeout must not outlive the test
    seconds = time.perf_counter() - t0
    lines = progress.read_text().splitlines()
    losses = {int(s): loss for _, s, loss in (line.split() for line in lines if line.startswith("step "))}
    kills = [line.split()[1:] for line in lines if line.startswith("kill ")]  # [[action, call]]
    if kills:
        how = f"{kills[0][0]} at {kills[0][1]} in a checkpoint write"
    elif kill_after is not None and proc.returncode != 0:
        how = f"{action} after {kill_after:.2f} s"
    else:
        how = "finished"
    return Process(how, proc.returncode, losses, stderr.read_text(), seconds)


def logged(progress: Path, step: int) -> bool:
    """Whether the process writing ``progress`` has logged ``step``."""
    return any(line.startswith(f"step {step} ") for line in progress.read_text().splitlines())


def checkpoint_arrays(directory: Path, step: int) -> dict:
    """The arrays of checkpoint ``step`` of ``directory``, as flat ``{path: ndarray}``."""
    import jax
    import orbax.checkpoint as ocp

    import jaxckpt  # noqa: F401  (chooses the CPU platform where no GPU driver is)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # orbax: "Sharding info not provided when restoring"
        tree = ocp.PyTreeCheckpointer().restore((directory / str(step) / "default").absolute())
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def identical(a: dict, b: dict) -> bool:
    """Bit for bit (NaNs included)."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes() for k in a
    )


def strays(directory: Path) -> list[str]:
    """Temporary directories and files left in ``directory``."""
    return sorted(p.name for pattern in TEMPORARY for p in directory.glob(pattern))


def latest_is_complete(directory: Path, packed: bool) -> bool:
    """Whether the step every reader takes as the latest is a complete checkpoint: orbax
    finished it (its directory, not a temporary one), ``jaxckpt.json`` records it and,
    for a packed stream, holds its data state."""
    from jaxckpt.train import latest_step, read_meta

    step = latest_step(directory)
    if step is None:
        return True
    meta = read_meta(directory)
    complete = (directory / str(step) / "default").is_dir() and step in meta.get("checkpoints", ())
    return complete and (not packed or str(step) in meta.get("data_states", {}))


@dataclasses.dataclass
class Report:
    """What the kills did and what the checks found."""

    kills: int = 0
    kills_in_writes: int = 0  # self-kills inside a checkpoint write
    kills_leaving_temporaries: int = 0  # outside kills that left a save's temp directory
    processes: int = 0
    resume_failures: list = dataclasses.field(default_factory=list)
    incomplete_latest: int = 0
    rounds: int = 0
    rounds_identical: int = 0
    losses_checked: int = 0
    losses_differing: list = dataclasses.field(default_factory=list)
    strays: list = dataclasses.field(default_factory=list)
    moments: dict = dataclasses.field(default_factory=dict)  # "os.rename" -> kills there

    @property
    def ok(self) -> bool:
        return (
            not self.resume_failures
            and not self.incomplete_latest
            and not self.losses_differing
            and not self.strays
            and self.rounds == self.rounds_identical
        )

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "ok": self.ok}


@dataclasses.dataclass(frozen=True)
class Reference:
    """The uninterrupted run: its arguments, its process and its final arrays."""

    args: tuple
    steps: int
    process: Process
    arrays: dict


def reference_run(workdir: Path, train_args: tuple, steps: int, every: int) -> Reference:
    """Runs ``train_args`` for ``steps`` steps, checkpointing every ``every``, unkilled."""
    args = (*train_args, "--steps", str(steps), "--checkpoint-every", str(every))
    process = run_process(workdir, args, workdir / "reference")
    if process.returncode != 0:
        raise RuntimeError(f"the uninterrupted run failed:\n{process.stderr}")
    return Reference(args, steps, process, checkpoint_arrays(workdir / "reference", steps))


KILL_PLAN = (
    # a round: the directory advances through kills at each stage of a write
    {"kill_at": 1, "action": "KILL@start"},  # the first save's first call: nothing on disk yet
    {"kill_at": 1, "action": "KILL@array-metadata"},  # tensorstore writing the arrays
    {"kill_at": 2, "action": "KILL@finalize"},  # a second save's rename of its step, after a good one
    {"kill_after": 0.0, "after_step": 3},  # from outside, once step 3 ran: as its save begins
    {"kill_at": 1, "action": "KILL@record"},  # orbax finished the step, jaxckpt.json does not list it
    {"kill_at": 2, "action": "KILL@metadata"},  # after a save that replaced that unrecorded step
    {"kill_at": 1, "action": "KILL@step-deleted+4"},  # half-way through deleting the 4th newest step
    None,  # resumed to the end: the round is checked
    # a second round: start-up, the item's own rename, and just after a save completed
    {"kill_after": 0.0},  # from outside at once: before anything is written
    {"kill_at": 1, "action": "KILL@item-rename"},
    {"kill_at": 2, "action": "KILL@saved"},
    None,
)
"""The test's 10 SIGKILLs, in order (``run_process`` arguments; None: a process left to finish).
Chosen, not drawn: each stage of a checkpoint write (``fault_child.STAGES``) and the moments
between them are hit every time, in first and in later saves, with few processes."""


def random_kills(rng: random.Random, reference: Reference):
    """Endless random kills: half at a random file-system call of a checkpoint write, half
    from outside after a random delay."""
    while True:
        if rng.random() < 0.5:
            yield {"kill_at": rng.randint(1, WRITE_KILL_CALLS)}
        else:
            yield {"kill_after": rng.uniform(0, reference.process.seconds)}


def kill_and_resume(
    workdir: Path, reference: Reference, kills: int, seed: int, packed: bool, plan: tuple | None = None
) -> Report:
    """``kills`` SIGKILLs over as many rounds as they take, each round checked against
    the uninterrupted run (see the module's docstring): random ones (``random_kills``), or
    ``plan``'s in its order (``KILL_PLAN``)."""
    planned = iter(plan if plan is not None else random_kills(random.Random(seed), reference))
    args = reference.args
    report = Report(processes=1)
    directory, done = None, True
    while report.kills < kills or not done:
        if done:
            report.rounds += 1
            directory, done, logged = workdir / f"round-{report.rounds}", False, []
        kill = next(planned, None) if report.kills < kills else None
        proc = run_process(workdir, args, directory, **(kill or {}))
        report.processes += 1
        logged.append(proc)
        if proc.killed:
            report.kills += 1
            if "checkpoint write" in proc.how:
                report.kills_in_writes += 1
                moment = proc.how.split(" at ")[1].split(" in ")[0]
                report.moments[moment] = report.moments.get(moment, 0) + 1
            elif any(directory.glob(TEMPORARY[0])):
                report.kills_leaving_temporaries += 1
            report.incomplete_latest += not latest_is_complete(directory, packed)
        elif proc.returncode != 0:
            report.resume_failures.append(f"{directory.name}: exit {proc.returncode}: {proc.stderr[-2000:]}")
            done = True  # the round cannot go on
            continue
        else:
            done = True
            report.rounds_identical += check_round(report, directory, logged, reference)
    return report


def check_round(report: Report, directory: Path, logged: list, reference: Reference) -> bool:
    """Every logged loss against the reference's, the final arrays against its, and
    strays; adds the findings to ``report`` and says whether the round is identical."""
    expected = reference.process.losses
    differing = [
        f"{directory.name} step {step}: {loss} != {expected.get(step)}"
        for proc in logged
        for step, loss in proc.losses.items()
        if loss != expected.get(step)
    ]
    report.losses_checked += sum(len(proc.losses) for proc in logged)
    report.losses_differing += differing
    left = strays(directory)
    report.strays += [f"{directory.name}/{name}" for name in left]
    final = checkpoint_arrays(directory, reference.steps)
    return not differing and not left and identical(final, reference.arrays)


def summary_rows(report: Report) -> list[tuple[str, str]]:
    """The report as (what, figure) rows, for a table."""
    return [
        ("SIGKILLs", str(report.kills)),
        ("  inside a checkpoint write (self-kill at a file-system call)", str(report.kills_in_writes)),
        ("  from outside, leaving a save's temporary directory", str(report.kills_leaving_temporaries)),
        ("processes started (kills, resumes to the end, one uninterrupted)", str(report.processes)),
        ("resumes that failed", str(len(report.resume_failures))),
        ("kills after which the latest step was not complete", str(report.incomplete_latest)),
        ("rounds (a directory trained to the end through kills)", str(report.rounds)),
        ("rounds bit-identical to the unkilled run (losses, final arrays)", str(report.rounds_identical)),
        ("losses compared", str(report.losses_checked)),
        ("losses that differed", str(len(report.losses_differing))),
        ("temporary files or directories left", str(len(report.strays))),
        ("kill moments inside writes", json.dumps(dict(sorted(report.moments.items())))),
    ]


def child_env() -> dict:
    """The children's environment: this one's, without torch's device autoload, and with every
    compile in XLA's persistent cache (not only those over the suite's 0.2 s): each process
    compiles the same ~50 small programs (the model's initialisers, the checks of a save), which
    the first one stores and the others load."""
    every_compile = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    return {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", **every_compile}


IMPORT_NOISE = (
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be used.",
)
"""What ``import jax`` prints in every process on a machine with no GPU where the CUDA plugin
(the ``gpu-aot`` extra) is installed, before any jaxckpt code runs (C++ logging that no
environment variable turns off): not the run's output, which the disk-full checks read."""


def run_stderr(proc: Process) -> list[str]:
    """The lines the run printed on stderr, without ``IMPORT_NOISE``."""
    return [line for line in proc.stderr.splitlines() if not any(noise in line for noise in IMPORT_NOISE)]


@dataclasses.dataclass
class DiskFull:
    """What the disk-full processes did: each fills the disk at a random file-system call of
    a checkpoint write (``FULL``: ``RLIMIT_FSIZE``, so orbax's C++ writer fails too)."""

    tries: int = 0
    survived: int = 0  # every file written after the fill was smaller than the limit: finished whole
    clean_exits: int = 0  # exit 2, one line naming the directory and the step, previous intact
    resumed_identically: int = 0  # then resumed on a disk with room: bit-identical to the reference
    failures: list = dataclasses.field(default_factory=list)


def disk_full_and_resume(
    workdir: Path, reference: Reference, tries: int, seed: int, packed: bool
) -> DiskFull:
    """``tries`` runs whose disk fills inside a checkpoint write, each resumed to the end."""
    rng, report = random.Random(seed), DiskFull()
    for n in range(tries):
        directory = workdir / f"full-{n}"
        proc = run_process(
            workdir, reference.args, directory, kill_at=rng.randint(1, WRITE_KILL_CALLS), action="FULL"
        )
        report.tries += 1
        if proc.returncode == 0:  # no file written after the fill outgrew it: the run must be whole
            report.survived += 1
            if not check_round(Report(), directory, [proc], reference):
                report.failures.append(f"{directory.name}: finished, but differs from the reference")
            continue
        problem = one_line_failure(proc, directory, packed)
        if problem:
            report.failures.append(f"{directory.name}: {problem}")
            continue
        report.clean_exits += 1
        resume_to_the_end(workdir, reference, directory, proc, report, directory.name)
    return report


def resume_to_the_end(
    workdir: Path, reference: Reference, directory: Path, stopped: Process, report: DiskFull, label: str
) -> None:
    """Resumes ``directory`` after the ``stopped`` run, on a disk with room again, and counts in
    ``report`` whether the two reproduce the reference bit for bit."""
    rest = run_process(workdir, reference.args, directory)
    if rest.returncode == 0 and check_round(Report(), directory, [stopped, rest], reference):
        report.resumed_identically += 1
    else:
        report.failures.append(f"{label}: the resume differed or failed: {rest.stderr[-1500:]}")


DISK_FULL_STAGES = {
    "array data": (1, "FULL"),  # RLIMIT_FSIZE from the save's first call: tensorstore's writes fail
    "metadata": (0, "ENOSPC@metadata"),
    "finalize": (0, "ENOSPC@finalize"),
    "record": (0, "ENOSPC@record"),
}
"""The stages of a checkpoint write that a full disk fails, as ``(kill_at, action)`` of
``run_process``: the item's metadata file, the rename that finalizes the step, and
jaxckpt's ``jaxckpt.json``."""


def one_line_failure(proc: Process, directory: Path, packed: bool, logged: int | None = None) -> str | None:
    """What is wrong with a run stopped by a failed checkpoint write, or None: it must exit 2
    with exactly one line on stderr (``run_stderr``), naming the directory, the step and the
    log file (``CHECKPOINT_LOG``), which holds the detail (``logged``: the log holds exactly
    that many failed writes, this one the last); the latest step is complete and no
    temporary is left."""
    from jaxckpt.train import CHECKPOINT_LOG

    lines = run_stderr(proc)
    log = directory / CHECKPOINT_LOG
    if proc.returncode != 2:
        return f"exit {proc.returncode}: {proc.stderr[-1500:]}"
    if len(lines) != 1 or not lines[0].startswith("jaxckpt train: error:"):
        return f"exit {proc.returncode}, {len(lines)} lines on stderr: {proc.stderr[-1500:]}"
    if str(directory) not in lines[0] or "step " not in lines[0] or f"details in {log}" not in lines[0]:
        return f"the line does not name the directory, the step and the log: {lines[0]}"
    failures = log.read_text().count("could not write checkpoint step") if log.is_file() else 0
    if failures == 0 or (logged is not None and failures != logged):
        return f"{log} holds {failures} failed writes, not {logged or 'at least 1'}"
    if not latest_is_complete(directory, packed) or strays(directory):
        return f"the latest step is not complete, or temporaries are left: {strays(directory)}"
    return None


def disk_full_at_each_stage(workdir: Path, reference: Reference, packed: bool) -> DiskFull:
    """One directory through a run per stage of ``DISK_FULL_STAGES``, in its order, whose disk
    fills at that stage of its first checkpoint write (each run resumes the directory the
    previous one left, which holds no checkpoint: every write is a first one), each checked by
    ``one_line_failure``; then a run on a disk with room resumes it to the end, and every loss
    of the runs and the final arrays are the reference's, bit for bit. Four disk-full runs and
    one resume, instead of a resume after each."""
    directory, report, stopped = workdir / "full-each-stage", DiskFull(), []
    for stage, (kill_at, action) in DISK_FULL_STAGES.items():
        proc = run_process(workdir, reference.args, directory, kill_at=kill_at, action=action)
        report.tries += 1
        problem = one_line_failure(proc, directory, packed, logged=len(stopped) + 1)
        if problem:
            report.failures.append(f"{stage}: {problem}")
            return report
        report.clean_exits += 1
        stopped.append(proc)
    rest = run_process(workdir, reference.args, directory)
    if rest.returncode == 0 and check_round(Report(), directory, [*stopped, rest], reference):
        report.resumed_identically += 1
    else:
        report.failures.append(f"the resume differed or failed: {rest.stderr[-1500:]}")
    return report


def disk_full_at_stage(workdir: Path, reference: Reference, stage: str, runs: int, packed: bool) -> DiskFull:
    """``runs`` runs whose disk fills at ``stage`` of their first checkpoint write
    (``DISK_FULL_STAGES``), each checked by ``one_line_failure``; the first is resumed
    to the end, bit-identical to the reference."""
    kill_at, action = DISK_FULL_STAGES[stage]
    report = DiskFull()
    for n in range(runs):
        directory = workdir / f"full-{stage.replace(' ', '-')}-{n}"
        proc = run_process(workdir, reference.args, directory, kill_at=kill_at, action=action)
        report.tries += 1
        problem = one_line_failure(proc, directory, packed)
        if problem:
            report.failures.append(f"{stage} #{n}: {problem}")
            continue
        report.clean_exits += 1
        if n == 0:
            resume_to_the_end(workdir, reference, directory, proc, report, stage)
    return report
