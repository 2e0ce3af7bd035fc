"""One GPU check, run once on one H200 in at most 8 minutes: attention correctness and speed,
and the real train step's memory and speed against the planner.

    python benchmarks/gpu_check.py            # one H200 -> benchmarks/results/gpu_check.json
    python benchmarks/gpu_check.py --smoke    # every part on the CPU, at the fewest items and sizes

Parts:

1. **contract**: every GPU attention implementation (the available ones but "reference":
   blockwise, xla, cudnn, pallas if registered) in bfloat16 on 10 cases of
   ``tests/_support/attention_cases.py`` (MHA, GQA, then each feature alone on the GQA shape), out,
   lse and gradients against ``attention_reference`` (fp32 math, run at "highest" matmul
   precision so that no TF32 enters the ground truth) with the bf16 tolerances of
   ``tests/_support/tolerances.py``; a feature outside ``Implementation.supports`` is a skip.
2b. **pallas**: the Pallas kernel's grid (``speed/_pallas_speed.py``): bf16 fwd and fwd+bwd
   TFLOP/s, T in {1k, 4k, 16k, 32k}, H in {64, 128}, causal and not, against cuDNN and
   JAX's own Pallas attention in the same run.
2. **throughput**: fwd+bwd of each implementation, causal, B*T = 32768 tokens, N=16,
   H=128, T in {2048, 8192, 32768}; median of 5 reps after a warm-up. FLOPs follow the
   FlashAttention-2 benchmark: fwd = 4*B*N*T*S*H, halved for causal; bwd = 2.5 x fwd, so
   fwd+bwd = 3.5 x fwd (as ``speed/bench_attention.py``). TFLOP/s and the fraction of the
   H200's 989 TFLOP/s dense bf16 peak; a call whose compiled buffers exceed 85% of the
   device's memory is skipped.
3. **train**: the real train step (``train.Trainer``, AdamW, bf16 params and compute, auto
   attention) of ``llama3.2-1b`` (B=8, T=2048) and ``small`` (B=16, T=2048) under each remat
   preset: ``peak_bytes_in_use``, tokens/s, against ``plan.measure(..., target="h200-141g")``
   (deviceless XLA:GPU) and ``plan.predict``.

Memory is measured in a fresh process per configuration. JAX cannot reset the allocator's
peak, and a process's allocator never gives memory back, so in one process a later
configuration's peak hides under an earlier, larger one, and deltas of ``bytes_in_use``
miss the transient peak inside a step. A fresh process's ``peak_bytes_in_use`` is exactly
its configuration's peak: the model's initialisation comes before the step and needs less
(the state without gradients or activations); ``stats_before_step`` holds the peak before
the first step and ``peak_from_step`` says whether the steps raised it. Every process runs
with ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (``MEM_FRACTION=0.92``), so that it holds what
it uses and no more.

Organisation and budget. This process orchestrates; on the GPU it holds a context only (its
backend check) and allocates nothing. Every part runs as a subprocess of this script
(``--part``), one at a time on the GPU; the next is started while the current one runs and
waits on its stdin before it touches the GPU, so Python and JAX start-up overlap the
previous job. Each child writes its items as JSON lines as they finish; a child that
overruns its time is killed and its finished items are kept.
The deviceless predictions run on the CPU (``JAX_PLATFORMS=cpu``) in one more subprocess,
beside the GPU parts. A global deadline (``--budget-s``, default 450 s from start) and a
cap per part bound the run; an item that cannot start in time is recorded as skipped, with
the reason. Expected on an H200 (estimates: not yet run on one):

    start-up, backend check     ~10 s
    contract    cap  90 s  ~60 s  10 cases x (reference + <= 4 implementations): one jit of
                                  fwd+grads each, ~1-2 s of XLA:GPU compile, ms to run
    throughput  cap 110 s  ~70 s  3 T x <= 4 implementations: 2-5 s compile, warm-up +
                                  5 reps of <= 15 TFLOP (<= 0.2 s each)
    pallas      cap 150 s         16 shapes x 3 kernels x (fwd, fwd+bwd): ~2 s compile each;
                                  H=128 causal first, the rest as the cap allows
    train       the rest  ~190 s  10 fresh processes; llama3.2-1b: init ~3 s, autotuned
                                  compile 10-25 s, 7 steps of ~0.3-0.5 s; small ~10 s
    predictions (CPU, beside)     10 deviceless compiles x 2 GEMM emitters, ~120 s

Compile caches are off (``JAX_ENABLE_COMPILATION_CACHE=false``): every compile is cold and
nothing from an earlier run is reused. ``--dump-autotune DIR`` also writes each train
step's XLA:GPU autotune results there (for ``plan.measure(..., autotune_results=)``).
Without a GPU backend the script refuses (exit 2) unless ``--smoke``.
"""

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
# Each process takes what it uses: this one holds a context only, the children one at a time.
os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.92"
sys.path.insert(
    0, str(Path(__file__).resolve().parents[1] / "tests" / "_support")
)  # attention_cases, tolerances

