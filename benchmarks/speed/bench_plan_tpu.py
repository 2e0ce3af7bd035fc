"""The planner's model for XLA:TPU: ``plan.predict(target=)`` against ``plan.measure(target=)``.

One row per workload x remat preset x TPU target of ``GRID``: the predicted and measured
peak of one device's train step, the error and the compile's seconds; then the median and
worst |error| per target and overall (the goal: median within 5%, worst within 10%).
``measure(target="tpu-v5e")`` compiles the real step with
XLA:TPU (libtpu, the ``tpu-aot`` extra) for the chip without one. A step over the chip's
HBM is still a figure: the compiler's needed bytes (2 decimals of a GiB), marked ``over HBM``.

The workloads, bf16 params and compute as a TPU user trains, AdamW:

* ``tiny`` and ``small`` and ``gpt2`` at B=8, T=1024; ``llama3.2-1b`` at B=4, T=2048;
* ``llama3.1-8b`` with LoRA r=16 (bf16 base) and with QLoRA (nf4 base) r=16, B=1, T=8192;
* ``llama3.1-8b-fsdp8``: a full fine-tune FSDP over 8 chips of ``tpu-v5p``, B=8, T=2048
  (one device's figures; on v5p only).

``GRID`` is a subset of every workload x preset x target that covers each model and each
chip: ``none``, ``full`` and ``save_attn`` for every workload on v5e; ``full`` and
``save_attn`` for ``small``, ``llama3.2-1b`` and the QLoRA ``llama3.1-8b`` on v5p and v6e;
the FSDP row under ``full``; ``tiny`` under ``full`` with int8 layer inputs (``full+int8``,
issue 34's XLA:TPU row) on v5e. Compiles are slow (a minute or more each on a loaded 2-core
machine): narrow the grid with ``--targets``, ``--workloads``, ``--presets`` (``--all``:
every combination of them instead of ``GRID``); ``--reuse`` takes the measured figures of an
earlier run's JSON for the rows it has (same workload, preset, target, jax and libtpu),
so a change to the model is re-checked without compiling again (the predictions are always
computed anew).

    JAX_PLATFORMS=cpu python benchmarks/speed/bench_plan_tpu.py
    JAX_PLATFORMS=cpu python benchmarks/speed/bench_plan_tpu.py --targets tpu-v5e --workloads small \
        --presets full
    JAX_PLATFORMS=cpu python benchmarks/speed/bench_plan_tpu.py --reuse benchmarks/results/plan_tpu.json
"""

import argparse
import importlib.metadata
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
from harness import RESULTS, recorded_args, write_json
from rich.console import Console
from rich.table import Table

from jaxckpt import nn, plan, remat

MIB = 2**20
TARGETS = ("tpu-v5e", "tpu-v5p", "tpu-v6e")
PRESETS = ("none", "full", "dots", "save_attn", "minimal", "offload_qkv", "offload_minimal", "full+int8")
"""Remat presets; ``<preset>+int8`` is the preset with every kept tag in int8 (``remat.compressed``)."""
BF16 = {"dtype": "bfloat16", "param_dtype": "bfloat16"}
WORKLOADS = {
    "tiny": ("tiny", {}, 8, 1024, 1, TARGETS),
    "small": ("small", {}, 8, 1024, 1, TARGETS),
    "gpt2": ("gpt2", {}, 8, 1024, 1, TARGETS),
    "llama3.2-1b": ("llama3.2-1b", {}, 4, 2048, 1, TARGETS),
    "llama3.1-8b-lora": ("llama3.1-8b", {"lora": 16}, 1, 8192, 1, TARGETS),
    "llama3.1-8b-qlora": ("llama3.1-8b", {"lora": 16, "quantize_base": "nf4"}, 1, 8192, 1, TARGETS),
    "llama3.1-8b-fsdp8": ("llama3.1-8b", {}, 8, 2048, 8, ("tpu-v5p",)),
}
"""Name -> (model preset, its changes beside bf16, global batch, sequence length, FSDP chips, targets)."""
GRID = (
    *((t, w, p) for t in ("tpu-v5e",) for w in list(WORKLOADS)[:6] for p in ("none", "full", "save_attn")),
    *(
        (t, w, p)
        for t in ("tpu-v5p", "tpu-v6e")
        for w in ("small", "llama3.2-1b", "llama3.1-8b-qlora")
        for p in ("full", "save_attn")
    ),
    ("tpu-v5p", "llama3.1-8b-fsdp8", "full"),
    ("tpu-v5e", "tiny", "full+int8"),
)
"""The (target, workload, preset) rows measured by default (see the module)."""
KEPT = ("measured", "overflow", "measure_seconds", "argument", "temp", "compiler_peak")
"""The measured fields of a row (reused by ``--reuse``)."""
FIELDS = ("preset", "changes", "batch", "seq", "devices", "targets")


def workload(name: str) -> plan.Workload:
    """The ``plan.Workload`` of ``WORKLOADS[name]``."""
    preset, changes, batch, seq, devices, _ = WORKLOADS[name]
    return plan.Workload(nn.TransformerConfig.preset(preset, **BF16, **changes), batch, seq, devices=devices)


def spec(preset: str) -> "str | remat.RematSpec":
    """The remat spec of a ``PRESETS`` name: ``"full+int8"`` is ``remat.compressed("full", "int8")``."""
    base, _, fmt = preset.partition("+")
    return remat.compressed(base, fmt) if fmt else base


