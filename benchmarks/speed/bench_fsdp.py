"""FSDP on 1, 2, 4 and 8 simulated CPU devices, the same global batch: per-device state,
activations and step time.

The devices are simulated (``XLA_FLAGS=--xla_force_host_platform_device_count=8``, set
below before JAX starts): they share this machine's cores, so the step time says little
about real scaling; only ratios to D=1 are reported. Memory is XLA's compiled memory
analysis of the sharded step, per device, which is exact; activations are the step's
temp buffers less the gradients (one device's share of the parameters), and the
predicted peak is ``plan.predict(plan.Workload(..., devices=D), remat)``.

    python benchmarks/speed/bench_fsdp.py            # the small config, global batch 8, T=256
    python benchmarks/speed/bench_fsdp.py --quick    # the tiny config, T=64
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
from harness import RESULTS, write_json
from harness import table as harness_table

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
from flax import nnx
from rich.console import Console
from rich.table import Table

from jaxckpt import nn, plan, train

DEVICES = (1, 2, 4, 8)
MIB = 2**20


def measure(config: nn.TransformerConfig, devices: int, batch: int, seq: int, steps: int) -> dict:
    """One mesh of ``fsdp=devices``: per-device bytes of the state, the compiled step's
    per-device temp (activations and workspace), and the median step time."""
    mesh = None if devices == 1 else train.make_mesh({"fsdp": devices}, jax.devices()[:devices])
    trainer = train.Trainer(nn.Transformer(config, rngs=nnx.Rngs(0)), mesh=mesh, remat="full")
    batches = train.ByteBatches(train.load_tokens(None), batch, seq, seed=0)
    compiled = trainer.compile(batches.batch_at(0).shape)
    state_bytes = max(train.bytes_per_device(trainer.state).values())
    params_bytes = max(train.bytes_per_device(nnx.state(trainer.model, nnx.Param)).values())
    report = train.memory_report(compiled, device_stats=False)
    times, losses = [], []
    for step in range(steps):
        start = time.perf_counter()
        losses.append(float(jax.block_until_ready(trainer.step(batches.batch_at(step)))))
        times.append(time.perf_counter() - start)
    predicted = plan.predict(plan.Workload(config, batch, seq, devices=devices), "full")
    return {
        "devices": devices,
        "state_bytes_per_device": state_bytes,
        "temp_bytes_per_device": report.temp,
        "activation_bytes_per_device": report.temp - params_bytes,  # temp less the gradients
        "peak_bytes_per_device": report.peak,
        "predicted_peak_bytes_per_device": predicted.total,
        "step_seconds": statistics.median(times[1:] or times),
        "losses": losses,
    }


def table(rows: list[dict]) -> Table:
    base = rows[0]
    title = "FSDP on simulated CPU devices (same global batch; times: ratios only)"
    columns = (
        "D",
        "params+opt / device MiB",
        "x D=1",
        "activations / device MiB",
        "x D=1",
        "peak MiB (XLA)",
        "peak MiB (predicted)",
        "step time x D=1",
        "loss step 0",
    )
    out = harness_table(title, None, columns)
    for r in rows:
        out.add_row(
            str(r["devices"]),
            f"{r['state_bytes_per_device'] / MIB:.1f}",
            f"{r['state_bytes_per_device'] / base['state_bytes_per_device']:.3f}",
            f"{r['activation_bytes_per_device'] / MIB:.1f}",
            f"{r['activation_bytes_per_device'] / base['activation_bytes_per_device']:.3f}",
            f"{r['peak_bytes_per_device'] / MIB:.1f}",
            f"{r['predicted_peak_bytes_per_device'] / MIB:.1f}",
            f"{r['step_seconds'] / base['step_seconds']:.2f}",
            f"{r['losses'][0]:.6f}",
        )
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny config, T=64")
    parser.add_argument("--steps", type=int, default=4, help="steps per D (the first is not timed)")
    parser.add_argument("--out", type=Path, default=RESULTS / "fsdp.json")
    args = parser.parse_args(argv)
    if len(jax.devices()) < max(DEVICES):
        parser.error(f"needs {max(DEVICES)} devices; this process sees {len(jax.devices())}")
    config = nn.TransformerConfig.preset("tiny" if args.quick else "small")
    seq = 64 if args.quick else 256
    console = Console(width=140)
    rows = []
    for d in DEVICES:
        with console.status(f"D={d} ..."):
            rows.append(measure(config, d, 8, seq, args.steps))
    console.print(table(rows))
    console.print("Simulated devices share this CPU's cores: the step time is not a scaling measurement.")
    write_json(args.out, {"config": config.to_dict(), "batch": 8, "seq": seq, "rows": rows})
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
