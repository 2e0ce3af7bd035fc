"""Checkpoint conversion: throughput and peak memory, both ways, and call_torch's per-call cost.

A synthetic LLaMA-shaped fp32 checkpoint (random weights, generated tensor by tensor) is
written once as sharded Hugging Face safetensors into a temporary directory, then:

1. torch -> jax: ``torch_bridge.read_checkpoint`` (numpy parameters) and
   ``torch_bridge.load_hf`` (a jaxckpt model), in MB/s of checkpoint (1 MB = 10^6 B);
2. peak memory of each conversion, each in a fresh subprocess: the baseline is the RSS
   after the imports and JAX's initialisation (with freed heap memory handed back to the
   OS by ``malloc_trim``, so a phase cannot reuse it unseen); the high-water mark is reset there
   (``/proc/self/clear_refs``), so ``VmHWM`` afterwards is the conversion's own peak.
   (Not ``ru_maxrss``: clear_refs does not reset it, and Linux carries it over ``execve``
   from the parent, so a worker started by a parent of 600 MB reports at least 600 MB;
   it is kept in the JSON as ``ru_maxrss_bytes``.) "Peak extra" = peak - baseline - the
   model's bytes, reported as a multiple of the largest single tensor (criterion: at most
   ``GOAL_MULTIPLE``). A thread samples ``/proc/self/status`` every millisecond and
   records, at its highest sample, how much of the RSS above the baseline and the model is
   file-backed (``RssFile``: safetensors reads through mmap) and how much is anonymous;
3. jax -> torch: ``torch_bridge.save_hf`` of the model ``load_hf`` gave, in a fresh
   subprocess too; its peak extra is over the loaded model (the baseline holds it);
4. ``call_torch`` per-call overhead against the same function in pure JAX, forward and
   forward+backward (``bench_call_torch.measure_call_overhead``, or a minimal measurement
   of its own where that script is absent);
5. one row per family ``torch_bridge`` converts (``--families``, default all): a checkpoint
   of that family's own layout, built as the LLaMA one is, tensor by tensor from the
   family's export order (``torch_bridge.export_order`` and ``Rule.torch_shape``,
   as ``write_hf`` builds its specs) with its ``config.json`` (``arch.hf_config``), then
   read_checkpoint, load_hf and save_hf, each in fresh processes as above: MB/s and peak
   extra memory against the same criterion. Each family's config is its preset
   (``FAMILY_PRESETS``) shrunk to the size's vocabulary, width and heads, keeping the
   family's GQA ratio, MLP ratio, biases, norms, tying and layer pattern; the number of
   layers is then chosen so the checkpoint is about as big as the LLaMA one. Phi-3's fused
   ``qkv_proj``/``gate_up_proj`` and GPT-2's ``c_attn`` are split on reading and
   concatenated on saving; the "fused MB" column is the largest such tensor. (Reading
   maps one shard at a time, and its pages count as file-backed RSS until the shard is
   closed, so read's peak extra grows with the shard size, not only with the largest tensor.)

The checkpoint is read with a warm page cache (it was just written). Each phase runs
``--repeats`` times, each in its own process: the table shows the best time and the
largest peak. The temporary checkpoint is deleted at the end.

    python benchmarks/speed/bench_convert.py            # ~0.97 GB checkpoint, 200 MB shards
    python benchmarks/speed/bench_convert.py --quick    # ~0.12 GB checkpoint, 50 MB shards
    python benchmarks/speed/bench_convert.py --quick --families phi3,gpt2   # those families only
    python benchmarks/speed/bench_convert.py --families none                # the LLaMA part only
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
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
from harness import median_call_us, write_json
from harness import table as harness_table

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import numpy as np
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
FAMILY_PHASES = ("read", "load", "save")  # per family: save_hf with the size's shards
CALLS = {"full": 2000, "quick": 200}
FAMILY_PRESETS = {  # family -> the jaxckpt.nn preset its benchmark config is shrunk from
    "llama": "llama3.2-1b",
    "mistral": "mistral-7b",
    "qwen2": "qwen2.5-0.5b",
    "qwen3": "qwen3-0.6b",
    "smollm3": None,  # no preset: SMOLLM3 below
    "gemma2": "gemma2-2b",
    "gemma3": "gemma3-1b",
    "phi3": "phi3-mini",
    "gpt2": "gpt2",
}
SMOLLM3 = dict(  # HuggingFaceTB/SmolLM3-3B's shape: LLaMA-like, every fourth layer without RoPE
    family="smollm3",
    vocab_size=128256,
    d_model=2048,
    n_layers=36,
    n_heads=16,
    n_kv_heads=4,
    ffn_dim=11008,
    max_len=65536,
    rope_theta=5000000.0,
    norm_eps=1e-6,
    tie_embeddings=True,
    layer_pattern=("full", "full", "full", "full_nope"),
)
FFN_MULTIPLE = 32  # the shrunk MLP width is rounded to a multiple of this
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
    """Reset this process's RSS high-water mark (VmHWM; not ru_maxrss); False if refused."""
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
        "peak_bytes": end["VmHWM"],
        "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KIB,  # see the docstring
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
    from torch_bridge import architecture, export_order, target_shapes

    arch = architecture(config.family)
    shapes = target_shapes(arch, config)
    return [
        (key, rule.torch_shape({p: shapes[p].shape for p in rule.jax}), np.dtype(shapes[rule.jax[0]].dtype))
        for key, rule, _ in export_order(arch, config)
    ]


