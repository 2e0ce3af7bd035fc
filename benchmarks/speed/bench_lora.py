"""LoRA, QLoRA and low-memory optimizer state: compiled peak memory and step time, then the 7B plan.

Two models: the ``small`` preset (8 layers, d_model 512, fp32) and a tiny Hugging Face
LLaMA (random weights, built here with ``transformers``, saved and converted back with
``torch_bridge.load_hf``: the path a real checkpoint takes). On each, one row per way of
fine-tuning it, all with remat ``full`` and AdamW:

* ``full``: every weight trained, fp32 params and moments;
* ``bf16 moments``: the same with both AdamW moments in bfloat16;
* ``lora r=8 / 16 / 64``: adapters on q, k, v, o, the base frozen in bfloat16 (as
  ``jaxckpt train --lora``);
* ``qlora nf4 r=16``: the same base stored as NF4 codes.

Peak: XLA's compiled memory analysis of the very step that runs (``Trainer.compile``),
next to the planner's prediction (``plan.predict``). Step time: the median of the timed
steps after one warm-up, and its ratio to ``full``'s. All on XLA:CPU: a bfloat16 base is
computed in float32 there (its stacks get float32 copies, ``plan.widened_bytes``), which a
device with bfloat16 kernels does not pay.

Then the 7B table: llama2-7b at B=8, T=2048 on one 32 GB Ascend 910 (float16, its 16-bit
type), each figure XLA:CPU's compiled peak under full remat (nothing allocated), with the
command that prints it.

    python benchmarks/speed/bench_lora.py           # B=4, T=256, 3 timed steps (~4 min on 2 idle cores)
    python benchmarks/speed/bench_lora.py --quick   # B=2, T=64, 1 timed step, no 7B (smoke)
"""

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
from harness import RESULTS as RESULTS_DIR
from harness import write_json

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import jax.numpy as jnp
import numpy as np
import transformers
from flax import nnx
from rich.console import Console
from rich.table import Table

import torch_bridge
from jaxckpt import nn, plan, train

RESULTS = RESULTS_DIR / "bench_lora.json"
SEVEN_B = "jaxckpt plan --model llama2-7b --batch 8 --seq 2048 --device ascend-910"
BF16 = dict(dtype="bfloat16", param_dtype="bfloat16")
SEVEN_B_ROWS = (
    ("full AdamW, fp32 params (float16 compute)", "--remat full", {}, None),
    ("bf16 params + bf16 moments",
     "--dtype bfloat16 --param-dtype bfloat16 --moments-dtype bfloat16 --remat full", BF16, "bfloat16"),
    ("fp16 params + bf16 moments", "--param-dtype float16 --moments-dtype bfloat16 --remat full",
     dict(param_dtype="float16"), "bfloat16"),
    ("LoRA r=16 (q,k,v,o)", "--lora 16 --remat full", dict(lora=16, param_dtype="bfloat16"), None),
    ("QLoRA nf4 r=16", "--lora 16 --quantize-base nf4 --remat full",
     dict(lora=16, param_dtype="bfloat16", quantize_base="nf4"), None),
)  # fmt: skip
"""The 7B table: each row's ``jaxckpt plan`` flags (``--remat full``: that preset's compiled peak),
the config fields they give (before the 910's float16 replaces bfloat16 where ``--dtype`` is not
given) and the moments' dtype."""
SEED_CLAIMS = {
    "full AdamW, fp32 params (float16 compute)": "84 GB standard, 16.8 GB with FlashAttention + checkpoint",
    "LoRA r=16 (q,k,v,o)": "not in the seed (published Llama-2-7B LoRA: about 21 GB)",
    "QLoRA nf4 r=16": "not in the seed (published Llama-2-7B QLoRA: about 14 GB)",
}
"""The seed article's figures for llama2-7b on one Ascend 910 (B=8, T=2048), and the
published LoRA / QLoRA figures the issue quotes."""


def variants(config: nn.TransformerConfig) -> dict[str, tuple[nn.TransformerConfig, train.OptimizerConfig]]:
    """Row name -> (model config, optimizer) for ``config``."""
    adamw = train.OptimizerConfig(learning_rate=1e-4, warmup_steps=0)
    lora = lambda rank, **kw: config.replace(lora=nn.LoraConfig(rank=rank), param_dtype="bfloat16", **kw)
    return {
        "full": (config, adamw),
        "bf16 moments": (
            config,
            train.OptimizerConfig(learning_rate=1e-4, warmup_steps=0, moments_dtype="bfloat16"),
        ),
        "lora r=8": (lora(8), adamw),
        "lora r=16": (lora(16), adamw),
        "lora r=64": (lora(64), adamw),
        "qlora nf4 r=16": (lora(16, quantize_base="nf4"), adamw),
    }


