"""Kill ``jaxckpt train`` at random moments, and fill its disk, then resume: nothing lost.

The harness is ``tests/_support/fault_harness.py`` (``tests/reliability/test_faults_kill.py`` runs 10 kills in
CI): SIGKILLs from outside after a random delay and self-kills at a random file-system call
of a checkpoint write, each followed by ``--resume``; every round is compared, bit for bit,
with an uninterrupted run of the same command (losses and final arrays). Then the disk fills
(``RLIMIT_FSIZE``) at a random call of a checkpoint write: the run must exit 2 with one line
naming the directory, the step and the log file of orbax's reports, leave the previous
checkpoint the latest, and resume to the same bits. Last, the disk fills at each stage of a
write in turn (array data, metadata, finalize, jaxckpt.json), ``--stage-runs`` times each:
every run must print exactly that one line.

    python benchmarks/reliability/bench_faults.py                 # 100 kills, 10 disk-full runs, 20 per stage
    python benchmarks/reliability/bench_faults.py --kills 20 --full 3 --stage-runs 2
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
from harness import RESULTS as RESULTS_DIR
from harness import SUPPORT, write_json
from harness import table as harness_table
from rich.console import Console

sys.path.insert(0, str(SUPPORT))
import fault_harness as harness

RESULTS = RESULTS_DIR / "faults.json"
STEPS, EVERY = 8, 2


def _records(workdir: Path) -> Path:
    """The packed stream of ``tests/reliability/test_faults_kill.py``: its data state must resume too."""
    data = workdir / "records.jsonl"
    text = "the quick brown fox jumps over the lazy dog "
    lines = (json.dumps({"text": f"record {i}: " + text * (i % 5 + 1)}) + "\n" for i in range(97))
    data.write_text("".join(lines))
    return data


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=100)
    parser.add_argument("--full", type=int, default=10, help="disk-full runs")
    parser.add_argument("--stage-runs", type=int, default=20, help="disk-full runs per stage of a write")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        train_args = (*harness.TRAIN_ARGS, "--data", str(_records(workdir)))
        reference = harness.reference_run(workdir, train_args, STEPS, EVERY)
        kills = harness.kill_and_resume(workdir, reference, args.kills, args.seed, packed=True)
        full = harness.disk_full_and_resume(workdir, reference, args.full, args.seed, packed=True)
        stages = {
            stage: harness.disk_full_at_stage(workdir, reference, stage, args.stage_runs, packed=True)
            for stage in harness.DISK_FULL_STAGES
        }
    rows = [
        *harness.summary_rows(kills),
        ("disk-full runs (RLIMIT_FSIZE inside a checkpoint write)", str(full.tries)),
        ("  exit 2, one line naming the directory and step, previous intact", str(full.clean_exits)),
        ("  then resumed bit-identically", str(full.resumed_identically)),
        ("  finished whole (no file written after the fill outgrew the limit)", str(full.survived)),
        *(
            (
                f"disk full at the {stage} stage: runs with exactly one line / runs",
                f"{r.clean_exits} / {r.tries}",
            )
            for stage, r in stages.items()
        ),
    ]
    title = f"Kill, fill the disk, resume: jaxckpt train ({STEPS} steps, checkpoint every {EVERY})"
    table = harness_table(title, "what", ("figure",))
    for row in rows:
        table.add_row(*row)
    Console().print(table)
    ok = kills.ok and not full.failures and full.resumed_identically + full.survived == full.tries
    stage_failures = [line for r in stages.values() for line in r.failures]
    ok = ok and not stage_failures
    for line in (
        kills.resume_failures + kills.losses_differing + kills.strays + full.failures + stage_failures
    )[:5]:
        print("FAILED:", line)
    payload = {
        "kills": kills.to_dict(),
        "disk_full": full.__dict__,
        "disk_full_stages": {stage: r.__dict__ for stage, r in stages.items()},
        "ok": ok,
        "seconds": time.perf_counter() - t0,
    }
    print("wrote", write_json(RESULTS, payload))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
