"""A real long-context train step on this CPU: boundary offload + tiled MLP against ``full``.

The ``tiny`` preset (4 layers, d_model 128, ffn_dim 344, fp32) at B=1 and a long T (32768 by
default), trained for a few steps from the same weights on the same batches under four
settings of the two long-context features:

* ``full``: remat ``full``, the plain MLP (the peer every ratio is taken against);
* ``full + tiled MLP``: remat ``full``, ``mlp_chunk`` tokens a tile;
* ``offload_full``: the layer inputs in ``pinned_host`` between the forward and the backward pass;
* ``offload_full + tiled MLP``: both.

Each step is ``train.Trainer``'s (loss, gradients, AdamW, state donated), compiled once; its
memory is XLA:CPU's buffer assignment of exactly that compiled step (``train.memory_report``:
temp, arguments, peak; ``host_temp`` is the compiler's own host-memory figure), beside the
planner's prediction (``plan.predict``: device total and host bytes). The timed rows
(``full`` and ``offload_full + tiled MLP``, or all four with ``--time-all``) run their steps
round-robin, so machine noise hits them alike; each row's time is the fastest of its steps
(as ``harness.time_compiled`` takes it: on a shared machine noise only ever adds time), with
the median beside it, and its ratio is to ``full``'s fastest in the same run. The losses of
every timed row are compared with ``full``'s step by step; the script exits 1 when one differs
by more than ``--loss-rtol`` (relative; ``0`` asks for bit-equality).

On XLA:CPU ``pinned_host`` is the same RAM as the device's: offloaded boundaries run, with the
same numbers, and the compiler counts them in ``temp`` (its ``host_temp`` stays 0), so offload
saves nothing here; the tiled MLP does. The planner's host bytes are what a GPU would hold on
its host.

    python benchmarks/speed/bench_long_context_cpu.py             # T=32768, 3 steps (~10 min, 2 shared cores)
    python benchmarks/speed/bench_long_context_cpu.py --time-all  # the same, every row's steps (~13 min)
    python benchmarks/speed/bench_long_context_cpu.py --quick     # T=2048, tile 256, 1 step (smoke, no JSON)
    python benchmarks/speed/bench_long_context_cpu.py --seq 8192 --steps 2 --mlp-chunk 1024
"""

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from harness import RESULTS as RESULTS_DIR
from harness import table, write_json
from rich.console import Console

from jaxckpt import nn, plan, remat, train