def versions() -> dict:
    """The compiler's versions: a measured figure is reused only under the same ones."""
    return {name: importlib.metadata.version(name) for name in ("jax", "libtpu")}


def reusable(path: "str | None") -> dict:
    """``(workload, preset, target) -> row`` of an earlier run's JSON under today's versions."""
    if path is None:
        return {}
    payload = json.loads(Path(path).read_text())
    if payload.get("versions") != versions():
        print(f"--reuse {path}: other versions {payload.get('versions')}; nothing reused", file=sys.stderr)
        return {}
    return {(r["workload"], r["preset"], r["target"]): r for r in payload["rows"]}


def measured_row(name: str, preset: str, target: str) -> dict:
    """Compiles the step with XLA:TPU: its peak (or the bytes it needs over the HBM) and seconds."""
    start = time.perf_counter()
    report = plan.measure(workload(name), spec(preset), target=target)
    seconds = time.perf_counter() - start
    print(f"  {target} {name} {preset}: {seconds:.0f} s", file=sys.stderr, flush=True)
    return dict(
        measured=report.peak,
        overflow=report.overflow,
        measure_seconds=round(seconds, 1),
        argument=report.argument,
        temp=report.temp,
        compiler_peak=report.compiler_peak,
    )


def rows_for(
    names, presets, targets, reuse: dict, only_reused: bool = False, every: bool = False
) -> list[dict]:
    """One dict a (target, workload, preset) of ``GRID`` (``every``: each combination) among
    those asked for: predicted and measured bytes, the error, the compile time (with
    ``only_reused``, only the rows ``reuse`` has)."""
    rows = []
    for target in targets:
        for name in names:
            if target not in WORKLOADS[name][5]:
                continue
            for preset in presets:
                if not every and (target, name, preset) not in GRID:
                    continue
                old = reuse.get((name, preset, target))
                if old is None and only_reused:
                    continue
                got = {k: old.get(k) for k in KEPT} if old else measured_row(name, preset, target)
                predicted = plan.predict(workload(name), spec(preset), target=target).total
                rows.append(
                    dict(
                        workload=name,
                        preset=preset,
                        target=target,
                        predicted=predicted,
                        **got,
                        error=predicted / got["measured"] - 1,
                        reused=old is not None,
                    )
                )
    return rows


def table(rows: list[dict]) -> Table:
    out = Table(title="XLA:TPU (deviceless): predict(target=) vs measure(target=)")
    for col in ("workload", "preset", "target", "predicted MiB", "measured MiB", "error %", "compile s"):
        out.add_column(col, justify="left" if col in ("workload", "preset", "target") else "right")
    for r in rows:
        measured = f"{r['measured'] / MIB:.1f}" + (" over HBM" if r["overflow"] else "")
        out.add_row(
            r["workload"],
            r["preset"],
            r["target"],
            f"{r['predicted'] / MIB:.1f}",
            measured,
            f"{100 * r['error']:+.1f}",
            f"{r['measure_seconds']:.0f}",
        )
    return out


def summary(rows: list[dict]) -> dict:
    """``{"n", "median", "worst"}`` of the rows' |error|."""
    errors = [abs(r["error"]) for r in rows]
    return dict(n=len(errors), median=statistics.median(errors), worst=max(errors))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--presets", nargs="+", default=list(PRESETS))
    parser.add_argument("--all", action="store_true", help="every target x workload x preset, not GRID")
    parser.add_argument("--reuse", default=None, help="an earlier run's JSON: its measured figures")
    parser.add_argument(
        "--only-reused", action="store_true", help="leave out the rows --reuse lacks (no compile)"
    )
    parser.add_argument("--out", default=str(RESULTS / "plan_tpu.json"))
    args = parser.parse_args()
    console = Console(width=150)
    unavailable = plan.tpu_aot_unavailable()
    if unavailable is not None:
        raise SystemExit(f"XLA:TPU is not available here: {unavailable}")
    console.print(
        "AdamW, bf16 params and compute; tiny/small/gpt2 B=8 T=1024, llama3.2-1b B=4 T=2048, "
        "llama3.1-8b LoRA/QLoRA(nf4) r=16 B=1 T=8192, llama3.1-8b full FSDP over 8 v5p chips "
        "B=8 T=2048 (one device's figures)"
    )
    rows = rows_for(
        args.workloads, args.presets, args.targets, reusable(args.reuse), args.only_reused, args.all
    )
    console.print(table(rows))
    console.print(f"[dim]{plan.TPU_CAVEAT}[/dim]")
    present = [t for t in args.targets if any(r["target"] == t for r in rows)]
    summaries = {t: summary([r for r in rows if r["target"] == t]) for t in present}
    summaries["overall"] = summary(rows)
    for key, s in summaries.items():
        met = "met" if s["median"] <= 0.05 and s["worst"] <= 0.10 else "not met"
        console.print(
            f"|error| {key}: median {100 * s['median']:.1f}%, worst {100 * s['worst']:.1f}% "
            f"({s['n']} rows; goal 5% / 10%: {met})"
        )
    payload = dict(
        workloads={k: dict(zip(FIELDS, v, strict=True)) for k, v in WORKLOADS.items()},
        versions=versions(),
        rows=rows,
        summary=summaries,
        args=recorded_args(args),
        caveat=plan.TPU_CAVEAT,
    )
    console.print(f"wrote {write_json(args.out, payload)}")


if __name__ == "__main__":
    main()
