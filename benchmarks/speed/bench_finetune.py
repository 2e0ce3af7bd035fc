"""Fine-tuning step: jaxckpt against transformers + torch on CPU, same ~100M model, same packed rows.

The model is SmolLM2-135M's architecture (LLaMA family: RoPE, RMSNorm, SwiGLU, GQA 9/3
heads, d_model 576, tied 49,152-entry embedding) cut to 20 layers, 99.1M parameters, fp32.
The tokenizer is a byte-level BPE trained here with ``tokenizers`` on the shipped corpus
(``jaxckpt/train/data/shakespeare.txt``) plus generated text (compounds of two corpus
words, seeded), so that the trainer reaches the full 49,152 entries; if it falls short the
vocabulary is padded with added tokens and the run says how many. The data is a jsonl of
documents of varied lengths (runs of 1..6 consecutive paragraphs of the corpus), read,
tokenized (``load_tokenizer`` + ``encode_record``) and packed (``PackedBatches``) by
``jaxckpt.data``.

Both sides train the same weights (the jaxckpt model exported with ``torch_bridge.save_hf``
and loaded by ``transformers.AutoModelForCausalLM``, SDPA attention) on the same packed rows:
jaxckpt takes the segment ids and positions; transformers takes the positions
(``position_ids``), from which it builds the same block-causal mask (its packed-sequence
detection). Loss: the weighted next-token cross-entropy, mean over the weighted targets, in
fp32. Optimizer: AdamW + global-norm clipping with the same hyper-parameters; on torch the
fused AdamW that ``transformers.Trainer`` uses by default (``adamw_torch_fused``).

Rows: jaxckpt flash attention ("blockwise") with remat ``full`` and with its fastest preset
(``--fast-remat``, default ``minimal``: the fastest of none / full / dots / save_attn /
save_qkv / minimal in a one-thread sweep at this config; they all lie within 5% of each other,
so the two jaxckpt rows can swap places between runs); transformers + torch
eager (SDPA) with and without gradient checkpointing (``activation_checkpointing_enable``,
every layer, non-reentrant). Steps are interleaved round-robin (the order rotated each
round); ratios are of medians against torch + gradient checkpointing. Threads:
``torch.set_num_threads(os.cpu_count())``, XLA:CPU's default (one per core). The "other
load" column is the share of the CPUs that other processes took during a row's steps
(``/proc/stat``): on a shared machine, torch's OpenMP threads lose far more than XLA's when
a core is taken, so only runs with ~0% there compare the frameworks fairly.

Memory: jaxckpt's is XLA's compiled temp allocation of the whole step (exact: everything
but the parameters and optimizer state, which the step donates and updates in place);
torch's is the peak of its CPU allocator's live bytes during one step above what was live
before it (``torch.profiler`` memory events: activations, gradients, temporaries), measured
on an extra, untimed step.

Targets: jaxckpt ``full`` step time <= 1.0x torch + gradient checkpointing; the data
pipeline delivers >= 10x the tokens per second that training consumes (the fastest row).

    python benchmarks/speed/bench_finetune.py             # B=4, T=256, 4 timed steps (~4 min idle)
    python benchmarks/speed/bench_finetune.py --quick     # 4 layers, B=2, T=128, 2 steps (smoke)
"""

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
from harness import REPO, write_json
from harness import table as harness_table

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import numpy as np
import tokenizers
import torch
import torch.nn.functional as F
import transformers
from flax import nnx
from rich.console import Console
from rich.table import Table
from tokenizers import decoders, models, pre_tokenizers, trainers
from torch.profiler import ProfilerActivity, profile

import torch_bridge
from jaxckpt import data, nn
from jaxckpt.train import OptimizerConfig, Trainer

PRESET, LAYERS, VOCAB = "smollm2-135m", 20, 49152
EOS = "<|endoftext|>"
CORPUS = REPO / "jaxckpt" / "train" / "data" / "shakespeare.txt"
GENERATED_WORDS = 200_000  # compounds of two corpus words: what lets BPE reach 49,152 merges
GOAL_RATIO, GOAL_ROW, BASELINE_ROW = 1.0, "jaxckpt flash + full", "torch sdpa + GC"
PIPELINE_GOAL = 10.0  # pipeline tokens/s over the fastest row's training tokens/s
LOSS_TOLERANCE = 1e-4
BUSY = 0.1  # the share of the CPUs other processes used during the timed steps that flags a busy machine
OPTIMIZER = OptimizerConfig(warmup_steps=0, clip_norm=1.0)


