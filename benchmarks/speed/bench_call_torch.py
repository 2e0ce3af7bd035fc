"""Per-call overhead of torch_bridge.call_torch against the same function in pure JAX.

The function is trivial (sin of a [7] float32 array), so the table measures the host
round trip: two DLPack hand-overs and the Python callback, and for ``jax.grad`` a
second callback that re-runs the function under torch.autograd. Times are medians of
jitted calls, each waited for; ratios compare runs of the same process. The "bare
callback" column is the floor of any host round trip: the same number of
``jax.pure_callback`` calls, running numpy's sin, with no torch at all.

    python benchmarks/speed/bench_call_torch.py            # 2000 calls per measurement
    python benchmarks/speed/bench_call_torch.py --quick    # 200 calls
"""

import argparse
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
from harness import median_call_us, write_json
from harness import table as harness_table

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import jax
import jax.numpy as jnp
import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from torch_bridge import call_torch

SIZE = 7
FULL_CALLS = 2000
QUICK_CALLS = 200


def _bare_sin():
    """sin through one numpy pure_callback forward and one backward: no torch, no checks."""

    def callback(fn, x):
        return jax.pure_callback(fn, jax.ShapeDtypeStruct(x.shape, x.dtype), x, vmap_method="sequential")

    @jax.custom_vjp
    def sin(x):
        return callback(np.sin, x)

    def fwd(x):
        return sin(x), x

    def bwd(x, ct):
        return (ct * callback(np.cos, x),)

    sin.defvjp(fwd, bwd)
    return sin


def _functions():
    """(mode, call_torch version, bare-callback version, pure JAX version) per mode."""
    sin = call_torch(torch.sin, lambda x: x)
    bare = _bare_sin()
    grad = lambda f: jax.jit(jax.grad(lambda x: f(x).sum()))
    return [
        ("forward", jax.jit(sin), jax.jit(bare), jax.jit(jnp.sin)),
        ("forward+backward (jax.grad)", grad(sin), grad(bare), grad(jnp.sin)),
    ]


def measure_call_overhead(calls: int) -> dict:
    """Median µs per jitted call of call_torch(torch.sin) and jnp.sin on a [7] array.

    Args:
        calls: timed calls per measurement (after one warm-up call).

    Returns:
        ``{"calls", "size", "rows": [{"mode", "call_torch_us", "bare_callback_us", "jax_us",
        "ratio", "overhead_us"}, ...]}``: one row for the forward and one for ``jax.grad``;
        ``ratio`` is call_torch / pure JAX and ``overhead_us`` their difference.

    Example:
        >>> r = measure_call_overhead(calls=5)
        >>> [row["mode"] for row in r["rows"]]
        ['forward', 'forward+backward (jax.grad)']
    """
    if calls < 1:
        raise ValueError(f"measure_call_overhead: calls must be >= 1, got {calls=}")
    x = jnp.linspace(0.0, 1.0, SIZE, dtype=jnp.float32)
    rows = []
    for mode, ours, bare, peer in _functions():
        ours_us = median_call_us(ours, (x,), calls)
        bare_us = median_call_us(bare, (x,), calls)
        peer_us = median_call_us(peer, (x,), calls)
        rows.append(
            {
                "mode": mode,
                "call_torch_us": ours_us,
                "bare_callback_us": bare_us,
                "jax_us": peer_us,
                "ratio": ours_us / peer_us,
                "overhead_us": ours_us - peer_us,
            }
        )
    return {"calls": calls, "size": SIZE, "rows": rows}


def _table(result: dict) -> Table:
    title = (
        f"call_torch overhead: jitted sin of a [{result['size']}] float32 array, "
        f"median of {result['calls']} calls"
    )
    cols = ("call_torch µs", "bare callback µs", "pure JAX µs", "ratio", "overhead µs")
    table = harness_table(title, "mode", cols)
    for r in result["rows"]:
        table.add_row(
            r["mode"],
            f"{r['call_torch_us']:.1f}",
            f"{r['bare_callback_us']:.1f}",
            f"{r['jax_us']:.1f}",
            f"{r['ratio']:.1f}x",
            f"{r['overhead_us']:.1f}",
        )
    return table


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_CALLS} calls, not {FULL_CALLS}")
    parser.add_argument("--calls", type=int, help="explicit number of timed calls")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/call_torch.json"))
    args = parser.parse_args(argv)
    calls = args.calls or (QUICK_CALLS if args.quick else FULL_CALLS)
    console = Console(width=120)
    with console.status(f"timing {calls} calls per measurement ..."):
        result = measure_call_overhead(calls)
    result |= {
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "jax": jax.__version__,
        "torch": torch.__version__,
        "backend": jax.default_backend(),
    }
    console.print(_table(result))
    write_json(args.out, result)
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