def write_checkpoint(directory: Path, config, specs, shard: str, seed: int = 0) -> None:
    """Random weights (ones for the norms and biases), generated one tensor at a time, as HF
    shards, and the family's ``config.json``."""
    from torch_bridge import architecture, parse_shard_size, write_safetensors

    rng = np.random.default_rng(seed)
    shapes = {key: shape for key, shape, _ in specs}

    def get(key: str) -> np.ndarray:
        if len(shapes[key]) == 1:
            return np.ones(shapes[key], np.float32)
        return rng.standard_normal(shapes[key], dtype=np.float32) * np.float32(0.02)

    limit = parse_shard_size(shard)
    write_safetensors(directory, specs, get, max_shard_size=limit, metadata={"format": "pt"})
    hf_config = architecture(config.family).hf_config(config)
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2))


def fused_keys(config) -> set[str]:
    """The HF names of the fused tensors of ``config``: those split into several parameters
    on reading (Phi-3's ``qkv_proj``/``gate_up_proj``, GPT-2's ``c_attn``)."""
    from torch_bridge import architecture, export_order

    return {key for key, rule, _ in export_order(architecture(config.family), config) if len(rule.jax) > 1}


def _checkpoint_bytes(config) -> int:
    return sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in checkpoint_specs(config))


def family_config(family: str, size: str):
    """The benchmark config of ``family``: its preset (``FAMILY_PRESETS``) at the size's
    vocabulary, width and heads (head_dim = d_model / n_heads), in fp32, keeping the family's
    ratios of query to key/value heads and of MLP to model width; then as many layers as
    bring the checkpoint closest to the LLaMA one of that size."""
    from jaxckpt import nn

    fields = SIZES[size][0]
    preset = FAMILY_PRESETS[family]
    base = nn.PRESETS[preset] if preset is not None else nn.TransformerConfig(**SMOLLM3)
    if base.family != family:
        raise ValueError(f"preset {preset!r} is family {base.family!r}, not {family!r}")
    d_model, heads = fields["d_model"], fields["n_heads"]
    kv_heads = max(1, heads * base.n_kv_heads // base.n_heads)
    while heads % kv_heads:
        kv_heads -= 1
    ffn = max(FFN_MULTIPLE, round(base.ffn_dim / base.d_model * d_model / FFN_MULTIPLE) * FFN_MULTIPLE)
    config = base.replace(
        vocab_size=fields["vocab_size"],
        d_model=d_model,
        n_heads=heads,
        n_kv_heads=kv_heads,
        head_dim=d_model // heads,
        ffn_dim=ffn,
        n_layers=1,
        dtype="float32",
        param_dtype="float32",
    )
    target = _checkpoint_bytes(nn.TransformerConfig(family="llama", max_len=2048, **fields))
    one, two = _checkpoint_bytes(config), _checkpoint_bytes(config.replace(n_layers=2))
    layers = max(1, round((target - (2 * one - two)) / (two - one)))
    return config.replace(n_layers=layers)


# ----------------------------------------------------------------------------- call_torch


def call_torch_overhead(calls: int) -> dict:
    """``bench_call_torch.measure_call_overhead``; a minimal measurement if it is absent."""
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        from bench_call_torch import measure_call_overhead
    except ImportError:
        return _own_call_overhead(calls)
    return measure_call_overhead(calls) | {"source": "bench_call_torch.measure_call_overhead"}


def _own_call_overhead(calls: int) -> dict:
    """Median µs of jitted ``call_torch(torch.sin)`` and ``jnp.sin`` on a [7] array."""
    import jax
    import jax.numpy as jnp
    import torch

    from torch_bridge import call_torch

    sin = call_torch(torch.sin, lambda x: x)
    grad = lambda f: jax.jit(jax.grad(lambda x: f(x).sum()))
    x = jnp.linspace(0.0, 1.0, 7, dtype=jnp.float32)
    rows = []
    for mode, ours, peer in (
        ("forward", jax.jit(sin), jax.jit(jnp.sin)),
        ("forward+backward (jax.grad)", grad(sin), grad(jnp.sin)),
    ):
        ours_us, peer_us = median_call_us(ours, (x,), calls), median_call_us(peer, (x,), calls)
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
        "ru_maxrss_bytes": worst["ru_maxrss_bytes"],
        "torch_imported_by_phase": worst["torch_imported_by_phase"],
    }


