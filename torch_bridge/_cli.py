"""``jaxckpt convert``: PyTorch / Hugging Face checkpoints to jaxckpt (orbax) and back.

Registered on the ``jaxckpt`` command through the ``jaxckpt.cli`` entry point, so that
jaxckpt itself never imports torch_bridge.
"""

import argparse
import json
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from jaxckpt._checks import require_finite
from jaxckpt.data import copy_tokenizer_files, tokenizer_files
from jaxckpt.nn import TransformerConfig
from jaxckpt.train import PARAMS_KIND, initial_model, read_meta, restore_checkpoint, save_checkpoint
from torch_bridge._archs import ARCHITECTURES, architecture
from torch_bridge._atomic import atomic_output, writing
from torch_bridge._convert import export_order, export_state_dict, flatten, listing, model_class, unflatten
from torch_bridge._models import DTYPES, build_model, read_checkpoint, seed_config_of
from torch_bridge._save import tokenizer_step, write_hf
from torch_bridge._sources import find_config, open_tensors
from torch_bridge._verify import verify
from torch_bridge._writers import write_torch_file
from torch_bridge.peft import (
    adapter_tensors,
    lora_paths,
    merge_lora,
    peft_lora_config,
    read_peft_adapter,
    sixteen_bit_rounding,
    write_peft_adapter,
)

SEED_KEYS = ("q_proj.weight", "out_proj.weight", "ffn.0.weight", "ln1.weight")
REPORTED = ("ignored", "dtype_changes", "notes", "missing", "unknown_fields", "verified_max_abs_diff")
REPORTED += ("verify_tolerance", "target_modules", "lora_rounding")
"""The ``ConversionReport`` entries the summary shows (when set)."""

NO_TOKENIZER = {
    "jax": "no tokenizer files in {src}: generate/train will need --tokenizer",
    "torch": "no tokenizer files in {src}: {dst} has none, so AutoTokenizer.from_pretrained cannot read it",
}
"""The line the summary prints (``tokenizer_note``) when SRC holds no tokenizer files, per direction."""

FLAGS = {
    "adapter_only": "--adapter-only",
    "allow_missing": "--allow-missing",
    "arch": "--arch",
    "base_model_name_or_path": "--base-model",
    "config": "--config",
    "dtype": "--dtype",
    "lora_from": "--lora-from",
    "max_shard_size": "--max-shard-size",
    "num_heads": "--num-heads",
    "strict": "--strict",
    "verify": "--verify",
}
"""torch_bridge's argument names -> ``convert``'s flags, added to ``jaxckpt.cli``'s shared
table (which has ``force``) when ``jaxckpt`` turns a library error into a message."""