RESULTS = RESULTS_DIR / "long_context_cpu.json"
COMPILER = "XLA:CPU"
BASE = "full"
ROWS = (
    ("full", "full", False),
    ("full + tiled MLP", "full", True),
    ("offload_full", "offload_full", False),
    ("offload_full + tiled MLP", "offload_full", True),
)
"""Row name, remat preset, whether the MLP is tiled."""
TIMED = ("full", "offload_full + tiled MLP")
"""The rows whose steps run unless ``--time-all``: the comparison the issue asks for."""
CONFIG_FIELDS = ("n_layers", "d_model", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size")


def build_trainers(args) -> dict:
    """Row name -> (``Trainer``, its model config), every model from the same weights."""
    base = nn.TransformerConfig.preset(args.model, max_len=args.seq)
    if args.layers:
        base = base.replace(n_layers=args.layers)
    params = nnx.to_pure_dict(nnx.state(nn.Transformer(base, rngs=nnx.Rngs(args.seed)), nnx.Param))
    out = {}
    for name, preset, tiled in ROWS:
        config = base.replace(mlp_chunk=args.mlp_chunk if tiled else None)
        fresh = jax.tree.map(jnp.array, params)  # the trainer donates its state
        model = nn.from_params(nn.Transformer, config, fresh, seed=args.seed)
        out[name] = (train.Trainer(model, remat=preset), config)
    return out


def compiled_memory(trainer, config, preset: str, shape: tuple, batch: int, seq: int) -> dict:
    """XLA:CPU's figures of the step ``trainer`` runs, and the planner's prediction for it."""
    start = time.perf_counter()
    report = train.memory_report(trainer.compile(shape), device_stats=False)
    compile_seconds = time.perf_counter() - start
    predicted = plan.predict(plan.Workload(config, batch, seq), preset)
    return {
        "remat": preset,
        "mlp_chunk": config.mlp_chunk,
        "measured_on": "xla-cpu",
        "argument_bytes": report.argument,
        "output_bytes": report.output,
        "alias_bytes": report.alias,
        "temp_bytes": report.temp,
        "peak_bytes": report.peak,
        "host_temp_bytes": report.host_temp,
        "host_argument_bytes": report.host_argument,
        "predicted_bytes": predicted.total,
        "predicted_host_bytes": predicted.host,
        "compile_seconds": compile_seconds,
    }


def run_steps(trainers: dict, names, batches) -> tuple[dict, dict]:
    """Each step's batch through every named trainer in turn: row -> losses, row -> seconds."""
    losses = {name: [] for name in names}
    seconds = {name: [] for name in names}
    for tokens in batches:
        for name in names:
            start = time.perf_counter()
            loss = jax.block_until_ready(trainers[name][0].step(tokens))
            seconds[name].append(time.perf_counter() - start)
            losses[name].append(float(loss))
    return losses, seconds


def compare_losses(losses: dict) -> dict:
    """Each timed row's largest absolute and relative loss difference from ``full``'s."""
    base = np.asarray(losses[BASE], np.float64)
    out = {}
    for name, values in losses.items():
        diff = np.abs(np.asarray(values, np.float64) - base)
        out[name] = {
            "max_abs_diff": float(diff.max()),
            "max_rel_diff": float((diff / np.abs(base)).max()),
            "bit_equal": values == losses[BASE],
        }
    return out


def bench(args) -> dict:
    started = time.perf_counter()
    trainers = build_trainers(args)
    shape = (1, args.batch, args.seq + 1)
    rows = {}
    for name, preset, _ in ROWS:
        trainer, config = trainers[name]
        rows[name] = compiled_memory(trainer, config, preset, shape, args.batch, args.seq)
    timed = [name for name, _, _ in ROWS] if args.time_all else list(TIMED)
    for name in trainers.keys() - set(timed):
        del trainers[name]  # compiled, not run: free their state
    rng = np.random.default_rng(args.seed)
    vocab = trainers[BASE][1].vocab_size
    batches = [jnp.asarray(rng.integers(0, vocab, shape), jnp.int32) for _ in range(args.steps)]
    losses, seconds = run_steps(trainers, timed, batches)
    fastest = {name: min(times) for name, times in seconds.items()}
    for name, check in compare_losses(losses).items():
        rows[name].update(
            losses=losses[name],
            step_seconds=seconds[name],
            min_step_seconds=fastest[name],
            median_step_seconds=statistics.median(seconds[name]),
            step_ratio=fastest[name] / fastest[BASE],
            **check,
        )
    config = trainers[BASE][1]
    return {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "jax": jax.__version__,
            "load_average": os.getloadavg(),
        },
        "compiler": COMPILER,
        "pinned_host": remat.has_pinned_host(),
        "model": args.model,
        "config": {k: getattr(config, k) for k in CONFIG_FIELDS},
        "batch": args.batch,
        "seq": args.seq,
        "mlp_chunk": args.mlp_chunk,
        "steps": args.steps,
        "loss_rtol": args.loss_rtol,
        "timed": timed,
        "rows": rows,
        "command": " ".join(["python", "benchmarks/speed/bench_long_context_cpu.py", *sys.argv[1:]]),
        "seconds": time.perf_counter() - started,
    }


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def print_tables(result: dict) -> None:
    console = Console(width=max(Console().width, 160))  # the ten columns on one line each
    config = result["config"]
    title = (
        f"{result['model']} ({config['n_layers']} layers, d_model {config['d_model']}, fp32) "
        f"B={result['batch']} T={result['seq']:,}, tile {result['mlp_chunk']}: compiled by {COMPILER}"
    )
    columns = (
        "temp MiB", "peak MiB", "host temp MiB", "predicted MiB", "predicted host MiB",
        "min step s", "median s", "ratio", "losses vs full",
    )  # fmt: skip
    t = table(title, "row", columns, no_wrap=True)
    for name, r in result["rows"].items():
        timed = "median_step_seconds" in r
        if not timed:
            check = "not run"
        elif r["bit_equal"]:
            check = "bit-equal"
        else:
            check = f"max rel {r['max_rel_diff']:.1e}"
        t.add_row(
            name,
            mib(r["temp_bytes"]),
            mib(r["peak_bytes"]),
            mib(r["host_temp_bytes"]),
            mib(r["predicted_bytes"]),
            mib(r["predicted_host_bytes"]),
            f"{r['min_step_seconds']:.1f}" if timed else "",
            f"{r['median_step_seconds']:.1f}" if timed else "",
            f"{r['step_ratio']:.2f}x" if timed else "",
            check,
        )
    console.print(t)
    console.print(
        f"  memory: {COMPILER}'s memory_analysis() of each compiled step (peak = arguments + outputs + temp "
        "- aliased); host temp is its host_temp_size_in_bytes: on XLA:CPU pinned_host is the same RAM and "
        "the offloaded boundaries are counted in temp. predicted: plan.predict (device total, host bytes)."
    )
    console.print(
        f"  step: the fastest and the median of {result['steps']} steps run round-robin (same batches, same "
        f"initial weights); ratio: fastest to full's fastest in this run. pinned_host on this backend: "
        f"{result['pinned_host']}."
    )
    for name in result["timed"]:
        console.print(f"  losses {name}: {', '.join(repr(x) for x in result['rows'][name]['losses'])}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="a TransformerConfig preset (default tiny)")
    p.add_argument("--layers", type=int, default=None, help="override the preset's n_layers")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--mlp-chunk", type=int, default=2048, help="tokens per MLP tile in the tiled rows")
    p.add_argument("--steps", type=int, default=3, help="train steps per timed row")
    p.add_argument("--time-all", action="store_true", help="run the steps of all four rows, not two")
    p.add_argument("--loss-rtol", type=float, default=1e-6, help="largest relative loss difference accepted")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="T=2048, tile 256, 1 step; writes no JSON")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    if args.quick:
        args.seq, args.mlp_chunk, args.steps = 2048, 256, 1
    if not remat.has_pinned_host():
        raise SystemExit(
            f"this backend ({jax.default_backend()}) has no pinned_host memory: offload_full cannot run here"
        )
    result = bench(args)
    print_tables(result)
    if not args.quick:
        print(f"wrote {write_json(args.out, result)}")
    worst = max(r["max_rel_diff"] for r in result["rows"].values() if "max_rel_diff" in r)
    if worst > args.loss_rtol:
        raise SystemExit(
            f"losses differ from full by {worst:.2e} (relative), over --loss-rtol {args.loss_rtol}"
        )


if __name__ == "__main__":
    main()