def conversion_table(result: dict) -> Table:
    ck = result["checkpoint"]
    title = (
        f"checkpoint conversion: LLaMA fp32 {ck['bytes'] / MB:.0f} MB in {ck['shards']} shards, "
        f"largest tensor {ck['largest_bytes'] / MB:.1f} MB; MB = 10^6 B"
    )
    cols = ("s", "MB/s", "baseline MB", "peak MB", "model MB", "peak extra MB", "x largest")
    table = harness_table(title, "phase", (*cols, "file-backed MB", "anon MB", f"<= {GOAL_MULTIPLE:g}x"))
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
    bare = all("bare_callback_us" in r for r in result["rows"])  # bench_call_torch's floor
    cols = ("call_torch µs", *(("bare callback µs",) if bare else ()), "pure JAX µs", "ratio", "overhead µs")
    table = harness_table(title, "mode", cols)
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


def family_table(families: list[dict], size: str) -> Table:
    title = (
        f"checkpoint conversion per family ({size}): fp32, {families[0]['shard_size']} shards; MB/s of "
        f"checkpoint; peak extra as a multiple of the largest tensor (<= {GOAL_MULTIPLE:g}x); MB = 10^6 B"
    )
    table = Table(title=title)
    for col in ("family", "from preset"):
        table.add_column(col)
    cols = ("layers", "ckpt MB", "largest MB", "fused MB", "read MB/s", "load MB/s", "save MB/s")
    ok = f"<= {GOAL_MULTIPLE:g}x"
    for col in (*cols, "read x", ok, "load x", ok, "save x", ok):
        table.add_column(col, justify="right")
    for f in families:
        ph = f["phases"]
        peaks = []
        for phase in FAMILY_PHASES:
            peaks += [
                f"{ph[phase]['multiple_of_largest']:.2f}",
                "PASS" if ph[phase]["meets_goal"] else "NOT MET",
            ]
        table.add_row(
            f["family"],
            f["preset"] or "none: SMOLLM3",
            str(f["config"]["n_layers"]),
            f"{f['bytes'] / MB:.0f}",
            f"{f['largest_bytes'] / MB:.1f}",
            f"{f['largest_fused_bytes'] / MB:.1f}" if f["fused_tensors"] else "-",
            *(f"{ph[phase]['mb_per_s']:.0f}" for phase in FAMILY_PHASES),
            *peaks,
        )
    return table


def family_verdict(families: list[dict]) -> str:
    rows = [(f["family"], row) for f in families for row in f["phases"].values()]
    family, worst = max(rows, key=lambda fr: fr[1]["multiple_of_largest"])
    status = "PASS" if all(row["meets_goal"] for _, row in rows) else "NOT MET"
    return (
        f"criterion per family: peak extra memory <= {GOAL_MULTIPLE:g}x the largest tensor, read, load and "
        f"save, in every family: {status} (worst: {family} {worst['phase']}, "
        f"{worst['multiple_of_largest']:.2f}x, {worst['peak_extra_bytes'] / MB:.0f} MB, of which file-backed "
        f"{worst['file_backed_extra_bytes'] / MB:.0f} MB at the sampled peak)"
    )


def verdict(rows: list[dict]) -> str:
    worst = max(rows, key=lambda r: r["multiple_of_largest"])
    status = "PASS" if worst["meets_goal"] else "NOT MET"
    return (
        f"criterion: peak extra memory <= {GOAL_MULTIPLE:g}x the largest tensor in every phase: {status} "
        f"(worst: {worst['label']}, {worst['multiple_of_largest']:.2f}x, "
        f"of which file-backed {worst['file_backed_extra_bytes'] / MB:.0f} MB at the sampled peak)"
    )


# ----------------------------------------------------------------------------- main


def run_phases(phases, path: Path, shard: str, repeats: int, nbytes: int, largest: int, console, what=""):
    """Each phase ``repeats`` times in fresh processes; one summary row per phase."""
    rows = []
    for phase in phases:
        runs = []
        for i in range(repeats):
            with console.status(f"{what}{PHASES[phase]} (run {i + 1}/{repeats}, fresh process) ..."):
                runs.append(run_worker(phase, path, shard))
        rows.append(summarise(phase, runs, nbytes, largest))
        console.print(f"done {what}{PHASES[phase]}: {rows[-1]['seconds']:.2f} s")
    return rows


