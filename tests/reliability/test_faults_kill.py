"""Kill ``jaxckpt train`` at any moment, lose nothing (``tests/_support/fault_harness.py``).

SIGKILL at each stage of a checkpoint write and between writes (``harness.KILL_PLAN``: a
fixed plan, so every run covers them all): every resume succeeds, the latest step is always
complete, the losses and the final arrays are bit-identical to an uninterrupted run's, and
no temporary file is left. SIGTERM (a preempted job): the step under way finishes, a
checkpoint is written and the process exits 0. Every process is forked warm by the
harness's fork server (no import of JAX per process).
"""

import json

import fault_harness as harness
import pytest

from jaxckpt.train import latest_step, read_meta

STEPS, EVERY = 8, 2


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A packed stream (jsonl records, byte tokens): its data state must resume too."""
    workdir = tmp_path_factory.mktemp("faults")
    data = workdir / "records.jsonl"
    text = "the quick brown fox jumps over the lazy dog "
    data.write_text(
        "".join(json.dumps({"text": f"record {i}: " + text * (i % 5 + 1)}) + "\n" for i in range(97))
    )
    args = (*harness.TRAIN_ARGS, "--data", str(data))
    return workdir, harness.reference_run(workdir, args, STEPS, EVERY)


@pytest.mark.slow
def test_ten_sigkills_resume_bit_identically(packed):
    workdir, reference = packed
    report = harness.kill_and_resume(
        workdir, reference, kills=10, seed=0, packed=True, plan=harness.KILL_PLAN
    )
    assert report.kills == 10 and report.kills_in_writes >= 1, report
    assert report.ok, report.to_dict()
    assert report.rounds_identical >= 1 and report.losses_checked >= STEPS


@pytest.mark.slow
def test_sigterm_finishes_the_step_checkpoints_and_exits_0(packed, tmp_path):
    """SIGTERM inside a checkpoint write (the 5th file-system call of a fresh run's first save),
    then after the first step of the process that resumes it: each time the step under way
    finishes, a checkpoint of it is written and the process exits 0; the next one resumes there,
    and the three processes reproduce the unkilled run bit for bit. (One directory for both
    moments: the second is the first one's resume, one process fewer than two directories.)"""
    workdir, reference = packed
    directory = tmp_path / "run"
    inside = harness.run_process(workdir, reference.args, directory, kill_at=5, action="TERM")
    done = _stopped_by_sigterm(inside, directory)
    after = harness.run_process(
        workdir, reference.args, directory, action="TERM", kill_after=0.0, after_step=done
    )
    assert min(after.losses) == done, after.stderr  # it resumed where the first one stopped
    done = _stopped_by_sigterm(after, directory)
    rest = harness.run_process(workdir, reference.args, directory)
    assert rest.returncode == 0 and min(rest.losses) == done, rest.stderr
    report = harness.Report()
    assert harness.check_round(report, directory, [inside, after, rest], reference), report.to_dict()


def _stopped_by_sigterm(proc: harness.Process, directory) -> int:
    """Checks that ``proc`` finished its step after SIGTERM, checkpointed it and exited 0;
    returns the number of steps done."""
    assert proc.returncode == 0, proc.stderr
    done = max(proc.losses) + 1
    assert done < STEPS, "the run ended before the signal"
    assert f"SIGTERM received: stopped after step {done}" in proc.stderr
    assert latest_step(directory) == done and done in read_meta(directory)["checkpoints"]
    return done


@pytest.mark.slow
def test_a_full_disk_at_each_stage_stops_the_run_in_one_line_and_the_resume_is_bit_identical(packed):
    """The disk fills at each stage of a first checkpoint write in turn (the array data:
    RLIMIT_FSIZE, so orbax's C++ writer fails; orbax's metadata; the rename that finalizes the
    step; jaxckpt.json), one run a stage, each resuming the directory the last one left: each
    exits 2 with exactly one line on stderr, naming the directory, the step and the log file
    that holds orbax's reports (and its failure, the last of the log); the latest step is
    complete (there is none yet) and no temporary is left; a resume on a disk with room again reproduces the
    unkilled run bit for bit, the losses of every run included."""
    workdir, reference = packed
    report = harness.disk_full_at_each_stage(workdir, reference, packed=True)
    assert not report.failures, report.failures
    assert report.clean_exits == len(harness.DISK_FULL_STAGES) and report.resumed_identically == 1, report