import jax
import jax.numpy as jnp
import numpy as np
from harness import write_json
from rich.console import Console
from rich.table import Table
from speed._pallas_speed import part_pallas, run_times
from speed._pallas_speed import summary as pallas_summary

import jaxckpt
from jaxckpt import nn, plan

T0 = time.time()  # the budget's start (imports take a few seconds before it)
TARGET, PEAK_TFLOPS = "h200-141g", 989.0
REMATS = ("none", "full", "save_attn", "minimal", "dots")
FLOPS = "fwd = 4*B*N*T*S*H (/2 causal); fwd+bwd = 3.5 x fwd (bwd = 2.5 x fwd, FlashAttention-2)"
MODES = {
    "full": dict(
        contract=dict(b=2, t=257, s=257, n=8, k=2, h=128),
        contract_others=None,  # every implementation runs every case
        seqs=(2048, 8192, 32768),
        tokens=32768,
        heads=(16, 128),
        reps=5,
        models={"llama3.2-1b": ({}, 8, 2048), "small": ({}, 16, 2048)},
        remats={"llama3.2-1b": REMATS, "small": REMATS},
        deviceless=REMATS,
        steps=5,
        pallas_seqs=(1024, 4096, 16384, 32768),
        pallas_heads=(64, 128),
        pallas_n=16,
        caps={"contract": 90, "throughput": 110, "pallas": 150},
        min_start={"contract": 20, "throughput": 20, "pallas": 30, "llama3.2-1b": 25, "small": 12},
    ),
    "smoke": dict(
        contract=dict(b=1, t=33, s=33, n=4, k=2, h=16),
        # blockwise (it supports every feature) runs every case; the others, interpreted Pallas
        # taking ~5 s a case, the GQA one: tests/attention's contract suite checks them all
        contract_others=("gqa",),
        seqs=(64,),
        tokens=256,
        heads=(2, 16),
        reps=1,
        models={
            "llama3.2-1b": (
                dict(
                    d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128, vocab_size=512
                ),
                2,
                32,
            ),
            "small": (dict(d_model=64, n_layers=2, n_heads=2, ffn_dim=128), 2, 32),
        },
        # each model once, and the two presets the report needs: "none" (the base of
        # tokens_per_s_vs_none) and "full" (the deviceless compile, ~20 s of CPU); every train
        # configuration is its own ~20 s process, and tests/ cover every preset
        remats={"llama3.2-1b": ("none", "full"), "small": ("none",)},
        deviceless=("full",),
        steps=1,
        pallas_seqs=(64,),
        pallas_heads=(16,),
        pallas_n=2,
        caps={"contract": 240, "throughput": 240, "pallas": 240},
        min_start={"contract": 1, "throughput": 1, "pallas": 1, "llama3.2-1b": 1, "small": 1},
    ),
}


# --- shared ----------------------------------------------------------------------------------------------


def gpu_implementations() -> list[str]:
    """The available attention implementations but the reference and the NPU's."""
    avail = jaxckpt.attention.available_implementations()
    return [n for n in avail if n != "reference" and not n.startswith("npu")]


def model_config(mode: dict, model: str) -> nn.TransformerConfig:
    overrides, _, _ = mode["models"][model]
    cfg = nn.TransformerConfig.preset(model, **overrides)
    return cfg.replace(dtype="bfloat16", param_dtype="bfloat16")


def device_limit() -> int:
    stats = jax.devices()[0].memory_stats() or {}
    return int(stats.get("bytes_limit") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2)


def memory_stats() -> dict | None:
    stats = jax.devices()[0].memory_stats()
    keys = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")
    return None if not stats else {k: int(stats[k]) for k in keys if k in stats}


