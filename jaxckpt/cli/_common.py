"""The flags that several subcommands declare alike, declared once: the LoRA flags
(``train`` and ``plan``), the optimizer and offload flags (``train`` and ``plan``), the MLP's
tiling and the compressed residuals (``train``, ``compare`` and ``plan``), and the command
line's one positive-int check.

Each ``add_*`` function adds its flags to a subcommand's parser; the subcommand turns the
parsed values into library objects (``nn.LoraConfig``, ``train.OptimizerConfig``).
"""

import argparse

from jaxckpt import nn, remat, train
from jaxckpt._checks import require_positive_int


def positive_int(text: str) -> int:
    """The argparse ``type`` of a count flag: ``text`` as an int of at least 1, checked by the
    library's own ``require_positive_int``.

    Example:
        >>> positive_int("3")
        3
        >>> positive_int("0")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: must be a positive integer, got '0'
    """
    try:
        value = int(text)
        require_positive_int("value", value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    return value


def add_lora_arguments(p, *, training: bool) -> None:
    """``--lora R``, ``--lora-targets`` and ``--quantize-base``; with ``training``, also the
    adapters' own ``--lora-alpha`` and ``--lora-dropout`` (the planner does not need them)."""
    description = "train low-rank adapters only; the base is frozen"
    if not training:
        description = "plan for training low-rank adapters only (as jaxckpt train --lora)"
    lora = p.add_argument_group("LoRA", description)
    lora.add_argument("--lora", type=positive_int, metavar="R", help="adapters of rank R on --lora-targets")
    lora.add_argument(
        "--lora-targets",
        default="q,k,v,o",
        help=f"comma-separated projections to adapt, of {','.join(nn.LORA_TARGETS)} (default q,k,v,o)",
    )
    lora.add_argument(
        "--quantize-base",
        choices=nn.QUANTIZATIONS,
        help="store the frozen base quantized (QLoRA), dequantized inside each matmul",
    )
    if training:
        lora.add_argument(
            "--lora-alpha", type=float, help="the adapters' output scale is alpha / R (default R)"
        )
        lora.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on the adapters' input")


def add_mlp_chunk_argument(p) -> None:
    """``--mlp-chunk N``: the MLP over chunks of N tokens (``nn.TransformerConfig.mlp_chunk``)."""
    p.add_argument(
        "--mlp-chunk",
        type=positive_int,
        metavar="N",
        help="tile the MLP over chunks of N tokens: its backward pass holds one chunk's intermediates "
        "(3 x N x ffn_dim) instead of the sequence's, at the same numbers; default: untiled",
    )


def add_compress_arguments(p, *, tags: bool = True) -> None:
    """``--compress int8|fp8`` (what the remat spec keeps, stored compressed) and, with
    ``tags``, ``--compress-tags a,b`` (only those)."""
    p.add_argument(
        "--compress",
        choices=remat.FORMATS,
        help="store the activations the remat spec keeps in int8 or fp8 (a float32 scale per 128 "
        "features; the layer inputs of bf16 take about half their bytes): the forward pass is exact, "
        "the gradients change slightly; default: at their dtype",
    )
    if tags:
        p.add_argument(
            "--compress-tags",
            metavar="TAG,...",
            help="with --compress: compress only these kept tags (e.g. layer_input,attn_out); "
            f"tags: {', '.join(t.value for t in remat.Tag)}",
        )


def compress_tags(args) -> "list[str] | None":
    """``--compress-tags`` as a list of tag names (None when not given); an error names the
    flag when it comes without ``--compress``."""
    given = getattr(args, "compress_tags", None)
    if given is None:
        return None
    if getattr(args, "compress", None) is None:
        raise ValueError(f"--compress-tags {given} needs --compress (int8 or fp8)")
    names = [name.strip() for name in given.split(",") if name.strip()]
    unknown = [name for name in names if name not in remat.Tag._value2member_map_]
    if unknown or not names:
        raise ValueError(
            f"--compress-tags {given}: unknown tag(s) {', '.join(unknown) or '(none given)'}; "
            f"tags: {', '.join(t.value for t in remat.Tag)}"
        )
    return names


OPTIMIZER_FLAGS = {
    "name": "--optimizer",
    "moments_dtype": "--moments-dtype",
    "offload": "--offload-optimizer",
    "offload_master": "--offload-master",
    "loss_scale": "--loss-scale",
}
"""``OptimizerConfig``'s fields -> the flags that set them (for error messages)."""


def add_optimizer_arguments(p, *, loss_scale: bool = True) -> None:
    """``--optimizer``, ``--moments-dtype``, ``--offload-optimizer``, ``--offload-master`` and,
    with ``loss_scale``, ``--loss-scale`` (the planner does not price loss scaling)."""
    p.add_argument("--optimizer", choices=train.OPTIMIZERS, default="adamw", help="default: adamw")
    p.add_argument(
        "--moments-dtype",
        choices=train.MOMENTS_DTYPES,
        help="dtype of the optimizer state (both AdamW moments); default: the parameters' "
        "(float32 for float16 ones)",
    )
    p.add_argument(
        "--offload-optimizer",
        action="store_true",
        help="keep the optimizer state in pinned host memory, updated leaf by leaf (on CPU: saves nothing)",
    )
    p.add_argument(
        "--offload-master",
        action="store_true",
        help="keep a full fine-tuning's float32 master weights in pinned host memory (needs "
        "--dtype bfloat16 or float16 and float32 params; the step computes with 16-bit copies; "
        "on CPU: saves nothing)",
    )
    if loss_scale:
        p.add_argument(
            "--loss-scale",
            default="auto",
            metavar="dynamic|none|auto|N",
            help="loss scaling: dynamic (skips non-finite steps), none, a static scale N, or auto "
            "(dynamic for a float16 model; the default)",
        )


def optimizer_config(args) -> train.OptimizerConfig:
    """The ``train.OptimizerConfig`` that ``add_optimizer_arguments``' flags (and ``--lr``,
    where the command has it) describe: the one object ``train`` trains with and ``plan``
    plans for."""
    fields = {
        "name": args.optimizer,
        "moments_dtype": args.moments_dtype,
        "offload": args.offload_optimizer,
        "offload_master": args.offload_master,
    }
    for name, flag in (("learning_rate", "lr"), ("loss_scale", "loss_scale")):
        if getattr(args, flag, None) is not None:
            fields[name] = getattr(args, flag)
    return train.OptimizerConfig(**fields)