def add_parser(sub) -> None:
    """Registers ``convert`` on the ``jaxckpt`` subcommand parser ``sub``."""
    p = sub.add_parser(
        "convert",
        help="convert a PyTorch / Hugging Face checkpoint to jaxckpt (--to jax) or back (--to torch)",
        description="SRC -> DST. --to jax: SRC is a Hugging Face directory or a state_dict file "
        "(.safetensors/.pt/.bin); DST becomes an orbax checkpoint + jaxckpt.json that "
        "'jaxckpt train --init-from' reads. --to torch: SRC is a jaxckpt checkpoint directory; "
        "DST becomes a Hugging Face directory (or a .pt for the seed block).",
    )
    p.add_argument("src", help="the checkpoint to read")
    p.add_argument("dst", help="where to write (never replaced without --force)")
    p.add_argument("--arch", default="auto", choices=("auto", *ARCHITECTURES), help="default: the config's")
    p.add_argument("--to", default="jax", choices=("jax", "torch"), help="direction (default: jax)")
    p.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        help="cast every parameter (default: each keeps its fp32/bf16/fp16 dtype; others are cast to the "
        "checkpoint's dtype); every cast is listed as dtype_changes",
    )
    p.add_argument(
        "--config",
        metavar="CONFIG_JSON",
        help="a Hugging Face config.json, for a single state_dict file (not a model preset)",
    )
    p.add_argument("--num-heads", type=int, help="attention heads of a seed block (its .pt cannot say)")
    p.add_argument("--max-shard-size", default="5GB", help="safetensors shard size for --to torch")
    p.add_argument("--allow-missing", action="store_true", help="keep missing parameters at zero")
    p.add_argument(
        "--strict",
        action="store_true",
        help="refuse config.json fields jaxckpt does not know (default: list them, warn once, go on)",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="run the transformers model (of SRC, or of DST with --to torch) and the jaxckpt one on a "
        "short input; fail unless their logits agree within the dtype's tolerance (needs transformers)",
    )
    p.add_argument(
        "--adapter-only",
        action="store_true",
        help="--to torch of a LoRA checkpoint: write its adapters alone, in the PEFT format "
        "(adapter_model.safetensors + adapter_config.json); default: the adapters merged into the base",
    )
    p.add_argument("--base-model", help="--adapter-only: base_model_name_or_path for adapter_config.json")
    p.add_argument(
        "--lora-from",
        metavar="ADAPTER_DIR",
        help="--to jax: put the PEFT LoRA adapter in ADAPTER_DIR on the base SRC; DST then trains it "
        "further (jaxckpt train --init-from DST)",
    )
    p.add_argument("--force", action="store_true", help="replace DST if it exists")
    p.add_argument("--json", action="store_true", help="print JSON instead of a progress bar and summary")
    p.set_defaults(run=run, flags=FLAGS)


@contextmanager
def _progress(total: int, enabled: bool, what: str):
    """Yields ``on_tensor(key, nbytes)`` advancing a rich bar over ``total`` tensors."""
    if not enabled:
        yield lambda key, nbytes: None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    columns += (TextColumn("{task.fields[key]}"),)
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task(what, total=total, key="")
        yield lambda key, nbytes: bar.update(task, advance=1, key=key)


def _arch(src: Path, args: argparse.Namespace) -> str | None:
    """The ``--arch`` to use: given, or ``seed-block`` for a lone file with the seed's keys,
    or None (from the config)."""
    if args.arch != "auto":
        return args.arch
    if args.config is not None or find_config(src) is not None:
        return None
    with open_tensors(src) as source:
        if all(k in source for k in SEED_KEYS):
            return "seed-block"
    raise ValueError(f"{src}: cannot tell the architecture; give --arch, and --config for a state_dict file")


def to_jax(args: argparse.Namespace) -> dict:
    """``--to jax``: reads SRC into jaxckpt parameters and writes an orbax checkpoint."""
    src, dst = Path(args.src), Path(args.dst)
    arch, config, dtype = _arch(src, args), args.config, args.dtype
    if arch == "seed-block":
        if args.num_heads is None:
            raise ValueError("--arch seed-block needs --num-heads (a .pt does not record the head count)")
        config, dtype = seed_config_of(src, args.num_heads, dtype), None
    with open_tensors(src) as source:
        total = len(source)
    with atomic_output(dst, force=args.force) as tmp, _progress(total, not args.json, "converting") as tick:
        start = time.perf_counter()
        options = dict(config=config, arch=arch, dtype=dtype, allow_missing=args.allow_missing)
        options |= dict(strict=args.strict, verify=args.verify)
        converted = read_checkpoint(src, **options, on_tensor=tick)
        if args.lora_from is not None:
            _add_adapter(converted, Path(args.lora_from))
        meta = {
            "kind": PARAMS_KIND,
            "arch": converted.arch.name,
            "config": converted.config.to_dict(),
            "source": src.name,
            "report": converted.report.to_dict(),
            "param_dtypes": {path: str(a.dtype) for path, a in flatten(converted.params).items()},
            "hf_fields": converted.hf_fields,
        }
        with writing("the orbax checkpoint (step 0) and jaxckpt.json"):
            save_checkpoint(tmp, 0, converted.params, meta)
        with writing(tokenizer_step(src) if src.is_dir() else "nothing"):
            copied = copy_tokenizer_files(src, tmp) if src.is_dir() else []  # in tmp: all or nothing
        seconds = time.perf_counter() - start
    nbytes = sum(a.nbytes for a in jax.tree.leaves(converted.params))
    tensors = converted.report.converted
    summary = _summary(src, dst, "jax", converted.arch.name, tensors, nbytes, seconds, meta)
    return summary | (_tokenizer(src, dst, "jax", copied) if arch != "seed-block" else {})


