"""``jaxckpt compare``: the seed's experiment as one table (the project's main job)."""

import argparse
import json

from rich import box
from rich.console import Console
from rich.table import Table

from jaxckpt import compare, nn
from jaxckpt.cli._common import add_compress_arguments, add_mlp_chunk_argument

DEFAULT_MODEL = "tiny"
DEFAULT_BATCH = 2
DEFAULT_SEQ = 1024
DEFAULT_STEPS = 3


def add_parser(sub) -> None:
    """Registers ``compare`` on the subcommand parser ``sub``."""
    p = sub.add_parser(
        "compare",
        help="memory, speed and gradients of standard vs flash attention under each remat preset",
        description="Trains the same model once per (attention, remat) row and prints one table: "
        "temp memory from XLA's compiled memory analysis, step time, final loss and the largest "
        "gradient difference against standard attention without remat.",
    )
    p.add_argument(
        "--model",
        "--config",
        dest="model",
        default=DEFAULT_MODEL,
        help=f"model preset ({', '.join(nn.PRESETS)}); --config is an alias",
    )
    p.add_argument("--batch", type=int, default=DEFAULT_BATCH, help="sequences per step")
    p.add_argument("--seq", type=int, default=DEFAULT_SEQ, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="timed steps per row (median)")
    p.add_argument("--layers", type=int, help="override the preset's number of layers")
    add_mlp_chunk_argument(p)
    add_compress_arguments(p, tags=False)
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Runs the comparison and prints it."""
    given = (("n_layers", args.layers), ("mlp_chunk", args.mlp_chunk))
    overrides = {name: value for name, value in given if value is not None}
    config = nn.TransformerConfig.preset(args.model, **overrides)
    result = compare.compare(
        config,
        batch=args.batch,
        seq=args.seq,
        steps=args.steps,
        progress=not args.json,
        compress=args.compress,
    )
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        console = Console()
        console.width = max(console.width, 112)  # the table is 112 columns wide; never wrap it
        console.print(table(result))
    return 0


def table(result: dict) -> Table:
    """The comparison as a rich table."""
    c = result["config"]
    title = (
        f"{c['family']} d={c['d_model']} L={c['n_layers']} N={c['n_heads']} ffn={c['ffn_dim']} "
        f"B={c['batch']} T={c['seq']} {c['dtype']} on {c['backend']}, {c['steps']} steps"
    )
    caption = "baseline (first row): reference attention, which materialises T x S, without remat"
    if any("+" in r["remat"] for r in result["rows"]):
        caption += "; <preset>+<format>: its kept activations stored compressed (--compress; exact forward)"
    t = Table(title=title, caption=caption, box=box.SIMPLE_HEAD)
    for name in (
        "attention",
        "remat",
        "temp MiB",
        "saved",
        "step s",
        "tokens/s",
        "vs base",
        "loss",
        "max |dgrad|",
    ):
        t.add_column(name, justify="left" if name in ("attention", "remat") else "right")
    for r in result["rows"]:
        t.add_row(
            r["attention"],
            r["remat"],
            f"{r['temp_bytes'] / 2**20:.1f}",
            f"{r['memory_saved']:.1%}",
            f"{r['step_seconds']:.3f}",
            f"{r['tokens_per_second']:,.0f}",
            f"{r['speed_ratio']:.2f}x",
            f"{r['loss']:.4f}",
            f"{r['max_grad_diff']:.1e}",
        )
    return t
