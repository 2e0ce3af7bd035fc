"""The seed's question on TPUs: does LLaMA-2 7B (B=8, T=2048) train on one chip, and at what peak?

Every figure comes from XLA:TPU (libtpu, the ``tpu-aot`` extra), compiled here without a TPU
(``plan.measure(target="tpu-...")``): nothing ran on a chip. For each route and chip it
prints the peak of ``full`` remat (the least a per-layer spec needs; a route over the chip's
HBM is the compiler's own "needs N GiB", to its 0.01 GiB), the analytic prediction, and the
spec ``plan.plan_memory`` chooses for the chip (the least recompute whose XLA:TPU peak fits),
with its measured peak and the roofline time of its step from XLA:TPU's cost analysis (an
estimate).

Routes: full AdamW (fp32 parameters and moments, bf16 compute), bf16 parameters with bf16
moments, LoRA r=16 on q,k,v,o over a bf16 base, and QLoRA (the same over an NF4 base).
Chips: ``tpu-v5e`` (15.75 GiB usable of 16), ``tpu-v6e`` (31.25 of 32), ``tpu-v5p`` (95.74
of 95 GiB), and a v5e-8 slice (FSDP over 8 chips: one chip's figures).

    JAX_PLATFORMS=cpu python benchmarks/speed/bench_seed_tpu.py
    JAX_PLATFORMS=cpu python benchmarks/speed/bench_seed_tpu.py --chips tpu-v5e --routes lora qlora

Results: ``benchmarks/results/bench_seed_tpu.json``.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
from harness import RESULTS, write_json
from rich.console import Console
from rich.table import Table

from jaxckpt import nn, plan, train

ROUTES = {
    "full": ({}, "float32"),
    "bf16": ({"param_dtype": "bfloat16"}, "bfloat16"),
    "lora": ({"param_dtype": "bfloat16", "lora": nn.LoraConfig(rank=16)}, None),
    "qlora": ({"param_dtype": "bfloat16", "lora": nn.LoraConfig(rank=16), "quantize_base": "nf4"}, None),
}
"""Route -> (model overrides, AdamW moments dtype: None is the parameters')."""
ROUTE_NAMES = {
    "full": "full AdamW (fp32 params and moments)",
    "bf16": "bf16 params + bf16 moments",
    "lora": "LoRA r=16 (bf16 base)",
    "qlora": "QLoRA nf4 r=16",
}
CHIPS = {"tpu-v5e": 1, "tpu-v6e": 1, "tpu-v5p": 1, "tpu-v5e-8": 8}
"""Row name -> FSDP chips (``tpu-v5e-8`` is a v5e slice of 8)."""


def workload(route: str, chips: int) -> plan.Workload:
    overrides, moments = ROUTES[route]
    config = nn.TransformerConfig.preset("llama2-7b", **overrides)
    optimizer = train.OptimizerConfig(moments_dtype=moments)
    return plan.Workload(config, 8, 2048, optimizer=optimizer, devices=chips)


def row(route: str, chip: str) -> dict:
    target = chip.removesuffix("-8")
    w = workload(route, CHIPS[chip])
    start = time.perf_counter()
    full = plan.measure(w, "full", target=target)
    result = {
        "route": route,
        "chip": chip,
        "target": target,
        "devices": w.devices,
        "usable_bytes": plan.DEVICES[target].memory,
        "full_measured_bytes": full.peak,
        "full_overflow": full.overflow,
        "full_predicted_bytes": plan.predict(w, "full", target=target).total,
        "measured_on": full.measured_on,
        "chosen": None,
    }
    try:
        chosen = plan.plan_memory(w, plan.DEVICES[target].memory, device=target, target=target)
    except plan.BudgetError:
        pass
    else:
        m = chosen.measured
        whole = plan.xla_step_cost(m.flops, m.bytes_accessed, chosen.workload, chosen.spec, target=target)
        result["chosen"] = {
            "remat": chosen.remat,
            "measured_bytes": m.peak,
            "recompute_fraction": chosen.recompute_fraction,
            "compiles": len(chosen.attempts),
            "xla_flops": m.flops,  # as cost_analysis() gives them: the layer loop counted once
            "xla_bytes_accessed": m.bytes_accessed,
            "roofline_seconds": plan.roofline_seconds(*whole, plan.DEVICES[target]),
        }
    result["seconds"] = round(time.perf_counter() - start, 1)
    print(f"{route} on {chip}: {result['seconds']} s", file=sys.stderr)
    return result


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def table(rows: list[dict]) -> Table:
    t = Table(title="llama2-7b B=8 T=2048, AdamW: XLA:TPU, compiled without a TPU (nothing ran on a chip)")
    for header in ("route", "chip", "fits?", "peak, full remat", "predicted", "chosen spec", "its peak",
                   "recompute", "roofline step"):  # fmt: skip
        t.add_column(header, justify="left" if header in ("route", "chip", "chosen spec") else "right")
    for r in rows:
        c = r["chosen"]
        peak = gib(r["full_measured_bytes"]) + (" (needs; over)" if r["full_overflow"] else "")
        t.add_row(
            ROUTE_NAMES[r["route"]],
            r["chip"],
            "yes" if c else "no",
            peak,
            gib(r["full_predicted_bytes"]),
            c["remat"] if c else "",
            gib(c["measured_bytes"]) if c else "",
            f"{c['recompute_fraction']:.1%}" if c else "",
            f"{c['roofline_seconds']:.2f} s" if c else "",
        )
    return t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--routes", nargs="+", choices=list(ROUTES), default=list(ROUTES))
    parser.add_argument("--chips", nargs="+", choices=list(CHIPS), default=list(CHIPS))
    args = parser.parse_args()
    missing = plan.tpu_aot_unavailable()
    if missing is not None:
        sys.exit(f"bench_seed_tpu needs XLA:TPU: {missing}")
    rows = [row(route, chip) for route in args.routes for chip in args.chips]
    Console(width=200).print(table(rows))
    path = write_json(RESULTS / "bench_seed_tpu.json", {"caveat": plan.TPU_CAVEAT, "rows": rows})
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
