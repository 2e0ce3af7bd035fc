"""The Pallas kernel's speed grid (a part of ``gpu_check.py``): bf16 TFLOP/s, fwd and fwd+bwd.

``implementation="pallas"`` against ``"cudnn"`` and JAX's own Pallas kernel
(``jax.experimental.pallas.ops.gpu.attention.mha``, MHA only: N = K) in the same process,
for T in ``mode["pallas_seqs"]``, H in ``mode["pallas_heads"]``, causal and not, at
``mode["tokens"]`` tokens per call (B = tokens / T). H=128 causal runs first: a part cut
by its deadline keeps the rows that matter most. FLOPs as FlashAttention-2's benchmark:
fwd = 4*B*N*T*S*H (halved for causal), fwd+bwd = 3.5 x fwd.

Targets (issue 20): the forward >= 50% of the H200's 989 TFLOP/s, and fwd+bwd >= 0.8x
cuDNN on the calls both take.
"""

import functools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness

import jax
import jax.numpy as jnp
from harness import run_seconds
from jax.experimental.pallas.ops.gpu import attention as jax_pallas

import jaxckpt

PEER = "jax_pallas_mha"
IMPLS = ("pallas", "cudnn", PEER)


def _attention(impl: str, causal: bool, interpret: bool):
    if impl == PEER:
        blocks = jax_pallas.BlockSizes.get_default()
        return functools.partial(
            jax_pallas.mha,
            segment_ids=None,
            causal=causal,
            sm_scale=1.0,
            block_sizes=blocks,
            interpret=interpret,
        )
    return functools.partial(jaxckpt.flash_attention, is_causal=causal, implementation=impl, scale=1.0)


def run_times(fn, args, reps: int, deadline: float) -> list[float]:
    """Seconds of ``reps`` runs of ``fn(*args)`` after a warm-up (at least one, then until the deadline)."""
    return run_seconds(fn, args, reps, deadline=deadline)


def _one(impl: str, q, k, v, causal: bool, fwd_flops: float, reps: int, deadline: float, interpret: bool):
    attend = _attention(impl, causal, interpret)
    fwd = jax.jit(attend)

    def loss(q, k, v):
        return jnp.sum(attend(q, k, v).astype(jnp.float32))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    row = {}
    for name, fn, flops in (("fwd", fwd, fwd_flops), ("fwd+bwd", step, 3.5 * fwd_flops)):
        seconds = statistics.median(run_times(fn, (q, k, v), reps, deadline))
        row[name] = {"median_s": seconds, "tflops": flops / seconds / 1e12}
    return row


def grid(mode: dict) -> list[tuple[int, int, bool]]:
    """(H, T, causal), the most important first."""
    heads = sorted(mode["pallas_heads"], reverse=True)
    return [(h, t, causal) for h in heads for causal in (True, False) for t in mode["pallas_seqs"]]


def part_pallas(mode: dict, args, emit, *, peak_tflops: float) -> None:
    """Emits one row per (implementation, H, T, causal): fwd and fwd+bwd TFLOP/s."""
    interpret = jax.default_backend() != "gpu"  # the smoke run: the peer's kernel interpreted too
    n = mode["pallas_n"]
    for h, t, causal in grid(mode):
        b = max(1, mode["tokens"] // t)
        keys = jax.random.split(jax.random.key(t + h), 3)
        q, k, v = (jax.random.normal(key, (b, t, n, h), jnp.bfloat16) for key in keys)
        fwd_flops = 4 * b * n * t * t * h / (2 if causal else 1)
        for impl in IMPLS:
            row = {"implementation": impl, "B": b, "T": t, "N": n, "H": h, "causal": causal}
            if impl == "cudnn" and interpret:
                emit({**row, "status": "skipped", "reason": "cuDNN needs a GPU"})
                continue
            if time.time() > args.deadline:
                emit({**row, "status": "skipped", "reason": "part deadline"})
                continue
            try:
                result = _one(impl, q, k, v, causal, fwd_flops, mode["reps"], args.deadline, interpret)
            except Exception as err:  # a refusal or a failure is the result
                emit({**row, "status": "error", "reason": f"{type(err).__name__}: {err}"[:300]})
                continue
            for p in result.values():
                p["fraction_of_peak"] = p["tflops"] / peak_tflops
            emit({**row, "status": "ok", **result})
        del q, k, v


def summary(rows: list[dict]) -> dict:
    """Per (H, T, causal): pallas' fwd fraction of peak and its fwd+bwd ratio to cuDNN and to JAX's kernel."""
    by = {(r["H"], r["T"], r["causal"], r["implementation"]): r for r in rows if r["status"] == "ok"}
    out = []
    for (h, t, causal, impl), r in by.items():
        if impl != "pallas":
            continue
        ratio = {}
        for peer in ("cudnn", PEER):
            other = by.get((h, t, causal, peer))
            if other:
                ratio[f"fwd_bwd_vs_{peer}"] = r["fwd+bwd"]["tflops"] / other["fwd+bwd"]["tflops"]
        out.append({"H": h, "T": t, "causal": causal, "fwd_of_peak": r["fwd"]["fraction_of_peak"], **ratio})
    return {"targets": "fwd >= 50% of peak; fwd+bwd >= 0.8x cudnn", "rows": out}