def _add_adapter(converted, adapter: Path) -> None:
    """``--lora-from``: the PEFT adapter in ``adapter`` put on the converted base (in place)."""
    if converted.arch.block:
        raise ValueError("--lora-from puts a PEFT adapter on a Hugging Face base; the seed block has none")
    converted.config = converted.config.replace(lora=peft_lora_config(adapter, converted.config))
    adapters = flatten(read_peft_adapter(adapter, converted.config))
    require_finite(adapters, str(adapter))
    converted.params = unflatten(flatten(converted.params) | adapters)
    converted.report.notes.append(f"LoRA adapter from {adapter}: {converted.config.lora}")


def _restore(src: Path) -> tuple[str, TransformerConfig, dict, dict]:
    """``(arch, config, params, meta)`` of a jaxckpt checkpoint directory (converted or
    trained). A converted one's parameters come back in the dtypes they were stored in
    (``jaxckpt.json``'s ``param_dtypes``: fp32 norms stay fp32 beside bf16 matrices)."""
    meta = read_meta(src)
    if "config" not in meta:
        raise ValueError(f"{src}: not a jaxckpt checkpoint directory (no jaxckpt.json with a config)")
    try:
        config = TransformerConfig.from_dict(meta["config"])
        arch = architecture(meta.get("arch", config.family))
    except (TypeError, ValueError) as err:  # a damaged jaxckpt.json (quoted: no name= rewritten as a flag)
        raise ValueError(f"{src / 'jaxckpt.json'}: its config or arch does not load: {str(err)!r}") from err
    if not arch.block and meta.get("kind") != PARAMS_KIND:  # a trained checkpoint: model + optimizer
        model = initial_model(config, 0, src)
        return arch.name, config, nnx.to_pure_dict(nnx.state(model, nnx.Param)), meta
    cls = model_class(arch)
    abstract = nnx.state(nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0))), nnx.Param)
    stored = meta.get("param_dtypes", {})
    try:
        shapes = {
            path: jax.ShapeDtypeStruct(a.shape, stored.get(path, a.dtype))
            for path, a in flatten(nnx.to_pure_dict(abstract)).items()
        }
    except (TypeError, ValueError) as err:  # a dtype name that is none
        raise ValueError(f"{src / 'jaxckpt.json'}: its param_dtypes do not load: {str(err)!r}") from err
    nnx.replace_by_pure_dict(abstract, unflatten(shapes))
    params = nnx.to_pure_dict(restore_checkpoint(src, abstract)[1])
    require_finite(params, str(src))  # (initial_model checks a trained one's)
    return arch.name, config, params, meta


