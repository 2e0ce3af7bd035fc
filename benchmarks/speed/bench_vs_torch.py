"""Train step: jaxckpt (flash attention + remat) against PyTorch eager on CPU, same model.

The "small" llama-family preset (8 layers, d_model 512, 8 heads, SwiGLU, RoPE, RMSNorm,
fp32, byte vocabulary) is trained with AdamW + global-norm clipping in three jaxckpt
configurations (remat "full", "none", "save_attn") and in PyTorch eager with
``scaled_dot_product_attention(is_causal=True)``, with and without per-block
``torch.utils.checkpoint``. All rows start from the same weights (jaxckpt's initial
parameters copied into torch) and see the same tokens; the first-step losses are
printed as a sanity check. Steps are interleaved round-robin so that noise on a shared
CPU hits every row alike, and the table reports median step-time ratios against torch
eager (no checkpoint). jaxckpt memory is XLA's compiled temp size; torch's is n/a.

    python benchmarks/speed/bench_vs_torch.py            # B=4, T=1024, 3 timed steps
    python benchmarks/speed/bench_vs_torch.py --quick    # B=2, T=256 smoke run
    python benchmarks/speed/bench_vs_torch.py --batch 8 --seq 512 --steps 5 --layers 4
"""

import argparse
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness
from harness import table as harness_table
from harness import write_json

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F
from flax import nnx
from rich.console import Console
from rich.table import Table
from torch.utils.checkpoint import checkpoint

from jaxckpt import nn
from jaxckpt.train import OptimizerConfig, Trainer

PRESET = "small"
GOAL_RATIO = 0.8  # jaxckpt flash + remat "full" step time / torch eager step time
GOAL_ROW = "jaxckpt flash + full"
BASELINE_ROW = "torch eager"
JAX_REMATS = {"jaxckpt flash + full": "full", "jaxckpt flash + none": "none"}
JAX_REMATS |= {"jaxckpt flash + save_attn": "save_attn"}  # row name -> remat preset
LOSS_TOLERANCE = 1e-4
# 1-min load average per CPU that flags the machine as busy: before the run, and at its end
# (when this run's own threads count for about one per CPU)
BUSY_LOAD_START, BUSY_LOAD_END = 0.5, 1.5


# ----------------------------------------------------------------------------- torch model


