"""The planner's model per backend: ``plan.predict(target=)`` against ``plan.measure(target=)``.

Two tables, one row per workload x remat preset, each with the predicted and measured peak
of one device's train step and the error:

1. XLA:GPU: ``measure(target="h100-80g")`` compiles the step with XLA:GPU for an H100
   without one (the ``gpu-aot`` extra; deviceless, so not autotuned: it reports the larger
   peak of its Triton and cuBLAS GEMM compiles), against ``predict(target="h100-80g")``;
2. XLA:CPU: ``measure()`` compiled by XLA:CPU against ``predict()``.

and the median |error| of each. The workloads: ``small`` (B=8, T=512) in bf16 params and
compute and with fp32 params, ``gpt2`` (B=8, T=1024) and ``llama2-7b`` (B=8, T=2048, FSDP
over 8 devices: one device's figures), AdamW. XLA:CPU compiles the 8-device step in a
subprocess over simulated devices (about 15 s a row here); ``--cpu-workloads`` narrows
the CPU table (the run's header names what it left out). Each row's compile time goes to
stderr and the JSON.

    JAX_PLATFORMS=cpu python benchmarks/speed/bench_plan_gpu.py
    JAX_PLATFORMS=cpu python benchmarks/speed/bench_plan_gpu.py --cpu-workloads small gpt2
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
from harness import RESULTS, recorded_args, write_json
from rich.console import Console
from rich.table import Table

from jaxckpt import nn, plan

MIB = 2**20
TARGET = "h100-80g"
PRESETS = ("none", "full", "dots", "save_attn", "minimal")
OFFLOAD = ("offload_qkv", "offload_minimal")
"""Measured on XLA:GPU only: XLA:CPU's ``pinned_host`` is the same RAM, offload saves nothing there."""
BF16 = {"dtype": "bfloat16", "param_dtype": "bfloat16"}
WORKLOADS = {
    "small": ("small", BF16, 8, 512, 1),
    "small-fp32-params": ("small", {"dtype": "bfloat16", "param_dtype": "float32"}, 8, 512, 1),
    "gpt2": ("gpt2", BF16, 8, 1024, 1),
    "llama2-7b": ("llama2-7b", BF16, 8, 2048, 8),
}
"""Name -> (model preset, dtypes, global batch, sequence length, FSDP devices)."""
FIELDS = ("preset", "dtypes", "batch", "seq", "devices")


def workload(name: str) -> plan.Workload:
    preset, dtypes, batch, seq, devices = WORKLOADS[name]
    return plan.Workload(nn.TransformerConfig.preset(preset, **dtypes), batch, seq, devices=devices)


def rows_for(names, presets, target) -> list[dict]:
    """One dict a workload x preset: predicted and measured bytes, the error, the compile time."""
    rows = []
    for name in names:
        w = workload(name)
        for preset in presets:
            start = time.perf_counter()
            report = plan.measure(w, preset, target=target)
            seconds = time.perf_counter() - start
            predicted = plan.predict(w, preset, target=target).total
            low, high = report.peak_range or (report.peak, report.peak)
            rows.append(
                dict(
                    workload=name,
                    preset=preset,
                    predicted=predicted,
                    measured=report.peak,
                    error=predicted / report.peak - 1,
                    host_measured=report.host_argument + report.host_temp,
                    gemm_low=low,
                    gemm_high=high,
                    gemm_spread=high / low - 1,
                    measured_on=report.measured_on,
                    measure_seconds=round(seconds, 1),
                )
            )
            print(f"  {report.measured_on} {name} {preset}: {seconds:.0f} s", file=sys.stderr, flush=True)
    return rows


def table(title: str, rows: list[dict], gpu: bool) -> Table:
    out = Table(title=title)
    extra = ("host MiB", "GEMM spread %") if gpu else ()
    for col in ("workload", "preset", "predicted MiB", "measured MiB", "error %", *extra, "measured by"):
        out.add_column(col, justify="left" if col in ("workload", "preset", "measured by") else "right")
    for r in rows:
        cells = (f"{r['host_measured'] / MIB:.1f}", f"{100 * r['gemm_spread']:.1f}") if gpu else ()
        out.add_row(
            r["workload"],
            r["preset"],
            f"{r['predicted'] / MIB:.1f}",
            f"{r['measured'] / MIB:.1f}",
            f"{100 * r['error']:+.1f}",
            *cells,
            r["measured_on"],
        )
    return out


def median_error(rows: list[dict]) -> float:
    return statistics.median(abs(r["error"]) for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=list(PRESETS))
    parser.add_argument(
        "--gpu-offload", nargs="*", default=list(OFFLOAD), help="offload presets (XLA:GPU only)"
    )
    parser.add_argument("--gpu-workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--cpu-workloads", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--out", default=str(RESULTS / "plan_gpu.json"))
    args = parser.parse_args()
    console = Console(width=150)
    unavailable = plan.gpu_aot_unavailable()
    if unavailable is not None:
        raise SystemExit(f"XLA:GPU is not available here: {unavailable}")
    left_out = sorted(set(WORKLOADS) - set(args.cpu_workloads))
    console.print(
        "AdamW; small B=8 T=512, gpt2 B=8 T=1024, llama2-7b B=8 T=2048 FSDP over 8 (one device's "
        "figures); bf16 params and compute unless named."
        + (f" Left out of the XLA:CPU table: {', '.join(left_out)} (--cpu-workloads)." if left_out else "")
    )
    gpu = rows_for(args.gpu_workloads, args.presets + args.gpu_offload, TARGET)
    cpu = rows_for(args.cpu_workloads, args.presets, None)
    console.print(table(f"XLA:GPU ({TARGET}, deviceless): predict(target={TARGET!r}) vs measure", gpu, True))
    console.print(
        f"[dim]{plan.AUTOTUNE_CAVEAT}. measured: the larger peak of the default and cuBLAS-only GEMM "
        "compiles; GEMM spread: how much larger; host: offloaded residuals in pinned_host, not in "
        "measured[/dim]"
    )
    console.print(table("XLA:CPU: predict() vs measure()", cpu, False))
    core = [r for r in gpu if r["preset"] in args.presets]
    medians = {"xla-gpu": median_error(core), "xla-cpu": median_error(cpu) if cpu else None}
    offload = [r for r in gpu if r["preset"] not in args.presets]
    for backend, median in medians.items():
        if median is not None:
            console.print(f"median |error| {backend} ({', '.join(args.presets)}): {100 * median:.1f}%")
    if offload:
        console.print(f"median |error| xla-gpu, offload presets: {100 * median_error(offload):.1f}%")
    spread = max(r["gemm_spread"] for r in gpu)
    console.print(f"largest GEMM spread (cuBLAS-only vs default emitters), xla-gpu: {100 * spread:.1f}%")
    payload = dict(
        target=TARGET,
        workloads={k: dict(zip(FIELDS, v, strict=True)) for k, v in WORKLOADS.items()},
        gpu=gpu,
        cpu=cpu,
        median_abs_error=medians,
        cpu_left_out=left_out,
        args=recorded_args(args),
        caveats={"xla-gpu": plan.AUTOTUNE_CAVEAT, "xla-cpu": plan.CPU_CAVEAT},
    )
    console.print(f"wrote {write_json(args.out, payload)}")


if __name__ == "__main__":
    main()