def to_torch(args: argparse.Namespace) -> dict:
    """``--to torch``: writes a jaxckpt checkpoint as a Hugging Face directory (or a .pt)."""
    src, dst = Path(args.src), Path(args.dst)
    arch, config, params, stored = _restore(src)
    if args.adapter_only:
        return _adapter_only(args, src, dst, config, params, stored)
    merged = lora_paths(params) if config.lora is not None else []
    name = DTYPES[args.dtype] if args.dtype is not None else None
    rounding = sixteen_bit_rounding(params, config, name) if merged else None
    params, config = merge_lora(params, config, name)  # summed in fp32, cast once to --dtype
    order = export_order(arch, config)
    casts = []
    if name is not None:
        casts = _casts(order, params, name)
        params = jax.tree.map(lambda a: np.asarray(a).astype(name), params)
        config = config.replace(dtype=name, param_dtype=name)
    total = len(order)
    names = [p.name for p in tokenizer_files(src)]  # a trained checkpoint's too (train copies them)
    start = time.perf_counter()
    with _progress(total, not args.json, "exporting") as tick:
        if arch == "seed-block":
            if dst.exists() and not args.force:
                raise FileExistsError(f"{dst} exists; pass --force to replace it")
            write_torch_file(dst, _ticking(export_state_dict(params, arch, config), tick))
        else:
            options = dict(max_shard_size=args.max_shard_size, force=args.force, on_tensor=tick)
            options |= dict(tokenizer_from=src if names else None)  # copied inside write_hf's temp dir
            write_hf(params, config, dst, hf_fields=stored.get("hf_fields"), **options)
    nbytes = sum(np.asarray(a).nbytes for a in jax.tree.leaves(params))
    report = _verified(dst, arch, config, params) if args.verify else {}
    notes = [f"merged the LoRA adapters of {', '.join(merged)} into their kernels"] if merged else []
    meta = {"report": report | {"dtype_changes": casts, "notes": notes, "lora_rounding": rounding}}
    summary = _summary(src, dst, "torch", arch, total, nbytes, time.perf_counter() - start, meta)
    if arch == "seed-block":
        return summary
    return summary | _tokenizer(src, dst, "torch", names)


def _adapter_only(args, src: Path, dst: Path, config: TransformerConfig, params: dict, stored: dict) -> dict:
    """``--to torch --adapter-only``: the checkpoint's LoRA adapters as a PEFT directory."""
    for flag, given in (("--dtype", args.dtype), ("--verify", args.verify)):
        if given:
            raise ValueError(
                f"--adapter-only writes the adapters alone, in the dtype they trained in: {flag} applies "
                "to a full export (leave out --adapter-only)"
            )
    start = time.perf_counter()
    name = args.base_model or (stored.get("hf_fields") or {}).get("_name_or_path")
    write_peft_adapter(params, config, dst, base_model_name_or_path=name or None, force=args.force)
    modules, tensors = adapter_tensors(params, config)
    nbytes = sum(a.nbytes for a in tensors.values())
    seconds = time.perf_counter() - start
    summary = _summary(src, dst, "torch", config.family, len(tensors), nbytes, seconds, {})
    peft = {"r": config.lora.rank, "lora_alpha": config.lora.alpha, "base_model_name_or_path": name or None}
    return summary | {"adapter_only": True, "target_modules": [m.name for m in modules.values()]} | peft


def _tokenizer(src: Path, dst: Path, to: str, copied: list[str]) -> dict:
    """The summary's ``tokenizer_files`` (the names copied into DST), with a
    ``tokenizer_note`` when there were none.

    Example:
        >>> _tokenizer(Path("a"), Path("b"), "jax", [])["tokenizer_note"]
        'no tokenizer files in a: generate/train will need --tokenizer'
    """
    if copied:
        return {"tokenizer_files": copied}
    return {"tokenizer_files": [], "tokenizer_note": NO_TOKENIZER[to].format(src=src, dst=dst)}


def _casts(order, params: dict, name: str) -> list[tuple[str, str, str]]:
    """``(torch key, from, to)`` of every tensor ``--to torch --dtype`` casts."""
    flat = flatten(params)
    found = [(key, {str(flat[p].dtype) for p in rule.jax}) for key, rule, _ in order]
    return [(key, "+".join(sorted(dtypes)), name) for key, dtypes in found if dtypes != {name}]


def _verified(dst: Path, arch: str, config: TransformerConfig, params: dict) -> dict:
    """``--to torch --verify``: transformers' reading of the written directory against the model."""
    if architecture(arch).block:
        raise ValueError(f"{dst}: verify=True checks Hugging Face models; the seed block has none")
    diff, limit = verify(dst, build_model(architecture(arch), config, params), config)
    return {"verified_max_abs_diff": diff, "verify_tolerance": limit}


