"""The longest trainable sequence, B=1, per feature, measured by compiling for a GPU or TPU target.

One row per model and feature added, in order: flash + ``full`` -> + the layer inputs offloaded
to host (``offload_full``) -> + the tiled MLP -> + the planner's choice (the exact MILP with
offload allowed, every preset, tiled or not) -> + context parallelism over 8 devices (the
sequence split over a ``seq`` axis, the state over every device). Each row is
``plan.max_seq``: a search on the analytic model, then compiles near the edge until XLA
confirms the longest T (``--compiles`` at most). Nothing runs on a chip: the figures are
XLA:GPU's (or XLA:TPU's) buffer assignment of the step compiled here without one.

Each row also gives the host memory the run needs (the offloaded boundaries and residuals,
one device's), and the step-time estimate of the planner's cost: the step's FLOPs and the
recompute at the device's peak bf16 rate, plus the offload traffic over its host link (a
floor, compute-bound and at peak, not a forecast).

Usage::

    python benchmarks/speed/bench_long_context.py [--target h100-80g] [--models 8b-qlora,70b-qlora,8b-full]
        [--compiles 3] [--out benchmarks/results/long_context.json]

Writes the JSON after every row, so an interrupted run keeps what it measured.

``--replay`` compiles nothing: it predicts each row of ``--out`` again with today's model at
the row's own ``max_seq`` and plan, beside the stored measurement (a change to the model
checked in seconds; a row whose predicted max T moves must still be measured again)::

    python benchmarks/speed/bench_long_context.py --replay
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness
from rich.console import Console

from jaxckpt import nn, plan
from jaxckpt.nn import LORA_TARGETS
from jaxckpt.plan._max_seq import at_length
from jaxckpt.remat import RematSpec

TILE = 4096
"""Tokens per MLP chunk of the tiled rows."""

GOALS = {"8b-qlora": 400_000, "70b-qlora": 100_000, "8b-full": 1_000_000}
"""The issue's goal for each model: the longest T on one 80 GB device (``8b-full``: on 8)."""

PEERS = {"8b-qlora": "Unsloth 342K, HF + FA2 28K", "70b-qlora": "Unsloth 89K, HF + FA2 6.9K", "8b-full": "-"}
"""What the peers publish for the same run (Unsloth's Llama 3.3 blog post)."""


def _qlora(name: str) -> nn.TransformerConfig:
    lora = nn.LoraConfig(rank=32, targets=LORA_TARGETS)
    return nn.TransformerConfig.preset(name, lora=lora, param_dtype="bfloat16", quantize_base="nf4")


MODELS = {
    "8b-qlora": (lambda: _qlora("llama3.1-8b"), 1, "llama3.1-8b QLoRA nf4 r=32, all linear layers"),
    "70b-qlora": (lambda: _qlora("llama3.3-70b"), 1, "llama3.3-70b QLoRA nf4 r=32, all linear layers"),
    "8b-full": (
        lambda: nn.TransformerConfig.preset("llama3.1-8b", param_dtype="bfloat16"),
        8,
        "llama3.1-8b full fine-tune, bf16 AdamW, 8 devices",
    ),
}
"""Model key -> (config, devices, label). ``8b-full`` needs 8 devices for its state (12 bytes
a parameter) and B=1: every row of it splits the sequence over the 8 (``seq=8``), the state
over every device."""

FEATURES = (
    ("flash + full", {"specs": ["full"], "tiles": [None]}, False),
    ("+ boundary offload", {"specs": ["offload_full"], "tiles": [None]}, False),
    ("+ tiled MLP", {"specs": ["offload_full"], "tiles": [TILE]}, False),
    ("+ planner's choice", {}, False),
    ("+ context parallel x8", {"specs": ["offload_full"], "tiles": [TILE]}, True),
)
"""Row label -> ``plan.max_seq`` options, and whether the sequence is split over 8 devices."""


