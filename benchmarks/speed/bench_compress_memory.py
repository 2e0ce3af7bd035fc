"""Compressed residuals on the 8B LoRA step: the saved-residual bytes in int8 against bf16.

``llama3.1-8b`` with LoRA adapters (r=16 on q, k, v, o; the base frozen in bf16), B=1,
T=8192, bf16 compute, compiled for ``h100-80g`` by XLA:GPU without the GPU (deviceless, as
``jaxckpt plan --device h100-80g`` does). Rows:

* ``full`` and ``full+int8`` (its layer inputs, the remat boundaries, stored int8 with a
  float32 scale per 128 features): the boundaries' bytes are what separates the two peaks,
  so the int8 boundaries measure ``bf16 bytes - (peak(full) - peak(full+int8))``;
* ``offload_full`` and ``offload_full+int8``: the same boundaries in host memory, where
  XLA:GPU reports them apart (its host temporaries): measured directly;
* the planner's choice with ``allow_compress`` at a budget halfway between ``full``'s measured
  peak and ``full+int8``'s, so that only compression or offload can meet it
  (``plan.plan_memory``).

Each figure is the larger of XLA:GPU's two GEMM emitters' compiles (``plan.measure``); the
bf16 boundary bytes are ``n_layers x T x d_model x 2``. The goal (issue 34): the residual bytes
of int8 at most 0.55x of bf16's.

``--max-seq``: the longest sequence instead (``plan.max_seq``, the JSON's ``max_seq`` rows) of
``llama3.1-8b`` QLoRA (nf4 base, r=32 on q, k, v, o, gate, up, down), B=1, on the whole
``h100-80g``: ``offload_full`` with the MLP tiled by 4096 tokens, without and with the layer
inputs (the offloaded boundaries) in int8 (``max_seq(compress="int8")``), with all the host
memory they take and with at most 128 GiB of it (``host_budget``), each searched on the
analytic model and confirmed by at most ``--compiles`` XLA:GPU compiles (1-3 minutes each here).

Usage::

    python benchmarks/speed/bench_compress_memory.py [--target h100-80g] [--seq 8192]
        [--out benchmarks/results/compress_memory.json]
    python benchmarks/speed/bench_compress_memory.py --max-seq [--compiles 3]

Writes the JSON after every row, so an interrupted run keeps what it measured (``--resume``
keeps those rows; with nothing left to measure it prints the tables).
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness
from rich.console import Console

from jaxckpt import nn, plan, remat
from jaxckpt.plan._max_seq import at_length

GOAL = 0.55
"""Issue 34: int8 residual bytes at most this fraction of bf16's."""


def model(name: str = "llama3.1-8b") -> nn.TransformerConfig:
    """``name`` (``llama3.1-8b``), LoRA r=16 on q, k, v, o, the frozen base in bf16, bf16 compute."""
    lora = nn.LoraConfig(rank=16, targets=("q", "k", "v", "o"))
    return nn.TransformerConfig.preset(name, lora=lora, param_dtype="bfloat16", dtype="bfloat16")


MAX_SEQ_TILE = 4096
"""Tokens per MLP chunk of the ``--max-seq`` rows."""
HOST_BUDGET = 128 * 2**30
"""The host memory of the bounded ``--max-seq`` rows (``max_seq(host_budget=)``)."""
MAX_SEQ_ROWS = {
    "offload_full, tile 4096": (None, None),
    "offload_full+int8, tile 4096": ("int8", None),
    "offload_full, tile 4096, host 128 GiB": (None, HOST_BUDGET),
    "offload_full+int8, tile 4096, host 128 GiB": ("int8", HOST_BUDGET),
}
"""``--max-seq`` row -> ``max_seq(compress=, host_budget=)``: the layer inputs in bf16 or int8,
with all the host memory they take or at most ``HOST_BUDGET`` of it."""


def qlora_model(name: str = "llama3.1-8b") -> nn.TransformerConfig:
    """``name`` with an nf4 base and LoRA r=32 on every linear layer (the long-context benchmark's)."""
    lora = nn.LoraConfig(rank=32, targets=("q", "k", "v", "o", "gate", "up", "down"))
    return nn.TransformerConfig.preset(name, lora=lora, param_dtype="bfloat16", quantize_base="nf4")


def max_seq_row(label: str, model_name: str, target: str, compiles: int) -> dict:
    """``plan.max_seq`` of the QLoRA model under ``offload_full``, tiled MLP, compressed and
    bounded in host memory as ``MAX_SEQ_ROWS[label]`` says, on the whole device."""
    compress, host_budget = MAX_SEQ_ROWS[label]
    start = time.perf_counter()
    workload = plan.Workload(qlora_model(model_name), batch=1, seq=2)
    answer = plan.max_seq(
        workload,
        plan.DEVICES[target].memory,
        target=target,
        specs=["offload_full"],
        tiles=[MAX_SEQ_TILE],
        compiles=compiles,
        compress=compress,
        host_budget=host_budget,
    )
    out = {"row": label, **answer.to_dict(), "seconds": round(time.perf_counter() - start, 1)}
    if answer.plan is not None:
        out["error"] = answer.predicted_bytes / answer.measured_bytes - 1
        w = at_length(workload, answer.max_seq, answer.plan.mlp_chunk)
        out["compressed"] = {
            str(t): {"bytes": s, "uncompressed_bytes": f}
            for t, (s, f) in plan.compressed_tag_bytes(w, answer.plan.spec, target=target).items()
        }
    return out