def error_text(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"[:600]


# --- part 1: the attention contract in bf16 -----------------------------------------------------------


def contract_cases(mode: dict) -> list:
    from attention_cases import FEATURES, Case

    gqa = dict(mode["contract"], dtype="bfloat16", block=None)
    mha = dict(gqa, k=gqa["n"])
    named = [("mha", mha, ()), ("gqa", gqa, ())] + [(f, gqa, (f,)) for f in FEATURES]
    return [
        (name, Case(**shape, features=f, variant=2 * i, seed=600 + i))
        for i, (name, shape, f) in enumerate(named)
    ]


def _unsupported(impl: str, inp) -> str | None:
    from attention_cases import features_of

    used, implementation = features_of(inp), jaxckpt.attention.implementations()[impl]
    if used - implementation.supports:
        return f"does not support {sorted(used - implementation.supports)}"
    if "dropout" in used and not implementation.shares_dropout_mask:
        return "draws its own dropout mask"
    return None


def _compare(case, inp, got, want) -> tuple[list[str], dict]:
    from attention_cases import seen_rows
    from tolerances import assert_close

    pairs = [("out", got.out, want.out, "fwd"), ("lse", got.lse, want.lse, "fwd")]
    pairs += [(n, got.grads[n], g, "grad") for n, g in want.grads.items()]
    failures, max_err = [], {}
    for name, a, e, kind in pairs:
        a32, e32 = np.asarray(a, np.float32), np.asarray(e, np.float32)
        finite = np.isfinite(a32) & np.isfinite(e32)
        max_err[name] = float(np.abs(np.where(finite, a32 - e32, 0)).max(initial=0))
        try:
            assert_close(a, e, case.dtype, kind, name)
        except AssertionError as err:
            failures.append(str(err)[:400])
    if got.out.dtype != np.dtype(case.dtype) or got.lse.dtype != np.float32:
        failures.append(f"dtypes out={got.out.dtype} lse={got.lse.dtype}")
    empty = ~seen_rows(inp)
    if np.any(got.out[empty]) or np.any(got.grads["dq"][empty]) or not np.all(got.lse[empty] == -np.inf):
        failures.append("a row that sees no key must give out = 0, dq = 0, lse = -inf")
    return failures, max_err


def _contract_item(impl: str, case, inp, want, deadline: float) -> dict:
    from attention_cases import evaluate

    reason = _unsupported(impl, inp) or ("part deadline" if time.time() > deadline else None)
    if reason:
        return {"status": "skipped", "reason": reason}
    start = time.perf_counter()
    try:
        got = evaluate(jaxckpt.flash_attention, inp, implementation=impl, block_sizes=case.block_sizes)
    except Exception as err:
        return {"status": "error", "reason": error_text(err)}
    failures, max_err = _compare(case, inp, got, want)
    status = "fail" if failures else "pass"
    return {
        "status": status,
        "failures": failures,
        "max_abs_err": max_err,
        "seconds": time.perf_counter() - start,
    }


def part_contract(mode: dict, args, emit) -> None:
    from attention_cases import build, evaluate

    jax.config.update("jax_numpy_rank_promotion", "raise")
    impls = gpu_implementations()
    for name, case in contract_cases(mode):
        rows = [{"case": name, "id": case.id, "implementation": impl} for impl in impls]
        if time.time() > args.deadline:
            for row in rows:
                emit({**row, "status": "skipped", "reason": "part deadline"})
            continue
        inp = build(case)
        try:
            with jax.default_matmul_precision("highest"):  # no TF32 in the ground truth
                want = evaluate(jaxckpt.attention_reference, inp)
        except Exception as err:
            for row in rows:
                emit({**row, "status": "error", "reason": "reference: " + error_text(err)})
            continue
        for row in rows:
            others = mode["contract_others"]
            if others is not None and row["implementation"] != "blockwise" and name not in others:
                emit({**row, "status": "skipped", "reason": "smoke: only blockwise runs every case"})
                continue
            emit(row | _contract_item(row["implementation"], case, inp, want, args.deadline))


# --- part 2: attention fwd+bwd TFLOP/s ----------------------------------------------------------------


def fwd_bwd_flops(b: int, n: int, t: int, h: int, causal: bool = True) -> float:
    return 3.5 * 4 * b * n * t * t * h / (2 if causal else 1)


def _throughput_one(impl, args4, flops, limit, reps, deadline) -> dict:
    def loss(q, k, v, w):
        out = jaxckpt.flash_attention(q, k, v, is_causal=True, implementation=impl)
        return jnp.sum((out * w).astype(jnp.float32))

    start = time.perf_counter()
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(*args4).compile()
    ma = compiled.memory_analysis()
    need = ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
    row = {"compile_s": time.perf_counter() - start, "temp_bytes": int(ma.temp_size_in_bytes)}
    if need > 0.85 * limit:
        return {**row, "status": "skipped", "reason": f"needs {need / 2**30:.1f} GiB of {limit / 2**30:.1f}"}
    times = run_times(compiled, args4, reps, deadline)
    seconds = statistics.median(times)
    tflops = flops / seconds / 1e12
    return {
        **row,
        "status": "ok",
        "times_s": times,
        "median_s": seconds,
        "tflops": tflops,
        "fraction_of_peak": tflops / PEAK_TFLOPS,
    }


def part_throughput(mode: dict, args, emit) -> None:
    n, h = mode["heads"]
    limit, impls = device_limit(), gpu_implementations()
    for t in mode["seqs"]:
        b = max(1, mode["tokens"] // t)
        keys = jax.random.split(jax.random.key(t), 4)
        args4 = [jax.random.normal(key, (b, t, n, h), jnp.bfloat16) for key in keys]
        flops = fwd_bwd_flops(b, n, t, h)
        for impl in impls:
            row = {"implementation": impl, "B": b, "T": t, "N": n, "H": h, "causal": True, "flops": flops}
            if time.time() > args.deadline:
                emit({**row, "status": "skipped", "reason": "part deadline"})
                continue
            try:
                emit({**row, **_throughput_one(impl, args4, flops, limit, mode["reps"], args.deadline)})
            except Exception as err:
                emit({**row, "status": "error", "reason": error_text(err)})
        del args4


# --- part 3: the real train step, one configuration per process ----------------------------------------


def _train(mode: dict, cfg, remat: str, batch: int, seq: int, row: dict) -> None:
    """Fills ``row`` as it goes, so that a failure (out of memory) keeps what came before it."""
    from flax import nnx

    from jaxckpt.train import Trainer, memory_report

    start = time.perf_counter()
    trainer = Trainer(nn.Transformer(cfg, rngs=nnx.Rngs(0)), remat=remat)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, batch, seq + 1))
    tokens = jax.block_until_ready(jnp.asarray(tokens, jnp.int32))
    row["init_s"] = time.perf_counter() - start
    start = time.perf_counter()
    compiled = trainer.compile(tokens.shape)
    row["compile_s"] = time.perf_counter() - start
    row["xla_on_device"] = memory_report(compiled, device_stats=False).to_dict()
    row["stats_before_step"] = memory_stats()
    losses, times = row.setdefault("losses", []), row.setdefault("step_s", [])
    for i in range(mode["steps"] + 2):  # two untimed warm-up steps (the first grows the allocator's pool)
        tick = time.perf_counter()
        losses.append(float(jax.block_until_ready(trainer.step(tokens))))
        if i >= 2:
            times.append(time.perf_counter() - tick)
    row["median_step_s"] = statistics.median(times)
    row["tokens_per_s"] = batch * seq / row["median_step_s"]
    row["loss_finite"] = bool(np.isfinite(losses).all())