def tiny_hf_model(directory: Path) -> tuple[nn.TransformerConfig, dict]:
    """A tiny random LLaMA written by transformers and converted by ``torch_bridge.load_hf``:
    its config and pure params (fp32)."""
    hf = transformers.LlamaConfig(
        vocab_size=2048,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM(hf).save_pretrained(directory)
    model = torch_bridge.load_hf(directory, dtype="fp32")
    return model.config, nnx.to_pure_dict(nnx.state(model, nnx.Param))


def run_row(config, optimizer, params, batch: int, seq: int, steps: int, seed: int) -> dict:
    """One row: the compiled step's peak and the planner's prediction, then the timed steps."""
    # a fresh copy (the trainer donates its state), stored as jaxckpt train stores it
    params = jax.tree.map(lambda a: jnp.array(a, config.storage_dtype), params)
    model = nn.from_params(nn.Transformer, config, params, seed=seed)
    trainer = train.Trainer(model, optimizer=optimizer, remat="full")
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (1, batch, seq + 1)), jnp.int32)
    report = train.memory_report(trainer.compile(tokens.shape), device_stats=False)
    workload = plan.Workload(config, batch, seq, optimizer=optimizer)
    predicted = plan.predict(workload, "full")
    jax.block_until_ready(trainer.step(tokens))  # warm-up
    times, losses = [], []
    for _ in range(steps):
        start = time.perf_counter()
        losses.append(float(jax.block_until_ready(trainer.step(tokens))))
        times.append(time.perf_counter() - start)
    return {
        "peak_bytes": report.peak,
        "argument_bytes": report.argument,
        "temp_bytes": report.temp,
        "predicted_bytes": predicted.total,
        "trainable_bytes": plan.trainable_bytes(workload),
        "step_seconds": statistics.median(times),
        "losses": losses,
    }


def bench_model(name: str, config, params, args) -> dict:
    rows = {}
    for row, (cfg, optimizer) in variants(config).items():
        rows[row] = run_row(cfg, optimizer, params, args.batch, args.seq, args.steps, args.seed)
    base = rows["full"]["step_seconds"]
    for r in rows.values():
        r["step_ratio"] = r["step_seconds"] / base
    return {"model": name, "batch": args.batch, "seq": args.seq, "rows": rows}


def seven_b_table() -> list[dict]:
    """Each row of ``SEVEN_B_ROWS`` measured as its command measures it."""
    device = plan.DEVICES["ascend-910"]
    out = []
    for label, flags, fields, moments in SEVEN_B_ROWS:
        config = nn.TransformerConfig.preset("llama2-7b", **fields)
        if "--dtype" not in flags:  # jaxckpt plan: the device's 16-bit type for bfloat16
            config = device.in_half(config)
        workload = plan.Workload(config, 8, 2048, optimizer=train.OptimizerConfig(moments_dtype=moments))
        start = time.perf_counter()
        measured = plan.measure(workload, "full")
        out.append({
            "row": label,
            "command": f"{SEVEN_B} {flags}",
            "dtype": config.dtype,
            "param_dtype": config.param_dtype,
            "measured_bytes": measured.peak,
            "predicted_bytes": plan.predict(workload, "full").total,
            "fits": measured.peak <= device.memory,
            "seed_claim": SEED_CLAIMS.get(label, ""),
            "compile_seconds": time.perf_counter() - start,
        })  # fmt: skip
    return out


def print_tables(results: dict) -> None:
    console = Console()
    for bench in results["models"]:
        t = Table(title=f"{bench['model']}: B={bench['batch']} T={bench['seq']}, remat full, AdamW (XLA:CPU)")
        for header in ("row", "trainable", "peak", "predicted", "step", "ratio"):
            t.add_column(header, justify="left" if header == "row" else "right")
        for row, r in bench["rows"].items():
            t.add_row(
                row,
                plan.format_bytes(r["trainable_bytes"]),
                plan.format_bytes(r["peak_bytes"]),
                plan.format_bytes(r["predicted_bytes"]),
                f"{r['step_seconds'] * 1e3:.0f} ms",
                f"{r['step_ratio']:.2f}x",
            )
        console.print(t)
    if results["llama2_7b"]:
        t = Table(title="llama2-7b B=8 T=2048 on one Ascend 910 (32 GB): compiled peak under full remat")
        for header in ("row", "fits", "measured", "predicted", "seed / published"):
            t.add_column(header, justify="left" if header in ("row", "seed / published") else "right")
        for r in results["llama2_7b"]:
            t.add_row(
                r["row"],
                "yes" if r["fits"] else "no",
                plan.format_bytes(r["measured_bytes"]),
                plan.format_bytes(r["predicted_bytes"]),
                r["seed_claim"],
            )
        console.print(t)
        for r in results["llama2_7b"]:
            console.print(f"  {r['command']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="B=2, T=64, 1 step, no 7B table")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    if args.quick:
        args.batch, args.seq, args.steps = 2, 64, 1
    started = time.perf_counter()
    small = nn.TransformerConfig.preset("small")
    small_params = nnx.to_pure_dict(nnx.state(nn.Transformer(small, rngs=nnx.Rngs(args.seed)), nnx.Param))
    with tempfile.TemporaryDirectory() as tmp:
        hf_config, hf_params = tiny_hf_model(Path(tmp) / "tiny-llama")
    results = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "jax": jax.__version__},
        "models": [
            bench_model("small", small, small_params, args),
            bench_model("tiny HF LLaMA (converted)", hf_config, hf_params, args),
        ],
        "llama2_7b": [] if args.quick else seven_b_table(),
    }
    results["seconds"] = time.perf_counter() - started
    print_tables(results)
    if not args.quick:
        print(f"wrote {write_json(args.out, results)}")


if __name__ == "__main__":
    main()
