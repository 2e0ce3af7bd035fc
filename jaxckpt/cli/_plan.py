"""``jaxckpt plan``: the cheapest remat spec under a memory budget, next to what every preset needs.

One row per remat preset, predicted from shapes (``plan.choice``, no compile), and
the spec ``plan.plan_memory`` chose, whose peak XLA measured: ``plan.preset_table``
computes them, this module parses the flags and formats. A GPU or TPU ``--device``
(``plan.TARGETS``) is measured by XLA:GPU or XLA:TPU for it, compiled here without one,
when the ``gpu-aot`` (``tpu-aot``) extra is installed (``plan.AUTOTUNE_CAVEAT``,
``plan.TPU_CAVEAT``); otherwise, and for every other device, by XLA:CPU
(``plan.CPU_CAVEAT``), and the table says which. The budget is
a device preset's memory or a size.

Example:
    $ jaxckpt plan --model tiny --batch 2 --seq 64 --budget 20MiB
    (a table: remat, params, grads, optimizer, activations, total, fits, recompute,
    measured; the chosen row is starred; the caption gives the budget and minimum)

    $ jaxckpt plan --model llama2-7b --batch 8 --seq 2048 --device ascend-910
    (full AdamW: every row needs over 100 GiB against 29.80 GiB: the table, then the
    smallest peak and what would fit, LoRA and QLoRA among it, on stderr, exit status 1)

    $ jaxckpt plan --model llama2-7b --batch 8 --seq 2048 --device ascend-910 --lora 16
    (the adapters alone train, the base frozen in float16, the Ascend 910's 16-bit type:
    the chosen spec fits, with XLA's measured peak; --quantize-base nf4 for QLoRA)

    $ jaxckpt plan --model llama2-7b --batch 8 --seq 2048 --device ascend-910 --devices 8
    (the same rows per device under 8-way FSDP; the chosen spec compiled over 8
    simulated CPU devices)

    $ jaxckpt plan --model llama3.1-8b --lora 16 --batch 1 --seq 8192 --device h100-80g \
        --budget 20GiB --allow-compress
    (the solver may also store kept activations in int8, on the device or offloaded, where
    that is the cheapest way to fit; the chosen line lists each compressed tag and its bytes)

    $ jaxckpt plan --model tiny --batch 2 --seq 64 --budget 20MiB --compress int8
    (every row is its preset with what it keeps stored in int8, as jaxckpt train --compress
    int8 trains it: full+int8, save_attn+int8, ...)

    $ jaxckpt plan --model tiny --batch 4 --seq 1024 --budget 110MiB --per-layer
    (the stack's layers may differ: the first k under a richer spec than the rest, where that
    fits at less recompute than one spec for all; the chosen row is named by its groups,
    e.g. 5 x save_attn + 1 x full)

    $ jaxckpt plan --model tiny --batch 2 --seq 64 --budget 20MiB --explain --plot peak.html
    (after the table, the largest contributors at the chosen spec's peak, from XLA's buffer
    assignment (plan.explain_workload), and its live-bytes timeline stacked by kind, drawn
    into peak.html; --force replaces an existing file)
"""

import argparse
import json
import sys

from rich.console import Console
from rich.measure import Measurement

from jaxckpt import nn, plan, remat
from jaxckpt.attention import CONTEXT_PARALLEL_STRATEGIES
from jaxckpt.cli._common import (
    add_compress_arguments,
    add_lora_arguments,
    add_mlp_chunk_argument,
    add_optimizer_arguments,
    compress_tags,
    optimizer_config,
)
from jaxckpt.cli._flags import FLAGS, flag_message
from jaxckpt.cli._plan_explain import explain_dict, plot_path, show_explanation
from jaxckpt.cli._plan_table import attempts_line, chosen_line, compiler_label, roofline_line, table

PARAM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"} | {d: d for d in nn.DTYPES}
"""``--param-dtype`` spelling -> ``TransformerConfig.param_dtype``."""