def print_max_seq(payload: dict) -> None:
    section = payload["max_seq"]
    t = harness.table(
        f"{section['model']} B=1, longest T on {section['target']} (XLA:GPU deviceless)",
        "row",
        ["longest T", "analytic", "device (measured)", "predicted", "err", "host (predicted)", "compiles"],
    )
    size = plan.format_bytes
    for r in section["rows"]:
        compiled = ", ".join(f"{a['seq']:,}: {size(a['measured_bytes'])}" for a in r["attempts"])
        t.add_row(
            r["row"],
            f"{r['max_seq']:,}",
            f"{r['predicted_max_seq']:,}",
            size(r["measured_bytes"]),
            size(r["predicted_bytes"]),
            f"{100 * r['error']:+.1f}%" if "error" in r else "-",
            size(r["host_bytes"]),
            compiled,
        )
    Console(width=200).print(t)
    by = {r["row"]: r for r in section["rows"]}
    labels = list(MAX_SEQ_ROWS)
    for base, int8 in ((by.get(a), by.get(b)) for a, b in zip(labels[::2], labels[1::2], strict=True)):
        if base and int8 and base["max_seq"]:
            print(
                f"{int8['row']}: {int8['max_seq']:,} tokens against {base['max_seq']:,} "
                f"({int8['max_seq'] / base['max_seq']:.3f}x); host {size(int8['host_bytes'])} against "
                f"{size(base['host_bytes'])}"
            )


def run_max_seq(args) -> int:
    """The ``--max-seq`` rows, kept in ``--out`` beside the residual-bytes rows."""
    out = Path(args.out)
    payload = json.loads(out.read_text()) if out.exists() else {}
    model_label = f"{args.model} QLoRA nf4 r=32 on q,k,v,o,gate,up,down, bf16"
    old = payload.get("max_seq", {})
    rows = old.get("rows", []) if args.resume and old.get("model") == model_label else []
    section = {
        "model": model_label,
        "target": args.target,
        "caveat": plan.compile_target(args.target).caveat,
        "rows": rows,
    }
    for label in MAX_SEQ_ROWS:
        if any(r["row"] == label for r in rows):
            continue
        r = max_seq_row(label, args.model, args.target, args.compiles)
        rows.append(r)
        print(f"{label}: {r['max_seq']:,} tokens ({r['seconds']} s)", flush=True)
        payload["max_seq"] = section
        harness.write_json(args.out, payload)
    payload["max_seq"] = section
    print_max_seq(payload)
    return 0


def measured_row(label: str, workload: plan.Workload, spec: remat.RematSpec, target: str) -> dict:
    """One spec compiled for ``target``: its measured and predicted peak, and its host bytes."""
    start = time.perf_counter()
    measured = plan.measure(workload, spec, target=target)
    predicted = plan.predict(workload, spec, target=target)
    compressed = plan.compressed_tag_bytes(workload, spec, target=target)
    return {
        "row": label,
        "remat": plan.spec_name(spec),
        "spec": plan.spec_dict(spec),
        "measured_bytes": measured.peak,
        "measured_range_bytes": list(measured.peak_range) if measured.peak_range else None,
        "predicted_bytes": predicted.total,
        "error": predicted.total / measured.peak - 1,
        "measured_host_bytes": measured.host_temp + measured.host_argument,
        "predicted_host_bytes": predicted.host,
        "compressed": {str(t): {"bytes": s, "uncompressed_bytes": f} for t, (s, f) in compressed.items()},
        "seconds": round(time.perf_counter() - start, 1),
    }


def planner_row(workload: plan.Workload, target: str, rows: list[dict]) -> dict:
    """``plan_memory`` with ``allow_compress`` at a budget halfway between ``full``'s measured
    peak and ``full+int8``'s (the rows before it)."""
    start = time.perf_counter()
    peaks = {r["row"]: r["measured_bytes"] for r in rows}
    budget = (peaks["full"] + peaks["full+int8"]) // 2
    try:
        chosen = plan.plan_memory(workload, budget, device=target, target=target, allow_compress=True)
    except plan.BudgetError as err:
        return {"row": "planner, --allow-compress", "budget_bytes": budget, "refused": str(err)}
    out = measured_row("planner, --allow-compress", workload, chosen.spec, target)
    out |= {
        "budget_bytes": budget,
        "attempts": [
            {"remat": plan.spec_name(s), "predicted_bytes": p.total, "measured_bytes": m.peak}
            for s, p, m in chosen.attempts
        ],
        "seconds": round(time.perf_counter() - start, 1),
    }
    return out