# ----------------------------------------------------------------------------- data


def corpus_documents(rng: np.random.Generator) -> list[str]:
    """The corpus as documents of 1..6 consecutive paragraphs (lengths from a line to pages)."""
    paragraphs = [p.strip() for p in CORPUS.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    docs, i = [], 0
    while i < len(paragraphs):
        k = int(rng.integers(1, 7))
        docs.append("\n\n".join(paragraphs[i : i + k]))
        i += k
    return docs


def generated_text(docs: list[str], rng: np.random.Generator, n_words: int) -> list[str]:
    """Lines of 12 seeded compounds of two corpus words (new words for BPE to merge)."""
    words = sorted({w.strip(".,;:!?'\"-").lower() for d in docs for w in d.split()} - {""})
    pairs = rng.integers(0, len(words), (n_words, 2))
    compounds = [words[a] + words[b] for a, b in pairs]
    return [" ".join(compounds[i : i + 12]) for i in range(0, n_words, 12)]


def build_tokenizer(directory: Path, texts: list[str], vocab_size: int) -> dict:
    """Trains a byte-level BPE of ``vocab_size`` entries (EOS included) on ``texts`` and
    writes ``tokenizer.json`` + ``tokenizer_config.json`` to ``directory``; pads with added
    tokens when the trainer stops short. Returns what was learned and padded."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    start = time.perf_counter()
    tok.train_from_iterator(texts, trainer=trainer)
    learned = tok.get_vocab_size()
    tok.add_tokens([f"<|extra_{i}|>" for i in range(vocab_size - learned)])
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"tokenizer: vocabulary {tok.get_vocab_size()} != {vocab_size}")
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"eos_token": EOS, "bos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return {
        "vocab_size": vocab_size,
        "learned": learned,
        "padded": vocab_size - learned,
        "train_s": time.perf_counter() - start,
    }


def check_tokenizer(directory: Path, docs: list[str]) -> bool:
    """Whether ``jaxckpt.data.load_tokenizer`` encodes some documents as transformers does."""
    ours = data.load_tokenizer(directory)
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    return all(ours.encode(d).tolist() == theirs(d)["input_ids"] for d in docs[:50])


def write_jsonl(path: Path, docs: list[str]) -> Path:
    """One ``{"text": ...}`` record per document."""
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return path


def packed_stream(jsonl: Path, tok_dir: Path, batch: int, seq: int) -> data.PackedBatches:
    """``jaxckpt.data``'s pipeline: jsonl -> ``encode_record`` -> shuffled packed rows."""
    tokenizer = data.load_tokenizer(tok_dir)
    return data.PackedBatches(
        jsonl, lambda record, where: data.encode_record(record, tokenizer, where=where), batch=batch, seq=seq
    )


def pipeline_rate(stream: data.PackedBatches, seconds: float) -> dict:
    """Slots per second (``B * T`` per batch, what a step consumes) that a fresh pipeline
    delivers, from opening the file, over at least ``seconds``; and the packing stats."""
    start, batches = time.perf_counter(), 0
    for _ in stream.iterate():
        batches += 1
        if time.perf_counter() - start >= seconds:
            break
    elapsed = time.perf_counter() - start
    slots = batches * stream.batch * stream.seq
    stats = stream.stats
    return {
        "batches": batches,
        "seconds": elapsed,
        "tokens_per_s": slots / elapsed,
        "packing_efficiency": stats["packing_efficiency"],
        "documents": stats["documents"],
        "split_documents": stats["split_documents"],
    }


# ----------------------------------------------------------------------------- rows


class Row:
    """One timed configuration: ``step(i)`` runs train step i on batch i and returns its loss."""

    def __init__(self, name: str, framework: str, step, memory_mib: float | None = None):
        self.name, self.framework, self._step, self.memory_mib = name, framework, step, memory_mib
        self.losses: list[float] = []
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.other_load: list[float] = []

    def run(self, i: int, timed: bool) -> None:
        """Runs step i to completion, recording its loss and (if ``timed``) its wall time,
        this process's CPU time, and the share of the machine's CPUs that other processes
        used meanwhile (``other_cpu_seconds``)."""
        start, cpu, busy = time.perf_counter(), time.process_time(), busy_cpu_seconds()
        loss = self._step(i)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        self.losses.append(loss)
        if timed:
            self.times.append(elapsed)
            self.cpu_times.append(cpu)
            other = busy_cpu_seconds() - busy - cpu
            self.other_load.append(max(0.0, other) / (elapsed * os.cpu_count()))


def busy_cpu_seconds() -> float:
    """CPU seconds every process of the machine has used since boot (``/proc/stat``; 0 elsewhere)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0.0
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def jax_row(name: str, cfg: nn.TransformerConfig, remat: str, batches: list) -> Row:
    """A jaxckpt ``Trainer`` (fresh model from ``nnx.Rngs(0)``) under remat preset ``remat``."""
    model = nn.Transformer(cfg, rngs=nnx.Rngs(0), attention="blockwise")
    trainer = Trainer(model, optimizer=OPTIMIZER, remat=remat)
    on_device = [type(b)(*map(jax.numpy.asarray, b)) for b in batches]
    temp = trainer.compile(on_device[0]).memory_analysis().temp_size_in_bytes

    def step(i: int) -> float:
        return float(jax.block_until_ready(trainer.step(on_device[i])))

    return Row(name, "jaxckpt", step, temp / 2**20)


def torch_row(name: str, hf_dir: Path, batches: list, checkpointing: bool) -> Row:
    """transformers' model (SDPA) + fused AdamW, on the packed rows via ``position_ids``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, attn_implementation="sdpa", dtype=torch.float32
    ).train()
    if checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=OPTIMIZER.learning_rate,
        betas=(OPTIMIZER.b1, OPTIMIZER.b2),
        eps=OPTIMIZER.eps,
        weight_decay=OPTIMIZER.weight_decay,
        fused=True,
    )
    fields = ("inputs", "targets", "positions")
    tensors = [{f: torch.from_numpy(getattr(b, f)[0].astype(np.int64)) for f in fields} for b in batches]
    for t, b in zip(tensors, batches, strict=True):
        t["weights"] = torch.from_numpy(b.weights[0])

    def step(i: int) -> float:
        t = tensors[i]
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=t["inputs"], position_ids=t["positions"], use_cache=False).logits.float()
        losses = F.cross_entropy(logits.flatten(0, 1), t["targets"].flatten(), reduction="none")
        loss = (losses * t["weights"].flatten()).sum() / t["weights"].sum().clamp(min=1.0)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIMIZER.clip_norm)
        opt.step()
        return loss.item()

    return Row(name, "torch", step)


