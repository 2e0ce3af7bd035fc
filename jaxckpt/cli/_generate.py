"""``jaxckpt generate``: continues a prompt with a model directory (Hugging Face, converted or trained)."""

import argparse
import json
import sys

from jaxckpt.generate import generate

FLAGS = {
    "max_new_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "tokenizer": "--tokenizer",
    "dtype": "--dtype",
    "model": "MODEL_DIR",
    "init_from": "MODEL_DIR",
}
"""``generate``'s argument names -> this subcommand's flags, for error messages."""


def add_parser(sub) -> None:
    """Registers ``generate`` on the subcommand parser ``sub``."""
    p = sub.add_parser("generate", help="continue a prompt with a model (greedy, or sampled)")
    p.add_argument(
        "model",
        metavar="MODEL_DIR",
        help="a Hugging Face directory, one written by 'jaxckpt convert', or a training "
        "--checkpoint-dir (its latest step)",
    )
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=32, help="at most this many new tokens (default 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy; > 0 samples")
    p.add_argument(
        "--top-k", type=int, help="sample from the K most likely tokens only (with --temperature > 0)"
    )
    p.add_argument(
        "--top-p",
        type=float,
        help="sample from the smallest set of probability >= P (with --temperature > 0)",
    )
    p.add_argument("--seed", type=int, default=0, help="the sampling seed")
    p.add_argument(
        "--chat",
        action="store_true",
        help="the prompt is a user message, rendered with the tokenizer's chat template",
    )
    p.add_argument(
        "--tokenizer",
        help="a tokenizer directory or tokenizer.json, or 'bytes'; default: MODEL_DIR's own",
    )
    p.add_argument(
        "--dtype", help="compute and parameter dtype (float32, bfloat16, float16); default: stored"
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print {prompt, completion, new_token_ids, finish_reason} as JSON",
    )
    p.set_defaults(run=run, flags=FLAGS)


def run(args: argparse.Namespace) -> int:
    """Generates and prints the completion (text: on stdout, with a summary line on stderr)."""
    result = generate(
        args.model,
        args.prompt,
        tokenizer=args.tokenizer,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        chat=args.chat,
        dtype=args.dtype,
    )
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, ensure_ascii=False))
        return 0
    print(result.completion)
    print(f"[{len(result.new_token_ids)} new tokens, finish_reason={result.finish_reason}]", file=sys.stderr)
    return 0