def part_one_step(mode: dict, args, emit) -> None:
    """One train configuration in this fresh process: its peak is this process's peak."""
    _, batch, seq = mode["models"][args.model]
    cfg = model_config(mode, args.model)
    row = {"model": args.model, "remat": args.remat, "batch": batch, "seq": seq}
    row["attention"] = "auto"  # the model is built without attention=
    try:
        _train(mode, cfg, args.remat, batch, seq, row)
    except Exception as err:
        row["error"] = error_text(err)
    row["stats_after"] = stats = memory_stats()
    row["measured_peak"] = stats and stats.get("peak_bytes_in_use")
    before = (row.get("stats_before_step") or {}).get("peak_bytes_in_use")
    row["peak_from_step"] = None if before is None or not stats else stats["peak_bytes_in_use"] > before
    emit(row)


def part_predict(mode: dict, args, emit) -> None:
    """On the CPU: ``plan.predict`` of every train configuration, then the deviceless measure."""
    kw = {"target": TARGET} if "target" in inspect.signature(plan.predict).parameters else {}
    items = [(m, r) for m, remats in mode["remats"].items() for r in remats]
    workloads = {}
    for model, remat in items:
        _, batch, seq = mode["models"][model]
        workloads[model, remat] = plan.Workload(model_config(mode, model), batch=batch, seq=seq)
        row = {"model": model, "remat": remat, "predict_kwargs": kw}
        try:
            emit({**row, "predict": plan.predict(workloads[model, remat], remat, **kw).to_dict()})
        except Exception as err:
            emit({**row, "predict_error": error_text(err)})
    reason = plan.gpu_aot_unavailable()
    for model, remat in items:
        row = {"model": model, "remat": remat}
        if remat not in mode["deviceless"]:
            continue
        if reason or time.time() > args.deadline:
            emit({**row, "deviceless_skipped": reason or "deadline"})
            continue
        start = time.perf_counter()
        try:
            report = plan.measure(workloads[model, remat], remat, target=TARGET)
            emit({**row, "deviceless": report.to_dict(), "deviceless_s": time.perf_counter() - start})
        except Exception as err:
            emit({**row, "deviceless_error": error_text(err)})


PARTS = {
    "contract": part_contract,
    "throughput": part_throughput,
    "pallas": lambda mode, args, emit: part_pallas(mode, args, emit, peak_tflops=PEAK_TFLOPS),
    "one-step": part_one_step,
    "predict": part_predict,
}


