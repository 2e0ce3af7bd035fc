"""Checkpoint conversion: throughput and peak memory, both ways, and call_torch's per-call cost.

A synthetic LLaMA-shaped fp32 checkpoint (random weights, generated tensor by tensor) is
written once as sharded Hugging Face safetensors into a temporary directory, then:

1. torch -> jax: ``torch_bridge.read_checkpoint`` (numpy parameters) and
   ``torch_bridge.load_hf`` (a jaxckpt model), in MB/s of checkpoint (1 MB = 10^6 B);
2. peak memory of each conversion, each in a fresh subprocess: the baseline is the RSS
   after the imports and JAX's initialisation (with freed heap memory handed back to the
   OS by ``malloc_trim``, so a phase cannot reuse it unseen); the high-water mark is reset there
   (``/proc/self/clear_refs``), so ``VmHWM`` / ``ru_maxrss`` afterwards is the
   conversion's own peak. "Peak extra" = peak - baseline - the model's bytes, reported as
   a multiple of the largest single tensor (criterion: at most ``GOAL_MULTIPLE``). A
   thread samples ``/proc/self/status`` every millisecond and records, at its highest
   sample, how much of the RSS above the baseline and the model is file-backed
   (``RssFile``: safetensors reads through mmap) and how much is anonymous;
3. jax -> torch: ``torch_bridge.save_hf`` of the model ``load_hf`` gave, in a fresh
   subprocess too; its peak extra is over the loaded model (the baseline holds it);
4. ``call_torch`` per-call overhead against the same function in pure JAX, forward and
   forward+backward (``bench_call_torch.measure_call_overhead``, or a minimal measurement
   of its own where that script is absent).

The checkpoint is read with a warm page cache (it was just written). Each phase runs
``--repeats`` times, each in its own process: the table shows the best time and the
largest peak. The temporary checkpoint is deleted at the end.

    python benchmarks/bench_convert.py            # ~0.97 GB checkpoint, 200 MB shards
    python benchmarks/bench_convert.py --quick    # ~0.12 GB checkpoint, 50 MB shards
"""

import argparse
import contextlib
import ctypes
import gc
import json
import math
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import numpy as np
from _results import write_json
from rich.console import Console
from rich.table import Table

MB = 10**6
KIB = 1024
GOAL_MULTIPLE = 3.0  # peak extra memory / largest tensor
SIZES = {  # vocab, d_model, layers, heads, ffn; shard size
    "full": (dict(vocab_size=32000, d_model=1024, n_layers=14, n_heads=8, ffn_dim=2752), "200MB"),
    "quick": (dict(vocab_size=16000, d_model=512, n_layers=4, n_heads=8, ffn_dim=1376), "50MB"),
}
PHASES = {  # worker phase -> row label
    "read": "torch -> jax: read_checkpoint (numpy)",
    "load": "torch -> jax: load_hf (JAX model)",
    "save": "jax -> torch: save_hf (safetensors)",
    "save1": "jax -> torch: save_hf (default 5GB: 1 shard)",
}
CALLS = {"full": 2000, "quick": 200}
SAMPLE_SECONDS = 0.001


# ----------------------------------------------------------------------------- memory probes


def proc_status() -> dict[str, int]:
    """``VmRSS``, ``VmHWM``, ``RssAnon``, ``RssFile``, ``RssShmem`` of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[name] = int(value.split()[0]) * KIB
    return out


def release_free_memory() -> None:
    """Give freed heap memory back to the OS (glibc ``malloc_trim``), so that the baseline
    RSS holds no free memory a later phase could reuse unseen."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def reset_peak() -> bool:
    """Reset this process's RSS high-water mark (VmHWM, and so ru_maxrss); False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


class Sampler(threading.Thread):
    """Samples ``proc_status`` every millisecond; keeps the sample of highest ``VmRSS``."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak = proc_status()
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(SAMPLE_SECONDS):
            sample = proc_status()
            if sample["VmRSS"] > self.peak["VmRSS"]:
                self.peak = sample

    def stop(self) -> dict[str, int]:
        self._stop_event.set()
        self.join()
        return self.peak