class TorchRMSNorm(torch.nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * weight`` in fp32, as ``jaxckpt.nn.RMSNorm``."""

    def __init__(self, features: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(features))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalizes the last axis of ``x``."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_tables(t: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` ``[T, H]`` (rotate-half convention, as ``jaxckpt.nn.rope_tables``)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.arange(t, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates ``x [B, N, T, H]`` by the tables ``[T, H]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class TorchAttention(torch.nn.Module):
    """q/k/v projections, RoPE, causal SDPA on ``[B, N, T, H]``, output projection."""

    def __init__(self, cfg: nn.TransformerConfig):
        super().__init__()
        n, k, h, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model
        self.q_proj = torch.nn.Linear(d, n * h, bias=False)
        self.k_proj = torch.nn.Linear(d, k * h, bias=False)
        self.v_proj = torch.nn.Linear(d, k * h, bias=False)
        self.out_proj = torch.nn.Linear(n * h, d, bias=False)
        self.heads = (n, k, h)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``[B, T, D] -> [B, T, D]``."""
        b, t, _ = x.shape
        n, k, h = self.heads
        q = self.q_proj(x).view(b, t, n, h).transpose(1, 2)
        key = self.k_proj(x).view(b, t, k, h).transpose(1, 2)
        value = self.v_proj(x).view(b, t, k, h).transpose(1, 2)
        q, key = apply_rope(q, cos, sin), apply_rope(key, cos, sin)
        out = F.scaled_dot_product_attention(q, key, value, is_causal=True, enable_gqa=n != k)
        return self.out_proj(out.transpose(1, 2).reshape(b, t, n * h))


class TorchMLP(torch.nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: nn.TransformerConfig):
        super().__init__()
        self.gate = torch.nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.up = torch.nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)
        self.down = torch.nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, D] -> [B, T, D]``."""
        return self.down(F.silu(self.gate(x)) * self.up(x))


class TorchBlock(torch.nn.Module):
    """Pre-norm decoder layer: ``x + attn(norm(x))``, then ``+ mlp(norm(.))``."""

    def __init__(self, cfg: nn.TransformerConfig):
        super().__init__()
        self.attn_norm = TorchRMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = TorchAttention(cfg)
        self.mlp_norm = TorchRMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = TorchMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``[B, T, D] -> [B, T, D]``."""
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class TorchTransformer(torch.nn.Module):
    """The llama-family ``jaxckpt.nn.Transformer`` in PyTorch (untied head, no biases).

    Args:
        cfg: the jaxckpt config (llama family, RoPE, RMSNorm, SwiGLU, fp32).
        checkpoint_blocks: wrap every block in ``torch.utils.checkpoint`` (non-reentrant).
    """

    def __init__(self, cfg: nn.TransformerConfig, *, checkpoint_blocks: bool):
        super().__init__()
        self.embed = torch.nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = torch.nn.ModuleList(TorchBlock(cfg) for _ in range(cfg.n_layers))
        self.final_norm = TorchRMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = torch.nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head_dim, self.theta = cfg.head_dim, cfg.rope_theta
        self.checkpoint_blocks = checkpoint_blocks

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, V]`` for ``tokens [B, T]``."""
        cos, sin = rope_tables(tokens.shape[1], self.head_dim, self.theta)
        x = self.embed(tokens)
        for block in self.blocks:
            if self.checkpoint_blocks:
                x = checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin)
        return self.head(self.final_norm(x))


def load_jax_params(model: TorchTransformer, params: dict[tuple, np.ndarray]) -> None:
    """Copies jaxckpt parameters (flat paths -> arrays) into ``model``.

    jaxckpt kernels are ``[in, out]`` (torch weights are their transpose); the blocks'
    parameters are stacked on a leading layer axis.
    """

    def put(param: torch.nn.Parameter, value: np.ndarray) -> None:
        if tuple(param.shape) != value.shape:
            raise ValueError(f"shape mismatch: torch {tuple(param.shape)} vs jaxckpt {value.shape}")
        param.data.copy_(torch.from_numpy(np.ascontiguousarray(value)))

    linears = {
        ("attn", "q_proj"): lambda b: b.attn.q_proj,
        ("attn", "k_proj"): lambda b: b.attn.k_proj,
        ("attn", "v_proj"): lambda b: b.attn.v_proj,
        ("attn", "out_proj"): lambda b: b.attn.out_proj,
        ("mlp", "gate"): lambda b: b.mlp.gate,
        ("mlp", "up"): lambda b: b.mlp.up,
        ("mlp", "down"): lambda b: b.mlp.down,
    }
    norms = {"attn_norm": lambda b: b.attn_norm, "mlp_norm": lambda b: b.mlp_norm}
    used = set()
    with torch.no_grad():
        put(model.embed.weight, params[("embed", "embedding")])
        put(model.final_norm.weight, params[("final_norm", "scale")])
        put(model.head.weight, params[("head", "kernel")].T)
        used |= {("embed", "embedding"), ("final_norm", "scale"), ("head", "kernel")}
        for i, block in enumerate(model.blocks):
            for (group, name), get in linears.items():
                path = ("blocks", group, name, "kernel")
                put(get(block).weight, params[path][i].T)
                used.add(path)
            for name, get in norms.items():
                path = ("blocks", name, "scale")
                put(get(block).weight, params[path][i])
                used.add(path)
    if missing := set(params) - used:
        raise ValueError(f"jaxckpt parameters not copied into torch: {sorted(missing)}")


def jax_params(model: nnx.Module) -> dict[tuple, np.ndarray]:
    """The model's parameters as flat ``path -> numpy copy`` (safe from later donation)."""
    flat = nnx.state(model, nnx.Param).flat_state()
    return {tuple(map(str, path)): np.array(var[...], copy=True) for path, var in flat}


# ----------------------------------------------------------------------------- rows


