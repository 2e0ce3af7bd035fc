"""``jaxckpt train``: trains a model on byte-level text, or on a data file with the model's tokenizer."""

import argparse
import json
import logging
import sys

from rich.console import Console

from jaxckpt import nn, plan, remat, train
from jaxckpt.attention import CONTEXT_PARALLEL_STRATEGIES, implementations
from jaxckpt.cli._common import (
    OPTIMIZER_FLAGS,
    add_compress_arguments,
    add_lora_arguments,
    add_mlp_chunk_argument,
    add_optimizer_arguments,
    optimizer_config,
)
from jaxckpt.cli._run_file import RUN_FILE_NAME, resolved_run, run_yaml, save_run_file


def add_parser(sub) -> None:
    """Registers ``train`` on the subcommand parser ``sub``."""
    p = sub.add_parser(
        "train", help="train or fine-tune a model on a data file (default: the built-in corpus, as bytes)"
    )
    p.add_argument(
        "--model",
        help=f"model preset ({', '.join(nn.PRESETS)}); default: tiny, or the --init-from model "
        "(--config names a run file)",
    )
    p.add_argument(
        "--remat",
        help=f"remat preset ({', '.join(remat.PRESETS)}), or 'auto' (needs --budget); default: full",
    )
    p.add_argument("--budget", help="device memory for --remat auto, e.g. 30GiB, 32GB or bytes")
    add_compress_arguments(p)
    p.add_argument(
        "--attention", help=f"attention implementation ({', '.join(implementations())}); default: auto"
    )
    p.add_argument("--layers", type=int, help="override the preset's number of layers")
    p.add_argument("--dtype", choices=nn.DTYPES, help="compute dtype; default: the config's")
    p.add_argument(
        "--param-dtype",
        choices=nn.DTYPES,
        help="parameter storage dtype; default: the config's (with --lora: bfloat16 for the frozen base)",
    )
    add_lora_arguments(p, training=True)
    add_mlp_chunk_argument(p)
    p.add_argument("--batch", type=int, default=8, help="sequences per micro-batch")
    p.add_argument("--micro-batches", type=int, default=1, help="micro-batches accumulated per step")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=100, help="total steps (a resumed run continues up to it)")
    p.add_argument("--lr", type=float, default=train.OptimizerConfig.learning_rate, help="peak learning rate")
    add_optimizer_arguments(p)
    p.set_defaults(flags=OPTIMIZER_FLAGS)
    add_data_arguments(p)
    p.add_argument("--eval-data", help="held-out data (a file as --data) for the eval loss and perplexity")
    p.add_argument(
        "--eval-split", type=float, help="or hold out this fraction of --data's records (0 < F < 1)"
    )
    p.add_argument("--eval-every", type=int, help="evaluate every N steps (and after the last)")
    p.add_argument("--seed", type=int, default=0, help="init and data-order seed")
    p.add_argument("--checkpoint-dir", help="save checkpoints here")
    p.add_argument("--checkpoint-every", type=int, help="also save every N steps")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest complete checkpoint in --checkpoint-dir (none yet: start at step 0)",
    )
    p.add_argument("--force", action="store_true", help="replace existing checkpoints in --checkpoint-dir")
    p.add_argument(
        "--on-nonfinite",
        choices=train.ON_NONFINITE,
        default="stop",
        help="stop: end the run at the first non-finite loss, naming the step (exit 3; non-finite "
        "params are never checkpointed: the last checkpoint is the last good state); skip: skip each "
        "step whose loss or gradients are not finite (params and optimizer state unchanged; the select "
        "costs memory) and count it (default: stop; float16 loss-scale overflows are skipped either way)",
    )
    p.add_argument(
        "--init-from",
        help="take the model and its parameters from a jaxckpt checkpoint directory (trained, or "
        "written by 'jaxckpt convert') or a Hugging Face directory",
    )
    p.add_argument(
        "--mesh",
        help="data parallel + FSDP over all devices (of every process), e.g. data=2,fsdp=4 "
        "(parameters, gradients and optimizer state split over fsdp; the batch over both), and context "
        "parallelism with seq=N (every activation split along the sequence: fsdp=2,seq=4); "
        "default: one device, or with --num-processes P > 1: data=P,fsdp=<devices per process>",
    )
    p.add_argument(
        "--context-parallel",
        choices=CONTEXT_PARALLEL_STRATEGIES,
        help="with seq=N in --mesh: how the attention spans the sequence's shards: all_gather (K/V "
        "gathered, the default) or ring (K/V blocks passed around the ring)",
    )
    multi = p.add_argument_group(
        "multi-host",
        "run the same command in every process, each with its own --process-id; all three flags or none",
    )
    multi.add_argument("--coordinator", metavar="HOST:PORT", help="address of process 0 (it listens there)")
    multi.add_argument("--num-processes", type=int, metavar="P", help="how many processes take part")
    multi.add_argument("--process-id", type=int, metavar="I", help="this process's number, 0..P-1")
    multi.add_argument(
        "--heartbeat-timeout",
        type=int,
        metavar="SECONDS",
        help="a process silent this long (hung, or its host lost) is declared dead and the others "
        f"exit (default: JAX's, {train.HEARTBEAT_TIMEOUT_S}); a killed process is noticed at once",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a progress bar and summary")
    p.add_argument(
        "--verbose",
        action="store_true",
        help="print orbax's own reports of a failed checkpoint write as they come (by default they "
        f"go to {train.CHECKPOINT_LOG} in --checkpoint-dir, and one line names it)",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="a run file (.yaml, .yml, .toml or .json) whose keys are this command's flags "
        "(steps: 300, checkpoint_dir: out); the flags typed here override it",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help=f"print the resolved run as YAML (a run file for --config) and exit; a run with "
        f"--checkpoint-dir saves it there as {RUN_FILE_NAME}",
    )
    p.set_defaults(run=run, run_parser=p)


def run(args: argparse.Namespace) -> int:
    """Builds the config, trains, and prints the result (process 0 only, when there are several)."""
    resolved = resolved_run(args.run_parser, args)
    if args.print_config:
        print(run_yaml(resolved), end="")
        return 0
    _initialize_distributed(args)  # before anything touches JAX devices
    if args.verbose:
        logging.getLogger(train.VERBOSE_LOGGER).setLevel(logging.DEBUG)
    given = (("n_layers", args.layers), ("dtype", args.dtype), ("param_dtype", args.param_dtype))
    overrides = {k: v for k, v in given if v is not None} | _lora_overrides(args)
    if args.init_from is not None and args.model is None:
        config = train.source_config(args.init_from, name="init_from").replace(**overrides)
    else:
        config = nn.TransformerConfig.preset(args.model or "tiny", **overrides)
    run_config = train_run(args)
    config = run_config.model_config(config)  # --mlp-chunk
    # remat="auto": the planner picks the spec first (train never plans), for this run
    run_config, memory_plan = plan.resolve_auto(config, run_config)
    result = train.train(config, run_config, plan=memory_plan)
    if not train.is_primary():
        return 0
    if args.checkpoint_dir is not None:
        save_run_file(args.checkpoint_dir, resolved)
    for line in run_lines(result, args.resume, args.checkpoint_dir):
        print(line, file=sys.stderr)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    console = Console()
    if result.steps:
        first, last = result.steps[0], result.steps[-1]
        console.print(
            f"loss {first['loss']:.4f} (step {first['step']}) -> {last['loss']:.4f} (step {last['step']})"
        )
    for line in data_lines(result.data):
        console.print(line)
    if result.eval:
        last = result.eval[-1]
        console.print(
            f"eval loss {last['loss']:.4f}, perplexity {last['perplexity']:.2f} (step {last['step']}, "
            f"{len(result.eval)} evaluation(s))"
        )
    for line in optimizer_lines(result.to_dict()):
        console.print(line)
    m = result.memory
    if result.plan is not None:
        p = result.plan
        console.print(
            f"remat auto: {p.remat} {sorted(map(str, p.spec.save))}, measured peak "
            f"{p.measured.peak / 2**20:.1f} MiB <= budget {p.budget / 2**20:.1f} MiB, "
            f"recompute {100 * p.recompute_fraction:.1f}% of step FLOPs"
        )
    line = compressed_line(result.trainer.spec)
    if line:
        console.print(line)
    console.print(f"compiled step: temp {m.temp / 2**20:.1f} MiB, peak {m.peak / 2**20:.1f} MiB")
    return 0


def compressed_line(spec: remat.RematSpec) -> str | None:
    """Which kept activations the run stored compressed (``--compress``), or None.

    Example:
        >>> compressed_line(remat.compressed("save_attn", "int8"))
        'compressed residuals: attn_out int8, layer_input int8 (the forward pass is exact)'
        >>> compressed_line(remat.get("full")) is None
        True
    """
    if not spec.compress:
        return None
    tags = ", ".join(f"{tag} {fmt}" for tag, fmt in spec.compress.items())
    return f"compressed residuals: {tags} (the forward pass is exact)"


def train_run(args: argparse.Namespace) -> train.RunConfig:
    """The ``train.RunConfig`` that the flags describe (its checks name the fields, which
    ``jaxckpt.cli._flags`` writes as the flags)."""
    names = ("remat", "attention", "budget", "mlp_chunk", "context_parallel", "compress", "compress_tags")
    memory = {name: getattr(args, name) for name in names}
    return train.RunConfig(
        steps=args.steps,
        batch=args.batch,
        seq=args.seq,
        micro_batches=args.micro_batches,
        seed=args.seed,
        data=train.DataConfig(
            path=args.data,
            tokenizer=args.tokenizer,
            text_per_line=args.text_per_line,
            eval_path=args.eval_data,
            eval_split=args.eval_split,
            eval_every=args.eval_every,
        ),
        optimizer=optimizer_config(args),
        checkpoint=train.CheckpointConfig(
            dir=args.checkpoint_dir, every=args.checkpoint_every, resume=args.resume, force=args.force
        ),
        init_from=args.init_from,
        mesh=args.mesh,
        on_nonfinite=args.on_nonfinite,
        progress=not args.json,
        **{k: v for k, v in memory.items() if v is not None},
    )


def run_lines(result: train.TrainRun, resume: bool, checkpoint_dir) -> list[str]:
    """How the run began and ended, when not plainly: a ``--resume`` that found no
    checkpoint, and a stop signal (both on stderr, so that ``--json`` stays parseable)."""
    lines = []
    if resume and result.resumed_from is None:
        lines.append(f"jaxckpt train: no checkpoint in {checkpoint_dir!r} yet: started at step 0")
    if result.stopped is not None:
        where = " (no --checkpoint-dir: not saved)"
        if checkpoint_dir:
            where = f", checkpointed in {checkpoint_dir!r}"
        lines.append(
            f"jaxckpt train: {result.stopped['signal']} received: stopped after step "
            f"{result.stopped['step']}{where}; --resume continues from there"
        )
    return lines


def _lora_overrides(args: argparse.Namespace) -> dict:
    """The config fields of the LoRA flags: none without ``--lora``; with it, the frozen
    base is stored in bfloat16 unless ``--param-dtype`` says otherwise."""
    if args.lora is None:
        for flag, value in (("--lora-alpha", args.lora_alpha), ("--quantize-base", args.quantize_base)):
            if value is not None:
                raise ValueError(f"{flag} needs --lora R")
        return {}
    lora = nn.LoraConfig(
        rank=args.lora, alpha=args.lora_alpha, targets=args.lora_targets, dropout=args.lora_dropout
    )
    out = {"lora": lora, "quantize_base": args.quantize_base}
    if args.param_dtype is None:
        out["param_dtype"] = "bfloat16"
    return out


def optimizer_lines(result: dict) -> list[str]:
    """Where the optimizer state lived (with offload), and the loss scaling's skipped steps."""
    lines = []
    optimizer = result["optimizer"]
    if optimizer["offload"]:
        note = (
            ""
            if optimizer["offload_saves_memory"]
            else " (on CPU the same RAM as the device's: nothing saved)"
        )
        lines.append(f"optimizer state ({optimizer['name']}) offloaded to pinned_host memory{note}")
    if optimizer.get("offload_master"):
        note = "" if optimizer["offload_saves_memory"] else " (on CPU the same RAM: nothing saved)"
        lines.append(f"float32 master weights in pinned_host memory, 16-bit copies on the device{note}")
    if result["loss_scale"] is not None or result["skipped_steps"]:
        scale = "" if result["loss_scale"] is None else f", loss scale {result['loss_scale']:g}"
        lines.append(f"skipped steps (non-finite gradients): {result['skipped_steps']}{scale}")
    return lines


def add_data_arguments(p) -> None:
    """``--data``, ``--tokenizer`` and ``--text-per-line`` (train and eval read data alike)."""
    p.add_argument(
        "--data",
        help="a .txt, .jsonl, .json or .parquet file (or a directory of them); records "
        '{"text"}, {"messages"} (loss on assistant turns) or {"prompt", "completion"} '
        "(loss on the completion); default: the built-in Shakespeare corpus",
    )
    p.add_argument(
        "--tokenizer",
        help="a directory holding tokenizer.json (or the file), or 'bytes'; default: the model's own "
        "(--init-from), or bytes",
    )
    p.add_argument(
        "--text-per-line", action="store_true", help=".txt data: one document per line, not per file"
    )


def data_lines(data: dict) -> list[str]:
    """What the data was: documents split and skipped, and the packing efficiency."""
    if data.get("kind") != "packed":
        return []
    return [
        f"data: {data['documents']} documents ({data['split_documents']} longer than --seq split into "
        f"{data['split_documents'] + data['extra_pieces']} pieces, {data['skipped_short']} shorter than "
        f"2 tokens and {data['skipped_no_target']} with no target skipped), {data['tokens']} target tokens"
        + (f", epoch {data['epoch']}" if "epoch" in data else ""),
        f"packing: {100 * data['packing_efficiency']:.1f}% of slots hold tokens, against "
        f"{100 * data['padded_efficiency']:.1f}% with every document padded to --seq",
    ]


MULTI_HOST_FLAGS = (
    ("--coordinator", "coordinator"),
    ("--num-processes", "num_processes"),
    ("--process-id", "process_id"),
)


def _initialize_distributed(args: argparse.Namespace) -> None:
    """Joins a multi-process run when the multi-host flags are given (all three, or none)."""
    missing = [flag for flag, name in MULTI_HOST_FLAGS if getattr(args, name) is None]
    if len(missing) == len(MULTI_HOST_FLAGS):
        if args.heartbeat_timeout is not None:
            raise ValueError("--heartbeat-timeout needs --coordinator, --num-processes and --process-id")
        return
    if missing:
        given = [flag for flag, name in MULTI_HOST_FLAGS if getattr(args, name) is not None]
        raise ValueError(
            f"{', '.join(given)} given without {', '.join(missing)}: "
            "--coordinator, --num-processes and --process-id go together"
        )
    train.initialize(
        args.coordinator, args.num_processes, args.process_id, heartbeat_timeout=args.heartbeat_timeout
    )