# ----------------------------------------------------------------------------- worker (one phase)


def _param_bytes(tree) -> int:
    import jax

    return sum(int(leaf.nbytes) for leaf in jax.tree.leaves(tree))


def worker(phase: str, path: Path, shard: str) -> dict:
    """One conversion in this (fresh) process: time, baseline and peak memory."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import torch_bridge

    jnp.zeros(1).block_until_ready()
    model = torch_bridge.load_hf(path) if phase.startswith("save") else None
    out_dir = Path(tempfile.mkdtemp(prefix="bench_convert_out_")) / "model"
    torch_before = "torch" in sys.modules
    release_free_memory()
    base = proc_status()
    reset = reset_peak()
    sampler = Sampler()
    sampler.start()
    start = time.perf_counter()
    if phase == "read":
        result = torch_bridge.read_checkpoint(path)
        model_bytes = _param_bytes(result.params)
    elif phase == "load":
        result = torch_bridge.load_hf(path)
        jax.block_until_ready(nnx.state(result, nnx.Param))
        model_bytes = _param_bytes(nnx.state(result, nnx.Param))
    else:
        options = {"max_shard_size": shard} if phase == "save" else {}  # save1: the default
        torch_bridge.save_hf(model, out_dir, **options)
        model_bytes = 0  # the loaded model is in the baseline
    seconds = time.perf_counter() - start
    sampled = sampler.stop()
    end = proc_status()
    shutil.rmtree(out_dir.parent, ignore_errors=True)
    return {
        "phase": phase,
        "seconds": seconds,
        "baseline": base,
        "hwm_reset": reset,
        "peak_bytes": max(end["VmHWM"], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KIB),
        "sampled_peak": sampled,
        "end": end,
        "model_bytes": model_bytes,
        "torch_imported_by_phase": not torch_before and "torch" in sys.modules,
    }


def run_worker(phase: str, path: Path, shard: str) -> dict:
    """``worker`` in a fresh Python process (so that its peak RSS is that phase's alone)."""
    cmd = [sys.executable, __file__, "--worker", phase, "--path", str(path), "--shard", shard]
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise RuntimeError(f"worker {phase} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- the checkpoint


def checkpoint_specs(config) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    """``(HF name, shape, dtype)`` of every tensor of ``config``, as ``write_hf`` builds them."""
    from torch_bridge._archs import architecture
    from torch_bridge._convert import export_order, target_shapes

    arch = architecture(config.family)
    shapes = target_shapes(arch, config)
    return [
        (key, rule.torch_shape({p: shapes[p].shape for p in rule.jax}), np.dtype(shapes[rule.jax[0]].dtype))
        for key, rule, _ in export_order(arch, config)
    ]


def write_checkpoint(directory: Path, config, specs, shard: str, seed: int = 0) -> None:
    """Random weights (ones for the norms), generated one tensor at a time, as HF shards."""
    from torch_bridge._hf_config import llama_hf_config
    from torch_bridge._writers import parse_shard_size, write_safetensors

    rng = np.random.default_rng(seed)
    shapes = {key: shape for key, shape, _ in specs}

    def get(key: str) -> np.ndarray:
        if len(shapes[key]) == 1:
            return np.ones(shapes[key], np.float32)
        return rng.standard_normal(shapes[key], dtype=np.float32) * np.float32(0.02)

    limit = parse_shard_size(shard)
    write_safetensors(directory, specs, get, max_shard_size=limit, metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(llama_hf_config(config), indent=2))


# ----------------------------------------------------------------------------- call_torch


def call_torch_overhead(calls: int) -> dict:
    """``bench_call_torch.measure_call_overhead``; a minimal measurement if it is absent."""
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        from bench_call_torch import measure_call_overhead
    except ImportError:
        return _own_call_overhead(calls)
    return measure_call_overhead(calls) | {"source": "bench_call_torch.measure_call_overhead"}


def _median_us(fn, x, calls: int) -> float:
    import jax

    jax.block_until_ready(fn(x))
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def _own_call_overhead(calls: int) -> dict:
    """Median µs of jitted ``call_torch(torch.sin)`` and ``jnp.sin`` on a [7] array."""
    import jax
    import jax.numpy as jnp

    from torch_bridge import call_torch
    from torch_bridge._torch import torch

    sin = call_torch(torch().sin, lambda x: x)
    grad = lambda f: jax.jit(jax.grad(lambda x: f(x).sum()))
    x = jnp.linspace(0.0, 1.0, 7, dtype=jnp.float32)
    rows = []
    for mode, ours, peer in (
        ("forward", jax.jit(sin), jax.jit(jnp.sin)),
        ("forward+backward (jax.grad)", grad(sin), grad(jnp.sin)),
    ):
        ours_us, peer_us = _median_us(ours, x, calls), _median_us(peer, x, calls)
        rows.append(
            {"mode": mode, "call_torch_us": ours_us, "jax_us": peer_us, "ratio": ours_us / peer_us}
            | {"overhead_us": ours_us - peer_us}
        )
    return {"calls": calls, "size": 7, "rows": rows, "source": "bench_convert (own measurement)"}


# ----------------------------------------------------------------------------- summary and tables


def summarise(phase: str, runs: list[dict], nbytes: int, largest: int) -> dict:
    """One table row from the repeats of a phase: best time, largest peak extra."""
    worst = max(runs, key=lambda r: r["peak_bytes"] - r["baseline"]["VmRSS"] - r["model_bytes"])
    base, sampled = worst["baseline"], worst["sampled_peak"]
    extra = worst["peak_bytes"] - base["VmRSS"] - worst["model_bytes"]
    seconds = min(r["seconds"] for r in runs)
    return {
        "phase": phase,
        "label": PHASES[phase],
        "seconds": seconds,
        "mb_per_s": nbytes / MB / seconds,
        "seconds_all": [r["seconds"] for r in runs],
        "baseline_bytes": base["VmRSS"],
        "peak_bytes": worst["peak_bytes"],
        "model_bytes": worst["model_bytes"],
        "peak_extra_bytes": extra,
        "peak_extra_all": [r["peak_bytes"] - r["baseline"]["VmRSS"] - r["model_bytes"] for r in runs],
        "multiple_of_largest": extra / largest,
        "meets_goal": extra <= GOAL_MULTIPLE * largest,
        "sampled_peak_bytes": sampled["VmRSS"],
        "file_backed_extra_bytes": sampled["RssFile"] - base["RssFile"],
        "anon_extra_bytes": sampled["RssAnon"] - base["RssAnon"] - worst["model_bytes"],
        "hwm_reset": worst["hwm_reset"],
        "torch_imported_by_phase": worst["torch_imported_by_phase"],
    }


def conversion_table(result: dict) -> Table:
    ck = result["checkpoint"]
    title = (
        f"checkpoint conversion: LLaMA fp32 {ck['bytes'] / MB:.0f} MB in {ck['shards']} shards, "
        f"largest tensor {ck['largest_bytes'] / MB:.1f} MB; MB = 10^6 B"
    )
    table = Table(title=title)
    table.add_column("phase")
    cols = ("s", "MB/s", "baseline MB", "peak MB", "model MB", "peak extra MB", "x largest")
    for col in (*cols, "file-backed MB", "anon MB", f"<= {GOAL_MULTIPLE:g}x"):
        table.add_column(col, justify="right")
    for r in result["conversion"]:
        table.add_row(
            r["label"],
            f"{r['seconds']:.2f}",
            f"{r['mb_per_s']:.0f}",
            f"{r['baseline_bytes'] / MB:.0f}",
            f"{r['peak_bytes'] / MB:.0f}",
            f"{r['model_bytes'] / MB:.0f}",
            f"{r['peak_extra_bytes'] / MB:.0f}",
            f"{r['multiple_of_largest']:.2f}",
            f"{r['file_backed_extra_bytes'] / MB:.0f}",
            f"{r['anon_extra_bytes'] / MB:.0f}",
            "PASS" if r["meets_goal"] else "NOT MET",
        )
    return table


def call_torch_table(result: dict) -> Table:
    title = (
        f"call_torch overhead: jitted sin of a [{result['size']}] float32 array, "
        f"median of {result['calls']} calls"
    )
    table = Table(title=title)
    table.add_column("mode")
    bare = all("bare_callback_us" in r for r in result["rows"])  # bench_call_torch's floor
    cols = ("call_torch µs", *(("bare callback µs",) if bare else ()), "pure JAX µs", "ratio", "overhead µs")
    for col in cols:
        table.add_column(col, justify="right")
    for r in result["rows"]:
        floor = (f"{r['bare_callback_us']:.1f}",) if bare else ()
        table.add_row(
            r["mode"],
            f"{r['call_torch_us']:.1f}",
            *floor,
            f"{r['jax_us']:.1f}",
            f"{r['ratio']:.1f}x",
            f"{r['overhead_us']:.1f}",
        )
    return table


def verdict(rows: list[dict]) -> str:
    worst = max(rows, key=lambda r: r["multiple_of_largest"])
    status = "PASS" if worst["meets_goal"] else "NOT MET"
    return (
        f"criterion: peak extra memory <= {GOAL_MULTIPLE:g}x the largest tensor in every phase: {status} "
        f"(worst: {worst['label']}, {worst['multiple_of_largest']:.2f}x, "
        f"of which file-backed {worst['file_backed_extra_bytes'] / MB:.0f} MB at the sampled peak)"
    )


# ----------------------------------------------------------------------------- main


def bench(size: str, repeats: int, calls: int, console: Console) -> dict:
    from jaxckpt import nn

    fields, shard = SIZES[size]
    config = nn.TransformerConfig(family="llama", max_len=2048, **fields)
    specs = checkpoint_specs(config)
    sizes = [math.prod(shape) * dtype.itemsize for _, shape, dtype in specs]
    root = Path(tempfile.mkdtemp(prefix="bench_convert_"))
    try:
        path = root / "llama"
        path.mkdir()
        with console.status(f"writing {sum(sizes) / MB:.0f} MB of random weights ..."):
            start = time.perf_counter()
            write_checkpoint(path, config, specs, shard)
            write_s = time.perf_counter() - start
        checkpoint = {"config": fields, "shard_size": shard, "bytes": sum(sizes), "largest_bytes": max(sizes)}
        checkpoint |= {"tensors": len(specs), "shards": len(list(path.glob("*.safetensors")))}
        checkpoint |= {"write_seconds_incl_random": write_s}
        rows = []
        for phase in PHASES:
            runs = []
            for i in range(repeats):
                with console.status(f"{PHASES[phase]} (run {i + 1}/{repeats}, fresh process) ..."):
                    runs.append(run_worker(phase, path, shard))
            rows.append(summarise(phase, runs, sum(sizes), max(sizes)))
            console.print(f"done {PHASES[phase]}: {rows[-1]['seconds']:.2f} s")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    with console.status(f"call_torch: {calls} calls per measurement ..."):
        overhead = call_torch_overhead(calls)
    return {"checkpoint": checkpoint, "conversion": rows, "call_torch": overhead}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a ~0.12 GB checkpoint, 200 call_torch calls")
    parser.add_argument("--repeats", type=int, default=2, help="fresh processes per phase")
    parser.add_argument("--calls", type=int, help="timed call_torch calls per measurement")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/convert.json"))
    parser.add_argument("--worker", choices=tuple(PHASES), help=argparse.SUPPRESS)
    parser.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--shard", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.path, args.shard)))
        return
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    size = "quick" if args.quick else "full"
    console = Console(width=160)
    result = bench(size, args.repeats, args.calls or CALLS[size], console)
    result |= {"goal_multiple": GOAL_MULTIPLE, "size": size, "repeats": args.repeats}
    result |= {"cpu_count": os.cpu_count(), "machine": platform.machine()}
    result["passes"] = all(r["meets_goal"] for r in result["conversion"])
    console.print(conversion_table(result))
    console.print(verdict(result["conversion"]))
    console.print(call_torch_table(result["call_torch"]))
    write_json(args.out, result)
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