PLAN_FLAGS = {
    "device": "--device",
    "mesh": "jaxckpt train --mesh",
    "lora": "--lora",
    "quantize_base": "--quantize-base",
    "moments_dtype": "--moments-dtype",
    "optimizer.offload_master": "--offload-master",
    "seq_shards": "--seq-shards",
    "context_parallel": "--context-parallel",
    "allow_compress": "--allow-compress",
    "per_layer": "--per-layer",
}
"""Names whose flag is another command's here, or this command's own (``jaxckpt.cli._flags.FLAGS``
has the rest)."""


def _size(text: str) -> int:
    try:
        return plan.parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be a fraction in [0, 1), got {text!r}")
    return value


def add_parser(sub) -> None:
    """Registers ``plan`` on the subcommand parser ``sub``."""
    p = sub.add_parser(
        "plan",
        help="the cheapest remat spec that fits a memory budget, and what every preset needs",
        description="Predicts params, gradients, optimizer state and activations of a train step "
        "under every remat preset (from shapes, no compile), solves for the spec of least recompute "
        "that fits the budget and checks it against XLA's compiled memory analysis (XLA:GPU for a GPU "
        "--device with the gpu-aot extra, XLA:TPU for a tpu-* --device with the tpu-aot extra, compiled "
        "without the device; else XLA:CPU).",
    )
    p.add_argument("--model", required=True, choices=list(nn.PRESETS), help="model preset")
    # sizes and the device are checked by the library (plan.Workload, plan.device_preset), which names
    # the value and its limit, in one line (argparse would print the whole usage first)
    p.add_argument("--batch", required=True, type=int, help="sequences per micro-batch")
    p.add_argument("--seq", type=int, help="tokens per sequence (at most the model's max_len); or --max-seq")
    p.add_argument(
        "--max-seq",
        action="store_true",
        help="instead of --seq: the longest sequence that fits, searched on the analytic model (remat "
        "spec, layer inputs offloaded to host, MLP tiled) and confirmed by compiling it for --device",
    )
    p.add_argument(
        "--host-memory",
        type=_size,
        help="with --max-seq: host memory per device that offloaded activations may fill (default: no limit)",
    )
    p.add_argument(
        "--device",
        help=f"plan for this device ({', '.join(plan.DEVICES)}): its memory is the budget (unless "
        "--budget), its matmul rate prices recompute; a GPU's step is compiled by XLA:GPU for it (the "
        "gpu-aot extra), a TPU's by XLA:TPU (the tpu-aot extra)",
    )
    p.add_argument(
        "--budget",
        type=_size,
        help="bytes per device: 32GB, 30GiB, 512MiB or a number (default: --device's memory)",
    )
    p.add_argument(
        "--devices",
        type=int,
        default=1,
        help="plan per device for FSDP over this many devices (jaxckpt train --mesh fsdp=N); the batch "
        "is split over them and every candidate is compiled over N devices (a GPU --device's, a TPU "
        "slice of N chips, or simulated CPU devices)",
    )
    p.add_argument(
        "--seq-shards",
        type=int,
        default=1,
        metavar="S",
        help="of --devices, S split each sequence (context parallelism: jaxckpt train --mesh "
        "fsdp=N/S,seq=S); the state and the batch are split over the other N/S",
    )
    p.add_argument(
        "--context-parallel",
        choices=CONTEXT_PARALLEL_STRATEGIES,
        default="all_gather",
        help="with --seq-shards: the attention across the shards: all_gather (K/V gathered) or ring",
    )
    add_optimizer_arguments(p, loss_scale=False)
    p.add_argument(
        "--dtype",
        choices=nn.DTYPES,
        help="compute dtype; default: the model's, in --device's 16-bit type (float16 on ascend-910)",
    )
    p.add_argument(
        "--param-dtype",
        choices=list(PARAM_DTYPES),
        help="parameter storage dtype; default: the model's (with --lora: bfloat16; or --device's 16-bit "
        "type)",
    )
    add_lora_arguments(p, training=False)
    add_mlp_chunk_argument(p)
    p.add_argument(
        "--micro-batches",
        type=int,
        default=1,
        help="micro-batches of --batch sequences accumulated per step (any number: a step sees their "
        "product)",
    )
    p.add_argument(
        "--split-batch",
        action="store_true",
        help="let the planner cut --batch into more micro-batches (same tokens per step) when it does not "
        "fit whole",
    )
    p.add_argument(
        "--headroom", type=_fraction, default=0.0, help="fraction of the budget kept free (default 0)"
    )
    p.add_argument(
        "--remat",
        choices=list(remat.PRESETS),
        help="check this preset instead of solving: its predicted and compiled peak against the budget",
    )
    p.add_argument(
        "--allow-compress",
        action="store_true",
        help="let the solver also store kept activations compressed (int8, or --compress's format), on "
        "the device or offloaded, where that is the cheapest way to fit: the forward pass stays exact, "
        "the gradients change slightly, so it is off by default",
    )
    add_compress_arguments(p)
    p.add_argument(
        "--per-layer",
        action="store_true",
        help="let the layers' specs differ: the first k layers keep more than the rest where that fits the "
        "budget at less recompute than one spec for all (remat.Layered; remat'd specs on the device, "
        "uncompressed)",
    )
    p.add_argument(
        "--autotune-results",
        metavar="FILE",
        help="with a GPU --device: XLA autotune results dumped on such a GPU "
        "(--xla_gpu_dump_autotune_results_to), used instead of bracketing the GEMM emitters",
    )
    p.add_argument(
        "--explain",
        action="store_true",
        help="also print the largest contributors at the peak of the chosen (or --remat) spec, read "
        "from XLA's buffer assignment: parameters, optimizer state, gradients, residuals by tag, "
        "temporaries by op",
    )
    p.add_argument(
        "--plot",
        metavar="FILE",
        help="draw the chosen (or --remat) spec's live bytes over the compiled program, stacked by "
        "kind, into FILE.html (a page with hover) or FILE.png",
    )
    p.add_argument("--force", action="store_true", help="with --plot: replace an existing FILE")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.set_defaults(run=run, flags=PLAN_FLAGS)