def run_child(args) -> int:
    """One part: waits for its deadline on stdin (the orchestrator's ``go``: the GPU is free), runs."""
    if args.part == "serve":
        return serve_smoke_jobs()
    line = sys.stdin.readline()
    if not line.strip():
        return 1  # the orchestrator skipped this job
    args.deadline = float(line)
    _run_part(args)
    return 0


def _run_part(args) -> None:
    """Runs ``args.part``, its items appended to ``args.jsonl`` as they finish."""
    jax.config.update("jax_enable_compilation_cache", False)
    with open(args.jsonl, "a") as f:

        def emit(row: dict) -> None:
            f.write(json.dumps(row, default=str) + "\n")
            f.flush()

        PARTS[args.part](MODES["smoke" if args.smoke else "full"], args, emit)


def serve_smoke_jobs() -> int:
    """``--smoke``'s one child for every GPU job (``SmokeJobs``): a line ``DEADLINE<TAB>ARGV``
    (JSON) on stdin per job, run here in turn; its exit status goes to ``<jsonl>.done``."""
    for line in sys.stdin:
        deadline, argv = line.split("\t", 1)
        job = _parse(json.loads(argv))
        job.deadline, rc = float(deadline), 0
        try:
            _run_part(job)
        except Exception:  # the job's failure, as a child's exit status and log
            traceback.print_exc()
            rc = 1
        sys.stdout.flush()
        done = Path(f"{job.jsonl}.done")
        done.with_suffix(".tmp").write_text(str(rc))
        done.with_suffix(".tmp").replace(done)  # whole: the orchestrator reads it once it exists
    return 0


# --- the orchestrator -----------------------------------------------------------------------------------


