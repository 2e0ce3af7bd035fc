"""Planner accuracy per model family: ``plan.predict`` against ``plan.measure`` for every family.

One row per family x remat preset: the predicted and measured peak of one train step and
the error. The configs are those of the test grid (``tests/_support/plan_family_cases.py``) (each family's
preset shrunk to odd sizes in a real model's proportions, its own ops kept), B=2, T=1536,
AdamW. Memory is XLA's compiled memory analysis (XLA:CPU here): exact and free of noise,
nothing is run.

``--dtype bfloat16`` measures the published models' compute dtype; XLA:CPU keeps fp32 copies
of the bf16 residuals it stores, so its figures sit above the prediction (which counts the
bf16 residuals JAX keeps, as a GPU stores them).

    python benchmarks/speed/bench_plan_families.py                      # fp32, four presets
    python benchmarks/speed/bench_plan_families.py --dtype bfloat16 --presets full
"""

import argparse
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
import jax
from harness import RESULTS, SUPPORT, write_json
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(SUPPORT))
from plan_family_cases import BATCH, FAMILIES, SEQ, family_config

from jaxckpt import plan

MIB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--presets", nargs="+", default=["none", "full", "save_attn", "minimal"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--seq", type=int, default=SEQ)
    parser.add_argument("--out", default=str(RESULTS / "plan_families.json"))
    args = parser.parse_args()
    console = Console()
    table = Table(
        title=f"plan.predict vs plan.measure per family ({args.dtype}, B={args.batch} T={args.seq})"
    )
    for col in ("family", "preset", "predicted MiB", "measured MiB", "error %"):
        table.add_column(col, justify="left" if col in ("family", "preset") else "right")
    rows = []
    for family in args.families:
        workload = plan.Workload(family_config(family, args.dtype), args.batch, args.seq)
        for preset in args.presets:
            predicted, measured = plan.predict(workload, preset).total, plan.measure(workload, preset).peak
            error = predicted / measured - 1
            rows.append(
                dict(family=family, preset=preset, predicted=predicted, measured=measured, error=error)
            )
            table.add_row(
                family, preset, f"{predicted / MIB:.1f}", f"{measured / MIB:.1f}", f"{100 * error:+.1f}"
            )
    console.print(table)
    worst = max(rows, key=lambda r: abs(r["error"]))
    console.print(f"largest |error|: {100 * abs(worst['error']):.1f}% ({worst['family']}, {worst['preset']})")
    payload = dict(
        rows=rows,
        args=vars(args),
        backend=jax.default_backend(),
        machine=platform.machine(),
        caveat=plan.CPU_CAVEAT,
    )
    console.print(f"wrote {write_json(args.out, payload)}")


if __name__ == "__main__":
    main()