def compile_target(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """The compile target ``--device`` names (a GPU or a TPU), when this process can compile
    for it, and a note when it names one but its extra is missing (then XLA:CPU measures)."""
    gpus = [name for name, target in plan.TARGETS.items() if target.platform == "gpu"]
    if args.autotune_results is not None and args.device not in gpus:
        raise ValueError(f"--autotune-results needs a GPU --device ({', '.join(gpus)}); got {args.device}")
    if args.device not in plan.TARGETS:
        return None, None
    missing = plan.aot_unavailable(args.device)
    if missing is None:
        return args.device, None
    compiler = "XLA:TPU" if plan.TARGETS[args.device].platform == "tpu" else "XLA:GPU"
    if args.autotune_results is not None:
        raise ValueError(f"--autotune-results needs the XLA:GPU compiler: {missing}")
    return None, f"measured with XLA:CPU, not {compiler}: {missing}"


def model_config(
    args: argparse.Namespace, device: plan.DevicePreset
) -> tuple[nn.TransformerConfig, str | None]:
    """The model the flags describe, and a note when the device's 16-bit type replaced bfloat16.

    As ``jaxckpt train``: ``--lora`` stores the frozen base in bfloat16 unless
    ``--param-dtype`` says otherwise, and ``--mlp-chunk`` tiles the MLP. Without ``--dtype``,
    the model's bfloat16 becomes the device's 16-bit type (``DevicePreset.in_half``: float16
    on an Ascend 910).
    """
    overrides = {} if args.param_dtype is None else {"param_dtype": PARAM_DTYPES[args.param_dtype]}
    if args.dtype is not None:
        overrides["dtype"] = args.dtype
    if args.lora is not None:
        overrides["lora"] = nn.LoraConfig(rank=args.lora, targets=args.lora_targets)
        overrides.setdefault("param_dtype", "bfloat16")
    elif args.quantize_base is not None:
        raise ValueError("--quantize-base needs --lora R: the quantized base is frozen, the adapters train")
    overrides["quantize_base"] = args.quantize_base
    if args.mlp_chunk is not None:
        overrides["mlp_chunk"] = args.mlp_chunk
    config = nn.TransformerConfig.preset(args.model, **overrides)
    if args.dtype is not None:
        return config, None
    half = device.in_half(config)
    if half == config:
        return config, None
    return (
        half,
        f"no bfloat16 on {device.name}: planned in {device.half} (jaxckpt train --dtype {device.half})",
    )


def run(args: argparse.Namespace) -> int:
    """Plans, prints the table (or JSON); returns 0, or 1 when nothing fits the budget."""
    device = plan.device_preset(args.device or "cpu")
    if args.device is None and args.budget is None:
        raise ValueError("give --device (its memory is the budget) or --budget, or both")
    budget = device.memory if args.budget is None else args.budget
    if args.host_memory is not None and not args.max_seq:
        raise ValueError("--host-memory bounds the --max-seq search: give --max-seq")
    if args.max_seq == (args.seq is not None):
        raise ValueError("give one of --seq N (plan that length) and --max-seq (the longest that fits)")
    plot_path(args)
    config, dtype_note = model_config(args, device)
    workload = plan.Workload(
        config,
        args.batch,
        args.seq or 2 * max(1, args.seq_shards),  # --max-seq: a placeholder the search replaces
        micro_batches=args.micro_batches,
        optimizer=optimizer_config(args),
        devices=args.devices,
        seq_shards=args.seq_shards,
        context_parallel=args.context_parallel,
    )
    target, target_note = compile_target(args)
    notes = [n for n in (dtype_note, target_note) if n]
    tags = compress_tags(args)
    if args.per_layer:
        per_layer_flags(args)
    if args.max_seq:
        return longest(args, workload, budget, notes, target, tags)
    if args.remat is not None:
        if args.allow_compress:
            raise ValueError(
                "--allow-compress lets the solver choose what to compress; with --remat R give "
                "--compress int8|fp8 to check R compressed"
            )
        return check(args, workload, budget, notes, target, tags)
    answer = plan.preset_table(
        workload,
        budget,
        headroom=args.headroom,
        device=args.device,
        model=args.model,
        split_batch=args.split_batch,
        target=target,
        autotune_results=args.autotune_results,
        allow_compress=args.allow_compress,
        compress=args.compress,
        compress_tags=tags,
        per_layer=args.per_layer,
    )
    result = answer.to_dict()
    result["notes"] = notes
    why = None
    if answer.chosen is not None and (args.explain or args.plot):
        why = plan.explain_workload(answer.chosen.workload, answer.chosen.spec, target=target)
        result["explain"] = explain_dict(why)
    if answer.error is not None:  # the planner's hints name arguments: the table names flags
        flags = {**FLAGS, **PLAN_FLAGS}
        if args.budget is None:  # the budget is the device's memory
            flags["budget"] = f"--device {args.device}'s"
        result["error"] = flag_message(result["error"], flags)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        console = Console()
        t = table(result)
        wide = console.options.update_width(1000)
        console.width = max(console.width, Measurement.get(console, wide, t).maximum)  # never wrap it
        console.print(t)
        if answer.chosen is not None:
            label = compiler_label(result["measured_on"])
            console.print(chosen_line(result["chosen"], result["config"], label))
            console.print(attempts_line(result["attempts"], label))
            estimate = roofline_line(result["chosen"], args.device, label) if args.device else None
            if estimate:
                console.print(estimate)
    if why is not None:
        show_explanation(args, why, f"{args.model} {answer.chosen.remat}")
    if answer.error is not None:
        print(f"jaxckpt plan: {result['error']}", file=sys.stderr)
        return 1
    return 0


def per_layer_flags(args: argparse.Namespace) -> None:
    """``--per-layer`` is the planner's choice of one spec per group of layers: it goes with
    neither a spec given (``--remat``), nor the ``--max-seq`` search, nor compression."""
    for flag, given in (
        ("--remat", args.remat is not None),
        ("--max-seq", args.max_seq),
        ("--allow-compress", args.allow_compress),
        ("--compress", args.compress is not None),
    ):
        if given:
            raise ValueError(
                f"--per-layer lets the planner choose a spec per group of layers, uncompressed; it does not "
                f"go with {flag}"
            )


def check(
    args: argparse.Namespace,
    workload: plan.Workload,
    budget: int,
    notes: list[str],
    target: str | None,
    tags: "list[str] | None" = None,
) -> int:
    """``--remat R``: R's predicted and XLA-measured peak against the budget; 0 when it fits, else 1.
    With ``--compress`` R is checked with what it keeps compressed (``--compress-tags``: those)."""
    spec = remat.get(args.remat)
    if args.compress is not None:
        try:
            spec = remat.compressed(spec, args.compress, tags)
        except ValueError as err:
            raise ValueError(f"--compress {args.compress} with --remat {args.remat}: {err}") from None
    name = plan.spec_name(spec)
    if name == "solved":
        name = f"{args.remat}+{args.compress} ({','.join(tags or ())})"
    predicted = plan.predict(workload, spec, target=target)
    measured = plan.measure(workload, spec, target=target, autotune_results=args.autotune_results)
    limit = int(budget * (1 - args.headroom))
    result = {
        "remat": name,
        "predicted_bytes": int(predicted.total),
        "measured_bytes": int(measured.peak),
        "host_bytes": int(predicted.host),
        "usable_bytes": limit,
        "fits": measured.peak <= limit,
        "measured": measured.to_dict(),
        "measured_on": measured.measured_on,
        "compress": {str(tag): fmt for tag, fmt in spec.compress.items()},
        "notes": notes,
        "caveat": plan.CPU_CAVEAT if target is None else plan.compile_target(target).caveat,
    }
    why = None
    if args.explain or args.plot:
        why = plan.explain_workload(workload, spec, target=target)
        result["explain"] = explain_dict(why)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        verdict = "fits" if result["fits"] else "does not fit"
        print(
            f"{args.model} B={workload.batch} T={workload.seq}, remat {name}: predicted "
            f"{plan.format_bytes(predicted.total)}, {compiler_label(measured.measured_on)} measured "
            f"{plan.format_bytes(measured.peak)}: "
            f"{verdict} {plan.format_bytes(limit)}" + "".join(f". {n}" for n in result["notes"])
        )
        if measured.collective_bytes is not None:
            print(f"communication: {plan.format_bytes(measured.collective_bytes)} per device per step")
    if why is not None:
        show_explanation(args, why, f"{args.model} {name}")
    return 0 if result["fits"] else 1


def longest(
    args: argparse.Namespace,
    workload: plan.Workload,
    budget: int,
    notes: list[str],
    target: str | None,
    tags: "list[str] | None" = None,
) -> int:
    """``--max-seq``: the longest T that fits, its plan and its compiled peak; 0 when one fits, else 1."""
    if args.remat is not None:
        raise ValueError("--max-seq chooses the remat spec itself: leave out --remat")
    answer = plan.max_seq(
        workload,
        budget,
        device=args.device,
        target=target,
        headroom=args.headroom,
        host_budget=args.host_memory,
        compress=args.compress,
        compress_tags=tags,
        allow_compress=args.allow_compress,
    )
    result = {**answer.to_dict(), "notes": [*notes, *answer.notes]}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(plan.describe_max_seq(answer))
        for note in notes:
            print(note)
        print(result["caveat"])
    return 0 if answer.max_seq else 1