def torch_peak_mib(row: Row, i: int) -> float:
    """Peak live bytes of torch's CPU allocator during step i above those live before it."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        row.run(i, timed=False)
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    return max(itertools.accumulate(n for _, n in events), default=0) / 2**20


# ----------------------------------------------------------------------------- report


def summarize(rows: list[Row], slots: int) -> list[dict]:
    """Per row: median step wall and CPU time, their ratios to the baseline's, tokens/s,
    memory, losses."""
    medians = {r.name: statistics.median(r.times) for r in rows}
    cpu = {r.name: statistics.median(r.cpu_times) for r in rows}
    base, cpu_base = medians[BASELINE_ROW], cpu[BASELINE_ROW]
    return [
        {
            "name": r.name,
            "framework": r.framework,
            "median_step_s": medians[r.name],
            "step_times_s": r.times,
            "ratio_vs_torch_gc": medians[r.name] / base,
            "median_cpu_s": cpu[r.name],
            "cpu_times_s": r.cpu_times,
            "cpu_ratio_vs_torch_gc": cpu[r.name] / cpu_base,
            "other_load": r.other_load,
            "tokens_per_s": slots / medians[r.name],
            "memory_mib": r.memory_mib,
            "losses": r.losses,
        }
        for r in rows
    ]


def _table(results: list[dict], title: str) -> Table:
    cols = (
        "step / torch+GC",
        "median s",
        "max/min",
        "other load",
        "tokens/s",
        "step memory MiB",
        "loss 1st",
        "loss last",
    )
    table = harness_table(title, "row", cols, justify="left", no_wrap=True)
    for r in results:
        times = r["step_times_s"]
        table.add_row(
            r["name"],
            f"{r['ratio_vs_torch_gc']:.3f}",
            f"{r['median_step_s']:.2f}",
            f"{max(times) / min(times):.2f}",
            f"{statistics.mean(r['other_load']):.0%}",
            f"{r['tokens_per_s']:.0f}",
            f"{r['memory_mib']:.0f}",
            f"{r['losses'][0]:.6f}",
            f"{r['losses'][-1]:.6f}",
        )
    return table


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=None, help="rows per step B (default 4; --quick 2)")
    parser.add_argument("--seq", type=int, default=None, help="slots per row T (default 256; --quick 128)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per row (default 4; --quick 2)")
    parser.add_argument("--layers", type=int, default=None, help=f"layers (default {LAYERS}; --quick 4)")
    parser.add_argument("--fast-remat", default="minimal", help="jaxckpt's fastest preset here")
    parser.add_argument("--pipeline-seconds", type=float, default=3.0, help="how long to time the pipeline")
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/bench_finetune.json"))
    args = parser.parse_args(argv)
    batch, seq = args.batch or (2 if args.quick else 4), args.seq or (128 if args.quick else 256)
    steps, layers = args.steps or (2 if args.quick else 4), args.layers or (4 if args.quick else LAYERS)
    if steps < 1:
        parser.error("--steps must be >= 1")
    torch.set_num_threads(os.cpu_count())
    console = Console(width=130)
    load_start = os.getloadavg()[0]
    rng = np.random.default_rng(0)
    work = Path(tempfile.mkdtemp(prefix="bench_finetune_"))

    docs = corpus_documents(rng)
    with console.status("training the tokenizer ..."):
        tok_info = build_tokenizer(
            work / "tokenizer", docs + generated_text(docs, rng, GENERATED_WORDS), VOCAB
        )
    tok_info["agrees_with_transformers"] = check_tokenizer(work / "tokenizer", docs)
    jsonl = write_jsonl(work / "train.jsonl", docs)
    stream = packed_stream(jsonl, work / "tokenizer", batch, seq)
    pipeline = pipeline_rate(stream, args.pipeline_seconds)
    lengths = [len(data.load_tokenizer(work / "tokenizer").encode_document(d)) for d in docs]
    console.print(
        f"tokenizer: byte-level BPE, {tok_info['learned']} entries learned + {tok_info['padded']} added "
        f"tokens = {VOCAB} (trained in {tok_info['train_s']:.1f} s; encodes as transformers: "
        f"{tok_info['agrees_with_transformers']}); jsonl: {len(docs)} documents of "
        f"{min(lengths)}..{max(lengths)} tokens (median {statistics.median(lengths):.0f})"
    )

    batches = [b for (b, _), _ in zip(stream.iterate(), range(steps + 2), strict=False)]
    cfg = nn.TransformerConfig.preset(PRESET, n_layers=layers, dtype="float32", max_len=max(seq, 1024))
    model = nn.Transformer(cfg, rngs=nnx.Rngs(0))
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    hf_dir = torch_bridge.save_hf(model, work / "hf", tokenizer_from=work / "tokenizer")
    del model

    remats = {GOAL_ROW: "full", f"jaxckpt flash + {args.fast_remat}": args.fast_remat}
    rows = []
    for name, remat in remats.items():
        with console.status(f"compiling {name} ..."):
            rows.append(jax_row(name, cfg, remat, batches))
    rows.append(torch_row(BASELINE_ROW, hf_dir, batches, checkpointing=True))
    rows.append(torch_row("torch sdpa", hf_dir, batches, checkpointing=False))

    for i in range(steps + 1):  # round 0 warms up (first run, allocator, optimizer state)
        order = rows[i % len(rows) :] + rows[: i % len(rows)]
        for row in order:
            with console.status(f"step {i}/{steps}: {row.name} ..."):
                row.run(i, timed=i > 0)
    for row in rows:
        if row.framework == "torch":
            with console.status(f"memory of {row.name} ..."):
                row.memory_mib = torch_peak_mib(row, steps + 1)
    # each row ran steps 0..steps (+1 for torch's memory step): compare the common ones
    first = [r.losses[0] for r in rows]
    spread = max(first) - min(first)
    last = [r.losses[steps] for r in rows]
    last_spread = max(last) - min(last)
    for row in rows:
        row.losses = row.losses[: steps + 1]

    slots = batch * seq
    results = summarize(rows, slots)
    title = (
        f"fine-tuning step (fwd+bwd+AdamW), {PRESET} cut to {layers} layers ({n_params / 1e6:.1f}M params, "
        f"vocab {VOCAB}), packed B={batch} T={seq} fp32, CPU x{os.cpu_count()} (torch threads "
        f"{torch.get_num_threads()}, XLA one per core); median of {steps} interleaved steps"
    )
    console.print(_table(results, title))
    console.print(
        f"first-step loss spread across rows: {spread:.2e} "
        f"({'ok' if spread <= LOSS_TOLERANCE else 'MISMATCH'}, "
        f"tolerance {LOSS_TOLERANCE:g}); at step {steps}: {last_spread:.2e}. Step memory: jaxckpt = XLA temp "
        "allocation, torch = allocator peak above the step's start (both exclude params + optimizer state)"
    )
    load_end = os.getloadavg()[0]
    other_load = statistics.mean(x for r in rows for x in r.other_load)
    busy = other_load > BUSY
    console.print(
        f"other processes used {other_load:.0%} of the {os.cpu_count()} CPUs during the timed steps "
        f"(1-min load average {load_start:.2f} at start, {load_end:.2f} at end)"
        + (
            " -- the machine was busy: torch's OpenMP threads slow down far more than XLA's when a core"
            " is taken, so the ratios favour jaxckpt; rerun on an idle machine"
            if busy
            else ""
        )
    )
    ratio = next(r["ratio_vs_torch_gc"] for r in results if r["name"] == GOAL_ROW)
    consumed = max(r["tokens_per_s"] for r in results)
    pipeline_ratio = pipeline["tokens_per_s"] / consumed
    console.print(
        f"goal: {GOAL_ROW} / {BASELINE_ROW} <= {GOAL_RATIO}: {'met' if ratio <= GOAL_RATIO else 'not met'} "
        f"(measured {ratio:.3f})\ngoal: pipeline >= {PIPELINE_GOAL:g}x the tokens/s training consumes: "
        f"{'met' if pipeline_ratio >= PIPELINE_GOAL else 'not met'} ({pipeline['tokens_per_s']:.0f} tokens/s "
        f"= {pipeline_ratio:.0f}x the fastest row's {consumed:.0f}; packing efficiency "
        f"{pipeline['packing_efficiency']:.3f})"
    )
    payload = {
        "preset": PRESET,
        "layers": layers,
        "params": n_params,
        "config": cfg.to_dict(),
        "B": batch,
        "T": seq,
        "steps": steps,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "other_load": other_load,
        "busy": busy,
        "load_average_1min": {"start": load_start, "end": load_end},
        "versions": {
            "jax": jax.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "tokenizer": tok_info,
        "documents": {
            "count": len(docs),
            "min_tokens": min(lengths),
            "median_tokens": statistics.median(lengths),
            "max_tokens": max(lengths),
        },
        "pipeline": pipeline
        | {
            "ratio_vs_training": pipeline_ratio,
            "goal": PIPELINE_GOAL,
            "met": pipeline_ratio >= PIPELINE_GOAL,
        },
        "first_step_loss_spread": spread,
        "last_step_loss_spread": last_spread,
        "goal": {
            "row": GOAL_ROW,
            "baseline": BASELINE_ROW,
            "max_ratio": GOAL_RATIO,
            "ratio": ratio,
            "met": ratio <= GOAL_RATIO,
        },
        "rows": results,
    }
    write_json(args.out, payload)
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