class Row:
    """One timed configuration: ``step(i)`` runs train step i and returns its loss (a float).

    Attributes:
        name: the table label. framework: ``"jaxckpt"`` or ``"torch"``.
        temp_mib: XLA compiled temp memory (jaxckpt) or None.
        losses: the loss of every step run so far. times: timed step seconds.
    """

    def __init__(self, name: str, framework: str, step: Callable[[int], float]):
        self.name, self.framework, self._step = name, framework, step
        self.temp_mib: float | None = None
        self.losses: list[float] = []
        self.times: list[float] = []

    def run(self, i: int, timed: bool) -> None:
        """Runs step i (blocking until done), recording its loss and, if ``timed``, its time."""
        start = time.perf_counter()
        loss = self._step(i)
        elapsed = time.perf_counter() - start
        self.losses.append(loss)
        if timed:
            self.times.append(elapsed)


def jax_row(name: str, cfg: nn.TransformerConfig, remat: str, batches: np.ndarray) -> Row:
    """A jaxckpt Trainer (fresh model from ``nnx.Rngs(0)``) with remat preset ``remat``."""
    model = nn.Transformer(cfg, rngs=nnx.Rngs(0))
    trainer = Trainer(model, optimizer=OptimizerConfig(warmup_steps=0, clip_norm=1.0), remat=remat)
    device_batches = [jnp.asarray(b[None], jnp.int32) for b in batches]  # [1, B, T + 1]

    def step(i: int) -> float:
        return float(jax.block_until_ready(trainer.step(device_batches[i])))

    row = Row(name, "jaxckpt", step)
    temp = trainer.compile(device_batches[0].shape).memory_analysis().temp_size_in_bytes
    row.temp_mib = temp / 2**20
    return row