def ratios(rows: list[dict], boundary_bytes: int) -> dict:
    """The int8 boundaries' bytes and their ratio to bf16's: from the device peaks (``full`` vs
    ``full+int8``) and from the host bytes (``offload_full`` vs ``offload_full+int8``)."""
    by = {r["row"]: r for r in rows}
    out = {"bf16_boundary_bytes": boundary_bytes}
    if "full" in by and "full+int8" in by:
        saved = by["full"]["measured_bytes"] - by["full+int8"]["measured_bytes"]
        out["device_int8_boundary_bytes"] = boundary_bytes - saved
        out["device_ratio"] = (boundary_bytes - saved) / boundary_bytes
    if "offload_full" in by and "offload_full+int8" in by:
        host, small = (
            by["offload_full"]["measured_host_bytes"],
            by["offload_full+int8"]["measured_host_bytes"],
        )
        out["host_bf16_bytes"], out["host_int8_bytes"] = host, small
        out["host_ratio"] = small / host if host else None
    measured = [v for k, v in out.items() if k.endswith("_ratio") and v is not None]
    out["goal"] = GOAL
    out["met"] = bool(measured) and max(measured) <= GOAL
    return out


def print_table(payload: dict) -> None:
    summary, target = payload["summary"], payload["target"]
    t = harness.table(
        f"{payload['model']} B=1 T={payload['seq']:,}, compiled for {target} by XLA:GPU (deviceless)",
        "row",
        ["remat", "device (measured)", "predicted", "err", "host (measured)", "compressed"],
    )
    size = plan.format_bytes
    for r in payload["rows"]:
        if "refused" in r:
            t.add_row(r["row"], "-", "-", "-", "-", "-", r["refused"][:60])
            continue
        squeezed = ", ".join(
            f"{tag} {size(c['bytes'])} of {size(c['uncompressed_bytes'])}"
            for tag, c in r["compressed"].items()
        )
        t.add_row(
            r["row"],
            r["remat"],
            size(r["measured_bytes"]),
            size(r["predicted_bytes"]),
            f"{100 * r['error']:+.1f}%",
            size(r["measured_host_bytes"]),
            squeezed or "-",
        )
    Console(width=200).print(t)
    bf16 = size(summary["bf16_boundary_bytes"])
    if "device_ratio" in summary:
        print(
            f"layer inputs in int8, on the device: {size(summary['device_int8_boundary_bytes'])} of {bf16} "
            f"in bf16 = {summary['device_ratio']:.3f}x (peak(full) - peak(full+int8) saved)"
        )
    if summary.get("host_ratio") is not None:
        print(
            f"layer inputs in int8, in host memory: {size(summary['host_int8_bytes'])} of "
            f"{size(summary['host_bf16_bytes'])} = {summary['host_ratio']:.3f}x"
        )
    print(f"goal <= {GOAL}x of bf16: {'met' if summary['met'] else 'not met'}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gpus = [name for name, target in plan.TARGETS.items() if target.platform == "gpu"]
    parser.add_argument("--target", default="h100-80g", choices=gpus)
    parser.add_argument("--model", default="llama3.1-8b", help="model preset (a small one for a smoke run)")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--out", default=str(harness.RESULTS / "compress_memory.json"))
    parser.add_argument("--resume", action="store_true", help="keep the rows --out already holds")
    parser.add_argument("--max-seq", action="store_true", help="the longest-T rows of the QLoRA model")
    parser.add_argument("--compiles", type=int, default=3, help="--max-seq: compiles per row")
    args = parser.parse_args(argv)
    missing = plan.aot_unavailable(args.target)
    if missing:
        print(f"cannot compile for {args.target}: {missing}", file=sys.stderr)
        return 1
    if args.max_seq:
        return run_max_seq(args)
    config = model(args.model)
    workload = plan.Workload(config, batch=1, seq=args.seq)
    boundary_bytes = config.n_layers * args.seq * config.d_model * config.compute_dtype.itemsize
    old = json.loads(Path(args.out).read_text())["rows"] if args.resume and Path(args.out).exists() else []
    rows = [r for r in old if r.get("seq") == args.seq]
    specs = {
        "full": remat.get("full"),
        "full+int8": remat.compressed("full", "int8"),
        "offload_full": remat.get("offload_full"),
        "offload_full+int8": remat.compressed("offload_full", "int8"),
    }
    todo = [*specs, "planner, --allow-compress"]

    kept = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}

    def payload() -> dict:
        return {
            **kept,
            "model": f"{args.model} LoRA r=16 on q,k,v,o, bf16",
            "target": args.target,
            "seq": args.seq,
            "caveat": plan.compile_target(args.target).caveat,
            "rows": rows,
            "summary": ratios(rows, boundary_bytes),
        }

    for label in todo:
        if any(r["row"] == label for r in rows):
            continue
        if label in specs:
            r = measured_row(label, workload, specs[label], args.target)
        else:
            r = planner_row(workload, args.target, rows)
        rows.append({**r, "seq": args.seq})
        if "refused" in r:
            print(f"{label}: {r['refused']}", flush=True)
        else:
            print(f"{label}: {plan.format_bytes(r['measured_bytes'])} ({r['seconds']} s)", flush=True)
        harness.write_json(args.out, payload())
    print_table(payload())
    if "max_seq" in kept:
        print_max_seq(kept)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