def bench_family(family: str, size: str, repeats: int, console: Console) -> dict:
    """One family's checkpoint, written, converted both ways in fresh processes, deleted."""
    config = family_config(family, size)
    shard = SIZES[size][1]
    specs = checkpoint_specs(config)
    sizes = {key: math.prod(shape) * dtype.itemsize for key, shape, dtype in specs}
    largest_key = max(sizes, key=sizes.get)
    fused = fused_keys(config)
    root = Path(tempfile.mkdtemp(prefix=f"bench_convert_{family}_"))
    try:
        path = root / family
        path.mkdir()
        with console.status(f"{family}: writing {sum(sizes.values()) / MB:.0f} MB of random weights ..."):
            start = time.perf_counter()
            write_checkpoint(path, config, specs, shard)
            write_s = time.perf_counter() - start
        shards = len(list(path.glob("*.safetensors")))
        nbytes, largest = sum(sizes.values()), sizes[largest_key]
        rows = run_phases(FAMILY_PHASES, path, shard, repeats, nbytes, largest, console, f"{family}: ")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "family": family,
        "preset": FAMILY_PRESETS[family],
        "config": config.to_dict(),
        "shard_size": shard,
        "bytes": nbytes,
        "largest_bytes": largest,
        "largest_tensor": largest_key,
        "fused_tensors": len(fused),
        "largest_fused_bytes": max((sizes[k] for k in fused), default=0),
        "largest_fused_tensor": max(fused, key=sizes.get, default=None),
        "tensors": len(specs),
        "shards": shards,
        "write_seconds_incl_random": write_s,
        "phases": {row["phase"]: row for row in rows},
        "passes": all(row["meets_goal"] for row in rows),
    }


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
        rows = run_phases(PHASES, path, shard, repeats, sum(sizes), max(sizes), console)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    with console.status(f"call_torch: {calls} calls per measurement ..."):
        overhead = call_torch_overhead(calls)
    return {"checkpoint": checkpoint, "conversion": rows, "call_torch": overhead}


def parse_families(values: list[str] | None) -> list[str]:
    """``--families`` (names, comma- or space-separated; ``all``, ``none``) as a list."""
    names = [n for v in values or ["all"] for n in v.split(",") if n]
    if names == ["none"]:
        return []
    if "all" in names:
        return list(FAMILY_PRESETS)
    unknown = sorted(set(names) - set(FAMILY_PRESETS))
    if unknown:
        raise ValueError(f"--families: unknown {', '.join(unknown)}; known: {', '.join(FAMILY_PRESETS)}")
    return list(dict.fromkeys(names))


def unbenched_families() -> list[str]:
    """Families ``torch_bridge`` converts (an ARCHITECTURES entry with a model_type) that
    ``FAMILY_PRESETS`` has no config for."""
    from torch_bridge import ARCHITECTURES

    return [n for n, a in ARCHITECTURES.items() if a.model_type is not None and n not in FAMILY_PRESETS]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a ~0.12 GB checkpoint, 200 call_torch calls")
    parser.add_argument("--repeats", type=int, default=2, help="fresh processes per phase")
    parser.add_argument("--calls", type=int, help="timed call_torch calls per measurement")
    parser.add_argument(
        "--families",
        nargs="+",
        metavar="FAMILY",
        help=f"families for the per-family table, comma- or space-separated: {', '.join(FAMILY_PRESETS)}, "
        "'all' (the default) or 'none'",
    )
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
    try:
        families = parse_families(args.families)
    except ValueError as err:
        parser.error(str(err))
    size = "quick" if args.quick else "full"
    console = Console(width=160)
    missing = unbenched_families()
    if missing:
        console.print(
            f"note: torch_bridge converts {', '.join(missing)}, which FAMILY_PRESETS does not cover"
        )
    result = bench(size, args.repeats, args.calls or CALLS[size], console)
    result["families"] = [bench_family(family, size, args.repeats, console) for family in families]
    result |= {"goal_multiple": GOAL_MULTIPLE, "size": size, "repeats": args.repeats}
    result |= {"cpu_count": os.cpu_count(), "machine": platform.machine()}
    result["families_pass"] = all(f["passes"] for f in result["families"])
    result["conversion_passes"] = all(r["meets_goal"] for r in result["conversion"])
    result["passes"] = result["conversion_passes"] and result["families_pass"]
    console.print(conversion_table(result))
    console.print(verdict(result["conversion"]))
    console.print(call_torch_table(result["call_torch"]))
    if result["families"]:
        console.print(family_table(result["families"], size))
        console.print(family_verdict(result["families"]))
    write_json(args.out, result)
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