def torch_row(
    name: str, cfg: nn.TransformerConfig, params: dict, batches: np.ndarray, checkpoint_blocks: bool
) -> Row:
    """PyTorch eager, AdamW + clip_grad_norm_ (as optax clip_by_global_norm + adamw)."""
    model = TorchTransformer(cfg, checkpoint_blocks=checkpoint_blocks)
    load_jax_params(model, params)
    opt_cfg = OptimizerConfig(warmup_steps=0, clip_norm=1.0)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=opt_cfg.learning_rate,
        betas=(opt_cfg.b1, opt_cfg.b2),
        eps=opt_cfg.eps,
        weight_decay=opt_cfg.weight_decay,
    )
    tokens = [torch.from_numpy(b.astype(np.int64)) for b in batches]

    def step(i: int) -> float:
        optimizer.zero_grad(set_to_none=True)
        logits = model(tokens[i][:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[i][:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt_cfg.clip_norm)
        optimizer.step()
        return loss.item()

    return Row(name, "torch", step)


# ----------------------------------------------------------------------------- report


def summarize(rows: list[Row], batch: int, seq: int) -> list[dict]:
    """Per row: median step seconds, tokens/s, ratio against torch eager, memory, losses."""
    medians = {r.name: statistics.median(r.times) for r in rows}
    base = medians[BASELINE_ROW]
    return [
        {
            "name": r.name,
            "framework": r.framework,
            "median_step_s": medians[r.name],
            "step_times_s": r.times,
            "tokens_per_s": batch * seq / medians[r.name],
            "ratio_vs_torch_eager": medians[r.name] / base,
            "temp_mib": r.temp_mib,
            "losses": r.losses,
        }
        for r in rows
    ]


def _table(results: list[dict], title: str) -> Table:
    cols = ("step / torch eager", "median s", "max/min", "tokens/s", "temp MiB", "loss 1st", "loss last")
    table = harness_table(title, "row", cols, justify="left", no_wrap=True)
    for r in results:
        table.add_row(
            r["name"],
            f"{r['ratio_vs_torch_eager']:.3f}",
            f"{r['median_step_s']:.3f}",
            f"{max(r['step_times_s']) / min(r['step_times_s']):.2f}",
            f"{r['tokens_per_s']:.0f}",
            "n/a" if r["temp_mib"] is None else f"{r['temp_mib']:.1f}",
            f"{r['losses'][0]:.6f}",
            f"{r['losses'][-1]:.6f}",
        )
    return table


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=None, help="batch size B (default 4; --quick 2)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length T (default 1024; --quick 256)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per row (median reported)")
    parser.add_argument("--layers", type=int, default=None, help="override the preset's 8 layers")
    parser.add_argument("--quick", action="store_true", help="B=2, T=256 smoke run")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random byte tokens")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/vs_torch.json"))
    args = parser.parse_args(argv)
    batch = args.batch or (2 if args.quick else 4)
    seq = args.seq or (256 if args.quick else 1024)
    if args.steps < 1:
        parser.error("--steps must be >= 1")

    torch.set_num_threads(os.cpu_count())
    overrides = {"max_len": max(seq, nn.TransformerConfig.preset(PRESET).max_len)}
    if args.layers:
        overrides["n_layers"] = args.layers
    cfg = nn.TransformerConfig.preset(PRESET, **overrides)
    console = Console(width=120)

    load_start = os.getloadavg()[0]
    rng = np.random.default_rng(args.seed)
    batches = rng.integers(0, cfg.vocab_size, size=(args.steps + 1, batch, seq + 1), dtype=np.int32)
    params = jax_params(nn.Transformer(cfg, rngs=nnx.Rngs(0)))

    rows = []
    for name, remat in JAX_REMATS.items():
        with console.status(f"compiling {name} ..."):
            rows.append(jax_row(name, cfg, remat, batches))
    rows.append(torch_row(BASELINE_ROW, cfg, params, batches, checkpoint_blocks=False))
    rows.append(torch_row("torch eager + checkpoint", cfg, params, batches, checkpoint_blocks=True))

    # Step 0: warm-up / compile, untimed. Then round-robin over rows, one step each.
    for i in range(args.steps + 1):
        for row in rows:
            with console.status(f"step {i}/{args.steps}: {row.name} ..."):
                row.run(i, timed=i > 0)
        if i == 0:
            firsts = ", ".join(f"{r.name}={r.losses[0]:.6f}" for r in rows)
            console.print(f"first-step losses (same init, same tokens): {firsts}")

    first_losses = [r.losses[0] for r in rows]
    loss_spread = max(first_losses) - min(first_losses)
    loss_ok = loss_spread <= LOSS_TOLERANCE
    last_losses = [r.losses[-1] for r in rows]
    last_spread = max(last_losses) - min(last_losses)
    console.print(
        f"first-step loss spread across rows: {loss_spread:.2e} "
        f"({'ok' if loss_ok else 'MISMATCH'}, tolerance {LOSS_TOLERANCE:g}; "
        f"uniform-prediction loss ln(V) = {math.log(cfg.vocab_size):.6f}); "
        f"after {args.steps} updates: {last_spread:.2e} (same optimizer => stays small)"
    )

    results = summarize(rows, batch, seq)
    title = (
        f"train step (fwd+bwd+AdamW), preset {PRESET!r}: {cfg.n_layers} layers, d_model {cfg.d_model}, "
        f"B={batch} T={seq} fp32, CPU x{os.cpu_count()}; median of {args.steps} interleaved steps"
    )
    console.print(_table(results, title))
    load_end = os.getloadavg()[0]
    busy = load_start > BUSY_LOAD_START * os.cpu_count() or load_end > BUSY_LOAD_END * os.cpu_count()
    console.print(
        f"1-min load average: {load_start:.2f} at start, {load_end:.2f} at end, on {os.cpu_count()} CPUs"
        + (
            " -- the machine was not idle before the run (or got busier than this run's own threads);"
            " torch's OpenMP threads degrade badly when oversubscribed: check max/min before trusting ratios"
            if busy
            else ""
        )
    )
    ratio = next(r["ratio_vs_torch_eager"] for r in results if r["name"] == GOAL_ROW)
    met = ratio <= GOAL_RATIO
    console.print(
        f"goal: {GOAL_ROW} step time / {BASELINE_ROW} <= {GOAL_RATIO}: "
        f"{'met' if met else 'not met'} (measured {ratio:.3f})"
    )

    payload = {
        "preset": PRESET,
        "config": cfg.to_dict(),
        "B": batch,
        "T": seq,
        "steps": args.steps,
        "cpu_count": os.cpu_count(),
        "load_average_1min": {"start": load_start, "end": load_end, "busy": busy},
        "torch_threads": torch.get_num_threads(),
        "versions": {"jax": jax.__version__, "torch": torch.__version__, "python": platform.python_version()},
        "first_step_loss_spread": loss_spread,
        "first_step_losses_agree": loss_ok,
        "last_step_loss_spread": last_spread,
        "goal": {"row": GOAL_ROW, "max_ratio": GOAL_RATIO, "ratio": ratio, "met": met},
        "rows": results,
    }
    write_json(args.out, payload)
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
