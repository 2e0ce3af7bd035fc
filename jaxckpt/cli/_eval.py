"""``jaxckpt eval MODEL_DIR --data FILE``: the mean loss and perplexity of a model on held-out data."""

import argparse
import json

from rich.console import Console

from jaxckpt import train
from jaxckpt.cli._train import add_data_arguments, data_lines


def add_parser(sub) -> None:
    """Registers ``eval`` on the subcommand parser ``sub``."""
    p = sub.add_parser("eval", help="mean loss and perplexity of a model on a data file")
    p.add_argument("model_dir", help="a Hugging Face, converted (jaxckpt convert) or trained model directory")
    add_data_arguments(p)
    p.add_argument("--batch", type=int, default=8, help="rows per batch")
    p.add_argument("--seq", type=int, default=256, help="tokens per row")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(run=run, flags={"model_dir": "MODEL_DIR", "eval_data": "--data"})


def run(args: argparse.Namespace) -> int:
    """Evaluates once and prints ``{"loss", "perplexity", "tokens", "data"}``."""
    if args.data is None:
        raise ValueError("data= is required: the held-out file to evaluate on")
    result = train.evaluate(
        args.model_dir,
        args.data,
        tokenizer=args.tokenizer,
        batch=args.batch,
        seq=args.seq,
        text_per_line=args.text_per_line,
    )
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    console = Console()
    console.print(
        f"eval loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f} "
        f"over {result['tokens']} tokens"
    )
    for line in data_lines(result["data"]):
        console.print(line)
    return 0