def _ticking(items, tick: Callable[[str, int], None]):
    for key, array in items:
        tick(key, array.nbytes)
        yield key, array


def _summary(src, dst, to, arch, tensors, nbytes, seconds, meta) -> dict:
    report = meta.get("report", {})
    return {
        "src": str(src),
        "dst": str(dst),
        "to": to,
        "arch": arch,
        "tensors": tensors,
        "bytes": int(nbytes),
        "seconds": seconds,
        "mb_per_s": nbytes / 1e6 / max(seconds, 1e-9),
        **{k: report[k] for k in REPORTED if report.get(k) is not None and report.get(k) != []},
    }


def run(args: argparse.Namespace) -> int:
    """Converts, then prints a summary (or JSON)."""
    result = (to_jax if args.to == "jax" else to_torch)(args)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
        return 0
    table = Table(title=f"jaxckpt convert ({result['arch']}, to {result['to']})")
    columns = ["tensors", "MB", "seconds", "MB/s"]
    mb, seconds, rate = result["bytes"] / 1e6, result["seconds"], result["mb_per_s"]
    row = [str(result["tensors"]), f"{mb:.1f}", f"{seconds:.2f}", f"{rate:.1f}"]
    if "tokenizer_files" in result:
        columns.append("tokenizer files")
        row.append(str(len(result["tokenizer_files"])))
    if "verified_max_abs_diff" in result:
        columns += ["max |logit diff|", "tolerance"]
        row += [f"{result['verified_max_abs_diff']:.2g}", f"{result['verify_tolerance']:.2g}"]
    for column in columns:
        table.add_column(column, justify="right")
    table.add_row(*row)
    console = Console()
    console.print(table)
    shown = {"dtype_changes": _casts_shown, "lora_rounding": _rounding_shown}
    for key in REPORTED:
        if key in result:
            console.print(shown[key](result[key]) if key in shown else f"{key}: {result[key]}")
    if result.get("tokenizer_files"):
        console.print(f"tokenizer files: {', '.join(result['tokenizer_files'])}")
    if "tokenizer_note" in result:
        console.print(result["tokenizer_note"])
    console.print(f"wrote {result['dst']}")
    return 0


def _rounding_shown(rounding: dict) -> str:
    """``lora_rounding`` for people.

    Example:
        >>> print(_rounding_shown({"dtype": "bfloat16", "relative_delta_error": 0.123,
        ...                        "worst": "blocks.mlp.up", "worst_relative_delta_error": 0.2}))
        lora_rounding: bfloat16 merged kernels lose 12.3% of the LoRA update (blocks.mlp.up: 20.0%)
          (the relative error of the update after rounding; --dtype float32 keeps it whole)
    """
    dtype = "16-bit" if rounding["dtype"] == "kept" else rounding["dtype"]
    worst, error = rounding["worst"], rounding["worst_relative_delta_error"]
    where = f" ({worst}: {error:.1%})" if worst else ""
    return (
        f"lora_rounding: {dtype} merged kernels lose {rounding['relative_delta_error']:.1%} of the LoRA "
        f"update{where}\n  (the relative error of the update after rounding; --dtype float32 keeps it whole)"
    )


def _casts_shown(casts: list) -> str:
    """``dtype_changes`` for people: one line per ``from -> to``, counted, tensors listed
    (``LIST_AT_MOST``; ``--json`` lists them all).

    Example:
        >>> print(_casts_shown([("a", "float32", "bfloat16"), ("b", "float32", "bfloat16")]))
        dtype_changes: 2 tensor(s) cast float32 -> bfloat16: a, b
    """
    groups: dict[tuple[str, str], list[str]] = {}
    for key, source, target in casts:
        groups.setdefault((source, target), []).append(key)
    lines = [f"{len(keys)} tensor(s) cast {a} -> {b}: {listing(keys)}" for (a, b), keys in groups.items()]
    return "dtype_changes: " + "\n  ".join(lines)