def row(key: str, label: str, options: dict, split: bool, target: str, compiles: int) -> dict:
    """One row: ``plan.max_seq`` and the figures around its answer."""
    make, devices, _ = MODELS[key]
    split = split or devices > 1
    devices, shards = (8, 8) if split else (1, 1)
    sizes = {"batch": devices // shards, "seq": 2 * shards, "devices": devices, "seq_shards": shards}
    workload = plan.Workload(make(), **sizes)
    device = plan.DEVICES[target]
    start = time.perf_counter()
    answer = plan.max_seq(workload, device.memory, target=target, compiles=compiles, **options)
    out = {
        "model": key,
        "feature": label,
        "devices": devices,
        "seq_shards": shards,
        **answer.to_dict(),
        "seconds": round(time.perf_counter() - start, 1),
    }
    if answer.plan is not None:
        w = at_length(workload, answer.max_seq, answer.plan.mlp_chunk)
        c = plan.choice(w, answer.plan.spec, target=target)
        out["step_seconds"] = c.step_seconds(device, plan.step_flops(w))
        out["link_seconds"] = c.transfer_bytes / device.host_bandwidth
        out["error"] = answer.predicted_bytes / answer.measured_bytes - 1
    return out


def replayed(r: dict, target: str) -> dict:
    """The stored row ``r`` predicted again by today's model at its ``max_seq`` and plan:
    ``{"predicted", "measured", "error"}`` (bytes; the error against the stored measurement)."""
    make, _, _ = MODELS[r["model"]]
    sizes = {"batch": r["devices"] // r["seq_shards"], "seq": 2 * r["seq_shards"]}
    workload = plan.Workload(make(), **sizes, devices=r["devices"], seq_shards=r["seq_shards"])
    spec = RematSpec(**r["plan"]["spec"])
    predicted = plan.predict(at_length(workload, r["max_seq"], r["plan"]["mlp_chunk"]), spec, target=target)
    measured = r["measured_bytes"]
    return {"predicted": predicted.total, "measured": measured, "error": predicted.total / measured - 1}


def print_replay(rows: list[dict], target: str) -> None:
    """Each stored row's stored and replayed prediction error, then the median and worst |error|."""
    t = harness.table(
        f"Stored rows predicted again (no compile), {target}",
        "model",
        ["feature", "max T", "measured", "stored pred.", "stored err", "predicted now", "error now"],
    )
    errors = []
    for r in rows:
        now = replayed(r, target)
        errors.append(abs(now["error"]))
        t.add_row(
            r["model"],
            r["feature"],
            f"{r['max_seq']:,}",
            plan.format_bytes(r["measured_bytes"]),
            plan.format_bytes(r["predicted_bytes"]),
            f"{100 * (r['predicted_bytes'] / r['measured_bytes'] - 1):+.1f}%",
            plan.format_bytes(now["predicted"]),
            f"{100 * now['error']:+.1f}%",
        )
    Console(width=200).print(t)
    if errors:
        errors.sort()
        median = (errors[(len(errors) - 1) // 2] + errors[len(errors) // 2]) / 2
        print(f"|error| now: median {100 * median:.1f}%, worst {100 * errors[-1]:.1f}% ({len(errors)} rows)")


def print_table(rows: list[dict], target: str) -> None:
    t = harness.table(
        f"Longest trainable T, B=1, compiled for {target} by XLA (deviceless: never ran on the device)",
        "model",
        ["feature", "max T", "goal", "plan", "device (measured)", "pred. err", "host", "step est.", "link"],
    )
    for r in rows:
        p = r["plan"] or {}
        tile = f", tile {p['mlp_chunk']}" if p.get("mlp_chunk") else ""
        goal = GOALS[r["model"]]
        t.add_row(
            r["model"],
            r["feature"],
            f"{r['max_seq']:,}",
            f"{goal:,} {'met' if r['max_seq'] >= goal else 'not met'}",
            f"{p.get('remat', '-')}{tile}",
            plan.format_bytes(r["measured_bytes"]),
            f"{100 * r['error']:+.1f}%" if "error" in r else "-",
            plan.format_bytes(r["host_bytes"]),
            f"{r['step_seconds']:.1f} s" if "step_seconds" in r else "-",
            f"{r['link_seconds']:.1f} s" if "link_seconds" in r else "-",
        )
    Console(width=200).print(t)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="h100-80g", choices=list(plan.TARGETS))
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--features", type=int, default=len(FEATURES), help="the first N feature rows")
    parser.add_argument("--compiles", type=int, default=3, help="compiles per row, at most")
    parser.add_argument("--out", default=str(harness.RESULTS / "long_context.json"))
    parser.add_argument("--resume", action="store_true", help="keep the rows --out already holds")
    parser.add_argument(
        "--replay", action="store_true", help="predict --out's rows again at their max T (no compile)"
    )
    args = parser.parse_args(argv)
    if args.replay:
        payload = json.loads(Path(args.out).read_text())
        print_replay(payload["rows"], payload["target"])
        return 0
    missing = plan.aot_unavailable(args.target)
    if missing:
        print(f"cannot compile for {args.target}: {missing}", file=sys.stderr)
        return 1
    rows = json.loads(Path(args.out).read_text())["rows"] if args.resume and Path(args.out).exists() else []
    for key in args.models.split(","):
        for label, options, split in FEATURES[: args.features]:
            if key == "8b-full" and split:
                continue  # every row of it is split already
            if any(r["model"] == key and r["feature"] == label for r in rows):
                continue  # --resume: measured already
            rows.append(row(key, label, options, split, args.target, args.compiles))
            print(f"{key} {label}: T={rows[-1]['max_seq']:,} ({rows[-1]['seconds']} s)", flush=True)
            payload = {
                "target": args.target,
                "caveat": plan.compile_target(args.target).caveat,
                "goals": GOALS,
                "peers": PEERS,
                "models": {k: MODELS[k][2] for k in MODELS},
                "rows": rows,
            }
            harness.write_json(args.out, payload)
    print_table(rows, args.target)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