class Jobs:
    """Runs the children one at a time; each is started while the one before it runs and waits on
    stdin for its deadline (``go``), so only one ever uses the GPU."""

    def __init__(self, tmp: Path, smoke: bool, deadline: float, autotune: Path | None):
        self.tmp, self.smoke, self.deadline, self.autotune = tmp, smoke, deadline, autotune
        self.live: dict[str, tuple[subprocess.Popen, object]] = {}

    def spawn(self, name: str, argv: list[str], env: dict | None = None) -> None:
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            *argv,
            "--jsonl",
            str(self.tmp / f"{name}.jsonl"),
        ]
        cmd += ["--smoke"] * self.smoke
        env = {**os.environ, **(env or {})}
        if self.smoke and "xla_backend_optimization_level" not in env.get("XLA_FLAGS", ""):
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
        if self.autotune and argv[1] == "one-step":
            dump = f"--xla_gpu_dump_autotune_results_to={self.autotune / name}.txt"
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {dump}".strip()
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 - closed in _end
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.live[name] = (proc, log)

    def _end(self, name: str, timeout: float) -> "int | str":
        proc, log = self.live.pop(name)
        try:
            rc = proc.wait(timeout=max(timeout, 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = "killed at its deadline"
        log.close()
        return rc

    def go(self, name: str, part_deadline: float) -> None:
        proc = self.live[name][0]
        proc.stdin.write(f"{part_deadline}\n".encode())
        proc.stdin.close()

    def finish(self, name: str, timeout: float, started: float) -> dict:
        exited = self.live[name][0].poll() is not None  # then its end is when it last wrote
        rc = self._end(name, timeout)
        jsonl = self.tmp / f"{name}.jsonl"
        rows = [json.loads(line) for line in jsonl.read_text().splitlines()] if jsonl.exists() else []
        end = jsonl.stat().st_mtime if exited and jsonl.exists() else time.time()
        job = {"name": name, "rc": rc, "seconds": round(end - started, 2), "rows": rows}
        if rc != 0:
            log = (self.tmp / f"{name}.log").read_text(errors="replace").splitlines()
            kept = [line for line in log if not line.startswith(("I0000", "W0000", "WARNING: All log"))]
            job["log_tail"] = "\n".join(kept)[-3000:]
        return job

    def skip(self, name: str, reason: str) -> dict:
        if name in self.live:
            self.live[name][0].kill()
            self._end(name, 10)
        return {"name": name, "rc": "skipped", "reason": reason, "rows": []}

    def kill_all(self) -> None:
        for name in list(self.live):
            self.skip(name, "interrupted")


class SmokeJobs(Jobs):
    """``--smoke``: the same jobs, but one child (``--part serve``) runs every GPU job in turn, and
    the predictor its own beside it, as in the full run. A fresh process per job is what the GPU
    needs (each configuration's allocator peak; see the docstring); the CPU has no allocator
    statistics, and the smoke proves the parts and the orchestration, not the peaks: two
    children's imports and backends instead of seven."""

    SERVER = "gpu-jobs"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.argv: dict[str, list[str]] = {}

    def spawn(self, name: str, argv: list[str], env: dict | None = None) -> None:
        if argv[1] == "predict":
            return super().spawn(name, argv, env)
        self._server()
        self.argv[name] = [*argv, "--jsonl", str(self.tmp / f"{name}.jsonl"), "--smoke"]

    def _server(self) -> subprocess.Popen:
        """The child that runs the GPU jobs (a fresh one after one died or overran)."""
        if self.SERVER not in self.live:
            super().spawn(self.SERVER, ["--part", "serve"])
        return self.live[self.SERVER][0]

    def go(self, name: str, part_deadline: float) -> None:
        if name not in self.argv:
            return super().go(name, part_deadline)
        server = self._server()
        server.stdin.write(f"{part_deadline}\t{json.dumps(self.argv[name])}\n".encode())
        server.stdin.flush()

    def finish(self, name: str, timeout: float, started: float) -> dict:
        if name not in self.argv:
            return super().finish(name, timeout, started)
        self.argv.pop(name)
        done, end = self.tmp / f"{name}.jsonl.done", time.time() + max(timeout, 0.1)
        server = self.live[self.SERVER][0]
        while not done.exists() and server.poll() is None and time.time() < end:
            time.sleep(0.05)
        if done.exists():
            rc: int | str = int(done.read_text())
        else:  # the child died or overran: the next job gets a fresh one
            rc = server.poll() if server.poll() is not None else "killed at its deadline"
            self.skip(self.SERVER, "ended")
        jsonl = self.tmp / f"{name}.jsonl"
        rows = [json.loads(line) for line in jsonl.read_text().splitlines()] if jsonl.exists() else []
        seconds = (done.stat().st_mtime if done.exists() else time.time()) - started
        job = {"name": name, "rc": rc, "seconds": round(seconds, 2), "rows": rows}
        if rc != 0:
            job["log_tail"] = (self.tmp / f"{self.SERVER}.log").read_text(errors="replace")[-3000:]
        return job

    def skip(self, name: str, reason: str) -> dict:
        self.argv.pop(name, None)
        return super().skip(name, reason)

    def kill_all(self) -> None:
        if self.SERVER in self.live:  # its jobs are done: it ends at the end of its stdin
            proc, log = self.live.pop(self.SERVER)
            proc.stdin.close()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
        super().kill_all()


def gpu_jobs(mode: dict) -> list[dict]:
    """The GPU jobs in the order they run: name, argv, cap (None: until the deadline), min start."""
    jobs = [
        dict(name=p, argv=["--part", p], cap=mode["caps"][p], min_start=mode["min_start"][p])
        for p in ("contract", "throughput", "pallas")
    ]
    for model in mode["models"]:
        for remat in mode["remats"][model]:
            argv = ["--part", "one-step", "--model", model, "--remat", remat]
            jobs.append(
                dict(
                    name=f"train-{model}-{remat}",
                    argv=argv,
                    cap=None,
                    min_start=mode["min_start"][model],
                    model=model,
                    remat=remat,
                )
            )
    return jobs


def run_all(mode: dict, jobs: Jobs, on_job) -> tuple[list[dict], dict]:
    """Runs the predictor (CPU) beside every GPU job; returns the GPU jobs' and the predictor's results.

    A job starts only if the time left covers its estimate: its ``min_start``, or for a train job
    the wall time of the last one of the same model, whichever is larger."""
    jobs.spawn("predict", ["--part", "predict"], env={"JAX_PLATFORMS": "cpu"})
    jobs.go("predict", jobs.deadline)
    todo, done, estimate = gpu_jobs(mode), [], {}
    jobs.spawn(todo[0]["name"], todo[0]["argv"])
    for i, job in enumerate(todo):
        left = jobs.deadline - time.time()
        needs = max(job["min_start"], estimate.get(job.get("model"), 0))
        if left >= needs:
            part_deadline = time.time() + min(job["cap"] or left, left)
            jobs.go(job["name"], part_deadline)
            started = time.time()
        else:
            result = jobs.skip(
                job["name"], f"skipped: {left:.0f} s of the budget left, it needs ~{needs:.0f} s"
            )
        if i + 1 < len(todo):
            jobs.spawn(todo[i + 1]["name"], todo[i + 1]["argv"])
        if left >= needs:
            # A part stops starting items at its deadline, but one may be in flight.
            grace = 15 if job["cap"] else 0
            result = jobs.finish(
                job["name"], min(part_deadline + grace, jobs.deadline) - time.time(), started
            )
            if "model" in job and result["rc"] == 0:
                estimate[job["model"]] = result["seconds"]
        done.append(result | {k: job[k] for k in ("model", "remat") if k in job})
        on_job(done)
    return done, jobs.finish("predict", jobs.deadline - time.time(), T0)


# --- results ------------------------------------------------------------------------------------------------


def _ratio(a, b):
    return None if a is None or not b else a / b


def _train_rows(done: list[dict], predicted: list[dict]) -> list[dict]:
    """One row per train job: its measured figures, the predictions for it, and their ratios."""
    pred = {}
    for r in predicted:
        pred.setdefault((r["model"], r["remat"]), {}).update(
            {k: v for k, v in r.items() if k not in ("model", "remat")}
        )
    rows = []
    for job in done:
        if "model" not in job:
            continue
        model, remat = job["model"], job["remat"]
        step = job["rows"][0] if job["rows"] else {}
        status = ("error" if "error" in step else "ok") if step else str(job.get("reason") or job["rc"])
        row = {"model": model, "remat": remat, "status": status, "reason": step.get("error")}
        row |= step | pred.get((model, remat), {})
        measured = step.get("measured_peak")
        dl = (row.get("deviceless") or {}).get("peak")
        row["ratios"] = {
            "deviceless_over_measured": _ratio(dl, measured),
            "predict_over_measured": _ratio((row.get("predict") or {}).get("total"), measured),
            "xla_on_device_over_measured": _ratio((step.get("xla_on_device") or {}).get("peak"), measured),
            "predict_over_deviceless": _ratio((row.get("predict") or {}).get("total"), dl),
        }
        rows.append(row)
    for row in rows:
        base = next((r for r in rows if r["model"] == row["model"] and r["remat"] == "none"), {})
        row["tokens_per_s_vs_none"] = _ratio(row.get("tokens_per_s"), base.get("tokens_per_s"))
    return rows


def assemble(mode: dict, meta: dict, done: list[dict], predicted: dict | None) -> dict:
    from tolerances import tol

    by_name = {j["name"]: j for j in done}
    contract = by_name.get("contract", {}).get("rows", [])
    summary = {}
    for r in contract:
        counts = summary.setdefault(r["implementation"], {"pass": 0, "fail": 0, "error": 0, "skipped": 0})
        counts[r["status"]] += 1
    pallas = by_name.get("pallas", {}).get("rows", [])
    speed = by_name.get("throughput", {}).get("rows", [])
    for r in speed:
        ref = next((s for s in speed if s["T"] == r["T"] and s["implementation"] == "blockwise"), {})
        r["tflops_vs_blockwise"] = _ratio(r.get("tflops"), ref.get("tflops"))
    bf16 = {kind: tol(jnp.bfloat16, kind) for kind in ("fwd", "grad")}
    jobs = [{k: v for k, v in j.items() if k != "rows"} for j in [*done, *([predicted] if predicted else [])]]
    return {
        "meta": {**meta, "wall_s": round(time.time() - T0, 1)},
        "contract": {"dtype": "bfloat16", "tolerances": bf16, "summary": summary, "cases": contract},
        "throughput": {"flops": FLOPS, "peak_tflops": PEAK_TFLOPS, "rows": speed},
        "pallas": {
            "flops": FLOPS,
            "peak_tflops": PEAK_TFLOPS,
            "rows": pallas,
            "summary": pallas_summary(pallas),
        },
        "train": {
            "target": TARGET,
            "models": {m: {"overrides": o, "batch": b, "seq": t} for m, (o, b, t) in mode["models"].items()},
            "remats": mode["remats"],
            "rows": _train_rows(done, (predicted or {}).get("rows", [])),
        },
        "jobs": jobs,
    }


def _fmt(x, fmt: str = ".2f") -> str:
    if x is None:
        return "-"
    return plan.format_bytes(x) if fmt == "bytes" else format(x, fmt)


def _table(title: str, cols: tuple[str, ...], rows: list[list[str]]) -> Table:
    table = Table(title=title)
    for col in cols:
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(*row)
    return table


def _note(r: dict) -> str:
    return "" if r["status"] in ("ok", "pass") else f"{r['status']}: {r.get('reason') or ''}"[:70]


def _speed_row(r: dict) -> list[str]:
    ms = r.get("median_s") and 1e3 * r["median_s"]
    cells = [(ms, ".1f"), (r.get("tflops"), ".1f"), (r.get("fraction_of_peak"), ".1%")]
    cells += [(r.get("tflops_vs_blockwise"), ".2f"), (r.get("compile_s"), ".1f")]
    return [r["implementation"], str(r["B"]), str(r["T"]), *(_fmt(x, f) for x, f in cells), _note(r)]


def _pallas_row(r: dict) -> list[str]:
    fwd, both = r.get("fwd") or {}, r.get("fwd+bwd") or {}
    cells = [_fmt(fwd.get("tflops"), ".1f"), _fmt(fwd.get("fraction_of_peak"), ".1%")]
    return [
        r["implementation"],
        str(r["H"]),
        str(r["T"]),
        str(r["causal"]),
        *cells,
        _fmt(both.get("tflops"), ".1f"),
        _note(r),
    ]


def _train_row(r: dict) -> list[str]:
    peaks = [r.get("measured_peak"), (r.get("xla_on_device") or {}).get("peak")]
    peaks += [(r.get("deviceless") or {}).get("peak"), (r.get("predict") or {}).get("total")]
    ratios = [r["ratios"]["deviceless_over_measured"], r["ratios"]["predict_over_measured"]]
    speed = [_fmt(r.get("tokens_per_s"), ",.0f"), _fmt(r.get("tokens_per_s_vs_none"))]
    return [r["model"], r["remat"], *(_fmt(x, "bytes") for x in peaks), *map(_fmt, ratios), *speed, _note(r)]


def tables(result: dict) -> list[Table]:
    """The three parts as tables: contract (case x implementation), throughput, train."""
    impls = list(result["contract"]["summary"])
    cells = {(r["case"], r["implementation"]): r["status"] for r in result["contract"]["cases"]}
    marks = {"pass": "pass", "fail": "FAIL", "error": "ERROR", "skipped": "skip", None: "-"}
    cases = dict.fromkeys(r["case"] for r in result["contract"]["cases"])
    contract = [[c, *(marks[cells.get((c, i))] for i in impls)] for c in cases]
    speed_cols = ("impl", "B", "T", "ms", "TFLOP/s", "of peak", "vs blockwise", "compile s", "note")
    train_cols = ("model", "remat", "measured", "xla here", "deviceless", "predict", "dl/meas", "pred/meas")
    pallas_cols = ("impl", "H", "T", "causal", "fwd TFLOP/s", "fwd of peak", "fwd+bwd TFLOP/s", "note")
    return [
        _table("attention contract, bf16 vs attention_reference (fp32 math)", ("case", *impls), contract),
        _table(
            "Pallas kernel vs cuDNN and jax.experimental.pallas.ops.gpu.attention, bf16",
            pallas_cols,
            [_pallas_row(r) for r in result["pallas"]["rows"]],
        ),
        _table(
            f"attention fwd+bwd, causal, bf16 ({FLOPS}; peak {PEAK_TFLOPS:.0f} TFLOP/s)",
            speed_cols,
            [_speed_row(r) for r in result["throughput"]["rows"]],
        ),
        _table(
            f"train step, bf16, AdamW: peak measured, XLA on the device, deviceless {TARGET}, predict",
            (*train_cols, "tokens/s", "vs none", "note"),
            [_train_row(r) for r in result["train"]["rows"]],
        ),
    ]


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes on the CPU: proves the script end to end"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_check.json"))
    parser.add_argument("--budget-s", type=float, default=450.0, help="global deadline, seconds from start")
    parser.add_argument("--dump-autotune", type=Path, help="write each train step's autotune results here")
    parser.add_argument("--part", choices=[*sorted(PARTS), "serve"], help=argparse.SUPPRESS)  # a child
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--remat", help=argparse.SUPPRESS)
    parser.add_argument("--jsonl", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    if args.part:
        return run_child(args)
    if args.smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"  # before any backend starts; the children inherit it
        jax.config.update("jax_platforms", "cpu")
    else:
        plan.quiet_plugins_without_devices()
    backend = jax.default_backend()
    if backend != "gpu" and not args.smoke:
        print(
            f"gpu_check.py needs a GPU backend: JAX's backend here is {backend!r}. It is meant to run once "
            "on an H200 with a CUDA build of JAX; pass --smoke for the tiny CPU dry run of every part.",
            file=sys.stderr,
        )
        return 2
    mode = MODES["smoke" if args.smoke else "full"]
    meta = {
        "smoke": args.smoke,
        "backend": backend,
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "jaxckpt": jaxckpt.__version__,
        "budget_s": args.budget_s,
        "implementations": gpu_implementations(),
        "compile_cache": "off",
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "memory": "peak_bytes_in_use of a fresh process per train configuration (see the docstring)",
    }
    console = Console(width=160)
    if args.dump_autotune:
        args.dump_autotune.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        jobs = (SmokeJobs if args.smoke else Jobs)(
            Path(tmp), args.smoke, T0 + args.budget_s, args.dump_autotune and args.dump_autotune.resolve()
        )

        def on_job(done):
            console.print(f"[{time.time() - T0:6.1f} s] {done[-1]['name']}: {done[-1]['rc']}")
            write_json(args.out, assemble(mode, meta, done, None))  # partial, in case the run is cut

        try:
            done, predicted = run_all(mode, jobs, on_job)
        finally:
            jobs.kill_all()
    result = assemble(mode, meta, done, predicted)
    for table in tables(result):
        console.print(table)
    write_json(args.out, result)
    console.print(f"wrote {args.out} in {result['meta']['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
