"""Planner accuracy per model family: ``plan.predict`` against ``plan.measure`` for every family.

One row per family x remat preset: the predicted and measured peak of one train step and
the error. The configs are those of ``tests/test_plan_model.py::FAMILIES`` (each family's
preset shrunk to odd sizes in a real model's proportions, its own ops kept), B=2, T=1536,
AdamW. Memory is XLA's compiled memory analysis (XLA:CPU here): exact and free of noise,
nothing is run.

``--dtype bfloat16`` measures the published models' compute dtype; XLA:CPU keeps fp32 copies
of the bf16 residuals it stores, so its figures sit above the prediction (which counts the
bf16 residuals JAX keeps, as a GPU stores them).

    python benchmarks/bench_plan_families.py                      # fp32, four presets
    python benchmarks/bench_plan_families.py --dtype bfloat16 --presets full
"""

import argparse
import platform
from pathlib import Path

import jax
from rich.console import Console
from rich.table import Table

import _results
from jaxckpt import nn, plan

SIZES = dict(d_model=232, n_heads=4, n_kv_heads=2, head_dim=56, ffn_dim=616, vocab_size=1031)
FAMILIES = {
    "llama3": ("llama3.2-1b", dict(n_layers=3)),
    "smollm2": ("smollm2-135m", dict(n_layers=3)),
    "qwen2.5": ("qwen2.5-0.5b", dict(n_layers=3)),
    "qwen3": ("qwen3-0.6b", dict(n_layers=3)),
    "mistral": ("mistral-7b", dict(n_layers=3)),
    "gemma2": ("gemma2-2b", dict(n_layers=4, sliding_window=600)),
    "gemma3": ("gemma3-1b", dict(n_layers=7, sliding_window=600)),
    "phi3": ("phi3-mini", dict(n_layers=3, sliding_window=601, rotary_fraction=0.43, n_kv_heads=4)),
    "smollm3": ("smollm2-135m", dict(family="smollm3", n_layers=4, layer_pattern=("full", "full_nope"))),
}
"""Family -> (preset, overrides of ``SIZES``): the same configs as the test grid."""
MIB = 2**20


def config(family: str, dtype: str) -> nn.TransformerConfig:
    """The family's small config in ``dtype``."""
    preset, overrides = FAMILIES[family]
    return nn.TransformerConfig.preset(preset, **{**SIZES, **overrides, "dtype": dtype})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--presets", nargs="+", default=["none", "full", "save_attn", "minimal"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=1536)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "plan_families.json"))
    args = parser.parse_args()
    console = Console()
    table = Table(
        title=f"plan.predict vs plan.measure per family ({args.dtype}, B={args.batch} T={args.seq})"
    )
    for col in ("family", "preset", "predicted MiB", "measured MiB", "error %"):
        table.add_column(col, justify="left" if col in ("family", "preset") else "right")
    rows = []
    for family in args.families:
        workload = plan.Workload(config(family, args.dtype), args.batch, args.seq)
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
    console.print(f"wrote {_results.write_json(args.out, payload)}")


if __name__ == "__main__":
    main()
