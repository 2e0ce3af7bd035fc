"""Attention fwd+bwd: jaxckpt.flash_attention against jax.nn.dot_product_attention.

Both are timed in the same run, so the table reports ratios, never bare times.
Memory is XLA's compiled memory analysis (temp bytes), exact and noise-free.
GFLOP/s use the FlashAttention convention: fwd = 4*B*T*S*N*H (halved when
causal), fwd+bwd = 3.5 x fwd; "of matmul" divides by the better of two
2048^3 matmul measurements (in the benchmark's dtype) taken just before and
just after each case.

    python benchmarks/speed/bench_attention.py            # T = 1024 .. 32768
    python benchmarks/speed/bench_attention.py --quick    # T = 1024 .. 4096
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
import jax
import jax.numpy as jnp
from harness import table as harness_table
from harness import time_compiled, write_json
from rich.console import Console
from rich.table import Table

import jaxckpt

B, N, H = 1, 8, 64
FULL_T = (1024, 2048, 4096, 8192, 16384, 32768)
QUICK_T = (1024, 2048, 4096)
RAM_FRACTION = 0.6  # skip a peer whose compiled temp needs more than this share of RAM


def _ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _step(attn):
    """jit(value_and_grad) of a weighted sum of the attention output, wrt q, k, v."""

    def loss(q, k, v, w):
        return jnp.sum(attn(q, k, v) * w)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def _compile(step, t: int, dtype):
    shape = jax.ShapeDtypeStruct((B, t, N, H), dtype)
    return step.lower(shape, shape, shape, shape).compile()


def matmul_gflops(n: int = 2048, dtype=jnp.float32) -> float:
    """GFLOP/s of an n x n x n matmul on this machine, now (best of >= 10 runs and 1 s)."""
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x, y: x @ y).lower(a, a).compile()
    return 2 * n**3 / time_compiled(f, (a, a), 10, 1.0) / 1e9


def attention_flops(t: int, causal: bool) -> float:
    """fwd+bwd FLOPs by the FlashAttention convention."""
    fwd = 4 * B * t * t * N * H / (2 if causal else 1)
    return 3.5 * fwd


def bench_case(t: int, causal: bool, dtype, min_seconds: float) -> dict:
    """One row of the table: ours vs jax.nn at sequence length t."""
    ours = _step(lambda q, k, v: jaxckpt.flash_attention(q, k, v, is_causal=causal))
    peer = _step(
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")
    )
    ours_c = _compile(ours, t, dtype)
    peer_c = _compile(peer, t, dtype)
    ours_temp = ours_c.memory_analysis().temp_size_in_bytes
    peer_temp = peer_c.memory_analysis().temp_size_in_bytes
    keys = jax.random.split(jax.random.key(t), 4)
    args = [jax.random.normal(kk, (B, t, N, H), dtype) for kk in keys]
    small = t <= 4096
    runs = 3 if small else 1
    budget = min_seconds if small else 0.0
    matmul_before = matmul_gflops(dtype=dtype)
    ours_s = time_compiled(ours_c, args, runs, budget, warmup=small)
    peer_fits = peer_temp < RAM_FRACTION * _ram_bytes()
    peer_s = time_compiled(peer_c, args, runs, budget, warmup=small) if peer_fits else None
    matmul = max(matmul_before, matmul_gflops(dtype=dtype))  # best of two: a strict denominator
    gflops = attention_flops(t, causal) / ours_s / 1e9
    return {
        "T": t,
        "causal": causal,
        "dtype": jnp.dtype(dtype).name,
        "time_ratio": None if peer_s is None else ours_s / peer_s,
        "ours_temp_mib": ours_temp / 2**20,
        "jax_nn_temp_mib": peer_temp / 2**20,
        "memory_ratio": ours_temp / peer_temp,
        "gflops": gflops,
        "matmul_gflops": matmul,
        "fraction_of_matmul": gflops / matmul,
        "jax_nn_ran": peer_fits,
    }


def _table(rows: list[dict]) -> Table:
    dtype = rows[0]["dtype"] if rows else ""
    title = f"fwd+bwd attention, B={B} N={N} H={H} {dtype}: jaxckpt.flash_attention vs jax.nn (xla)"
    cols = ("T", "causal", "time ours/jax.nn", "temp MiB ours", "temp MiB jax.nn", "mem ratio")
    table = harness_table(title, None, (*cols, "GFLOP/s", "of matmul"))
    for r in rows:
        ratio = "skipped (no fit)" if r["time_ratio"] is None else f"{r['time_ratio']:.3f}"
        table.add_row(
            str(r["T"]),
            "yes" if r["causal"] else "no",
            ratio,
            f"{r['ours_temp_mib']:.1f}",
            f"{r['jax_nn_temp_mib']:.1f}",
            f"1/{1 / r['memory_ratio']:.0f}",
            f"{r['gflops']:.1f}",
            f"{100 * r['fraction_of_matmul']:.0f}%",
        )
    return table


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only T <= 4096")
    parser.add_argument("--seq", type=int, nargs="*", help="explicit sequence lengths")
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--min-seconds", type=float, default=1.0, help="time budget per measurement")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/bench_attention.json"))
    args = parser.parse_args(argv)
    seqs = args.seq or (QUICK_T if args.quick else FULL_T)
    causals = {"both": (True, False), "yes": (True,), "no": (False,)}[args.causal]
    console = Console(width=120)
    rows = []
    for t in seqs:
        for causal in causals:
            with console.status(f"T={t} causal={causal} ..."):
                rows.append(bench_case(t, causal, jnp.dtype(args.dtype), args.min_seconds))
            console.print(f"done T={t} causal={causal}: ratio={rows[-1]['time_ratio']}")
    console.print(_table(rows))
    write_json(args.out, {"B": B, "N": N, "H": H, "rows": rows})
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
