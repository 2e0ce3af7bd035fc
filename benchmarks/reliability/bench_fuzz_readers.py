"""Fuzzed readers: N corrupted inputs per reader, and what each reader made of them.

The cases are those of ``tests/reliability/test_fuzz_readers.py``, from
``tests/_support/fuzz_cases.py``: for each reader (safetensors, ``.bin``/``.pt``,
``config.json``, ``tokenizer.json``, jsonl, parquet, an orbax checkpoint with its
``jaxckpt.json``) its mutations in turn, case ``i`` seeded with ``i``.
Each outcome is one of:

- a clean error: a ValueError or OSError (``jaxckpt`` exits 2), one line, naming the file (and
  the field, line or tensor where the case says so);
- still valid: the mutation left an input the format's own library reads (a flipped byte of
  tensor data or of a text), and ours read exactly the same; never counted for a mutation
  that always corrupts;
- other: anything else (another exception type, several lines, the file not named, a corrupted
  input accepted, a read that differs from the reference's). It must be 0: the script exits 1
  otherwise, after listing the first few.

    python benchmarks/reliability/bench_fuzz_readers.py                  # 200 cases per reader
    python benchmarks/reliability/bench_fuzz_readers.py --cases 50 --readers safetensors jsonl
"""

import argparse
import collections
import logging
import platform
import random
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
from harness import RESULTS as RESULTS_DIR
from harness import SUPPORT, write_json
from harness import table as harness_table
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(SUPPORT))
import fuzz_cases as fc

RESULTS = RESULTS_DIR / "fuzz_readers.json"
SHOWN = 5
"""How many ``other`` outcomes per reader the JSON and the console list."""


def _torch_missing() -> str | None:
    try:
        import torch  # noqa: F401
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


def run_reader(reader: fc.Reader, cases: int, root: Path) -> dict:
    """``cases`` cases of ``reader``, its mutations in turn, case ``i`` seeded with ``i``."""
    pristine = fc.build(reader, root / "pristine" / reader.name.replace("/", "_"))
    mutations = sorted(reader.mutations)
    kinds: collections.Counter = collections.Counter()
    by_mutation = {m: collections.Counter() for m in mutations}
    others = []
    start = time.perf_counter()
    for i in range(cases):
        mutation = mutations[i % len(mutations)]
        outcome = fc.run_case(reader, mutation, random.Random(i), pristine, root)
        kinds[outcome.kind] += 1
        by_mutation[mutation][outcome.kind] += 1
        if outcome.kind == "other" and len(others) < SHOWN:
            others.append({"case": i, "mutation": mutation, "what": outcome.what, "detail": outcome.detail})
    return {
        "reader": reader.name,
        "cases": cases,
        "error": kinds["error"],
        "valid": kinds["valid"],
        "other": kinds["other"],
        "seconds": time.perf_counter() - start,
        "by_mutation": {m: dict(counts) for m, counts in by_mutation.items()},
        "other_examples": others,
    }


def _table(rows: list[dict], cases: int) -> Table:
    title = f"Fuzzed readers: {cases} corrupted inputs per reader"
    cols = ("cases tried", "clean one-line errors", "still valid (undetectable mutation)")
    table = harness_table(title, "reader", (*cols, "other outcomes (must be 0)"), justify="left")
    for row in rows:
        table.add_row(row["reader"], *(str(row[k]) for k in ("cases", "error", "valid", "other")))
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=200, help="cases per reader (default: 200)")
    parser.add_argument("--readers", nargs="+", default=list(fc.READERS), choices=list(fc.READERS))
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # an unknown config.json field is warned about; it is not an outcome
    for noisy in ("absl", "asyncio"):  # orbax's log of a garbled _CHECKPOINT_METADATA; abandoned reads
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    console = Console(width=max(Console().width, 120))  # the table's five columns on one line each
    skipped = {"bin/pt": _torch_missing()} if _torch_missing() else {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.readers:
            if name in skipped:
                console.print(f"{name}: skipped, PyTorch is not importable ({skipped[name]})")
                continue
            rows.append(run_reader(fc.READERS[name], args.cases, Path(tmp)))
    console.print(_table(rows, args.cases))
    for row in rows:
        for other in row["other_examples"]:
            console.print(f"{row['reader']} case {other['case']} ({other['mutation']}): {other['what']}")
            console.print(f"    {other['detail']}", markup=False)
    payload = {
        "cases_per_reader": args.cases,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "skipped": skipped,
        "readers": rows,
    }
    console.print(f"wrote {write_json(args.out, payload)}")
    return 1 if any(row["other"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
