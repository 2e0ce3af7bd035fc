"""Block-size sweep of the blockwise kernel: how BlockSizes' defaults were chosen.

For each (block_q, block_k) it times the forward and the fwd+bwd step of causal
attention, and reports both relative to the current default timed right beside
it (lower is better: paired ratios cancel the machine's drift), plus GFLOP/s as
a fraction of a same-run matmul.

    python benchmarks/speed/bench_block_sizes.py --seq 4096
"""

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
import jax
import jax.numpy as jnp
from bench_attention import B, H, N, attention_flops, matmul_gflops
from harness import table as harness_table
from harness import time_compiled
from rich.console import Console

import jaxckpt

SIZES = (128, 256, 512, 1024)


def _times(t: int, causal: bool, block_sizes: jaxckpt.BlockSizes, args) -> tuple[float, float]:
    attn = lambda q, k, v: jaxckpt.flash_attention(q, k, v, is_causal=causal, block_sizes=block_sizes)
    fwd = jax.jit(attn)
    step = jax.jit(jax.grad(lambda q, k, v, w: jnp.sum(attn(q, k, v) * w), argnums=(0, 1, 2)))
    return time_compiled(fwd, args[:3], 5, 0.5), time_compiled(step, args, 3, 0.5)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/bench_block_sizes.json"))
    args = parser.parse_args(argv)
    t = args.seq
    inputs = [jax.random.normal(jax.random.key(i), (B, t, N, H)) for i in range(4)]
    default = jaxckpt.BlockSizes()
    matmul = matmul_gflops()
    rows = []
    console = Console(width=120)
    for bq, bk in itertools.product(SIZES, SIZES):
        with console.status(f"block_q={bq} block_k={bk}"):
            base_fwd, base_step = _times(t, args.causal, default, inputs)
            fwd, step = _times(t, args.causal, jaxckpt.BlockSizes(bq, bk), inputs)
        rows.append(
            {
                "block_q": bq,
                "block_k": bk,
                "fwd_vs_default": fwd / base_fwd,
                "step_vs_default": step / base_step,
                "step_fraction_of_matmul": attention_flops(t, args.causal) / step / 1e9 / matmul,
            }
        )
    title = f"T={t} causal={args.causal}: time relative to default {default}"
    cols = ("block_q", "block_k", "fwd / default", "fwd+bwd / default", "fwd+bwd of matmul")
    table = harness_table(title, None, cols)
    for r in rows:
        table.add_row(
            str(r["block_q"]),
            str(r["block_k"]),
            f"{r['fwd_vs_default']:.2f}",
            f"{r['step_vs_default']:.2f}",
            f"{100 * r['step_fraction_of_matmul']:.0f}%",
        )
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"T": t, "causal": args.causal, "rows": rows}, indent=2))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
