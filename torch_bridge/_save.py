"""``write_hf`` / ``save_hf``: jaxckpt parameters out as a Hugging Face directory, each tensor
in its own dtype, with the source's names and ids when given (``hf_fields``) and its
tokenizer files when asked (``tokenizer_from``).

``generation_config.json``: the writers never write one of their own. The source's, when
``tokenizer_from`` holds it (it is one of ``jaxckpt.data.TOKENIZER_FILES``), is copied
byte for byte, so it wins: transformers reads it in preference to ``config.json``'s
generation fields, and nothing of it (an ``eos_token_id`` list, sampling defaults) is lost
or rewritten. Without one, transformers derives it from ``config.json`` (``hf_fields``).
"""

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
from flax import nnx

from jaxckpt.data import TOKENIZER_FILES, copy_tokenizer_files, tokenizer_files
from jaxckpt.nn import Block, Transformer, TransformerConfig
from torch_bridge._archs import architecture
from torch_bridge._atomic import atomic_output, writing
from torch_bridge._convert import common_dtype, export_order, flatten, listing, target_shapes
from torch_bridge._table import Rule
from torch_bridge._writers import parse_shard_size, write_safetensors
from torch_bridge.hf import check_kept
from torch_bridge.peft import merge_lora


def write_hf(
    params,
    config: TransformerConfig,
    path: "str | os.PathLike",
    *,
    max_shard_size: "str | int" = "5GB",
    force: bool = False,
    on_tensor: Callable[[str, int], None] | None = None,
    hf_fields: Mapping | None = None,
    tokenizer_from: "str | os.PathLike | None" = None,
) -> Path:
    """Writes ``params`` (a ``Transformer``'s ``nnx.Param`` state or its pure dict) as a
    Hugging Face directory: safetensors shards, their index and ``config.json``.

    Each tensor is written in its parameters' own dtype, so a model holding fp32 norms and
    bf16 matrices is written so, bit for bit. A tensor gathered from parameters of
    different dtypes (a fused ``qkv_proj`` whose q, k and v differ) is written in their
    common dtype (``common_dtype``: bf16 with fp32 is fp32), which changes no value.
    ``config.json`` gets ``dtype=config.param_dtype``.

    A LoRA model (``config.lora``) is written merged (``merge_lora``): each adapted kernel
    as ``kernel + alpha / r * a @ b``, summed in fp32 and cast to the kernel's dtype, so the
    directory holds a plain model, with no adapter tensors, that computes what the LoRA model
    does. (``write_peft_adapter`` writes the adapters alone.)

    Args:
        params: the parameters.
        config: their model's config.
        path: the directory to write (under a temporary name, renamed when complete).
        max_shard_size: bytes per safetensors shard (``"5GB"``, ``"500MB"``, an int).
        force: replace ``path`` when it exists.
        on_tensor: progress callback ``(key, nbytes)``.
        hf_fields: ``config.json`` fields written over the writer's own: names, ids and
            generation defaults only (``Converted.hf_fields``: the source's
            ``bos_token_id``, ``eos_token_id``, ``pad_token_id``, ``_name_or_path``...).
        tokenizer_from: a directory whose tokenizer files (``jaxckpt.data.TOKENIZER_FILES``:
            ``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``,
            ``generation_config.json``...) are copied in, inside the temporary directory,
            so that the output is self-contained (``AutoTokenizer.from_pretrained`` reads
            it) and a failed write leaves nothing behind. A copied
            ``generation_config.json`` is kept as it is (see the module's docstring).

    Raises:
        FileExistsError: when ``path`` exists and ``force`` is False.
        OutputWriteError: a write failed (a full disk, say): one line naming ``path`` and the
            file being written; nothing partial is left (with ``force``, the old ``path`` is
            unchanged).
        ValueError: for a key of ``hf_fields`` that is not a name, id or generation field
            (named; checked before anything is written), a config the family's
            ``config.json`` cannot express, a ``tokenizer_from`` that is not a directory
            holding tokenizer files (named, checked before anything is written), parameters
            that are not the config's model's (named: adapters without ``config.lora``), or a
            quantized LoRA base (``config.quantize_base``; see ``merge_lora``).
        TypeError: when ``tokenizer_from`` is not a path.

    Example:
        >>> import tempfile
        >>> from jaxckpt import nn
        >>> cfg = nn.TransformerConfig.preset("tiny", n_layers=1, d_model=16, n_heads=2, ffn_dim=24)
        >>> params = nnx.state(nn.Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
        >>> out = write_hf(params, cfg, os.path.join(tempfile.mkdtemp(), "m"), max_shard_size="20KB",
        ...                hf_fields={"eos_token_id": 2})
        >>> files = sorted(os.listdir(out))  # three shards of at most 20 KB, their index, the config
        >>> files[0], files[-1], len(files), json.loads((out / "config.json").read_text())["eos_token_id"]
        ('config.json', 'model.safetensors.index.json', 5, 2)
    """
    params, config = merge_lora(params, config)
    arch = architecture(config.family)
    limit = parse_shard_size(max_shard_size)
    hf = arch.hf_config(config) | check_kept(hf_fields)
    _check_tokenizer_from(tokenizer_from)
    shapes = target_shapes(arch, config)
    order = export_order(arch, config, shapes)  # the model is traced once, not twice
    flat = {p: np.asarray(leaf) for p, leaf in flatten(params).items()}
    _check_paths(flat, shapes)
    dtypes = {key: common_dtype(flat[p].dtype for p in rule.jax) for key, rule, _ in order}
    specs = [(k, r.torch_shape({p: shapes[p].shape for p in r.jax}), dtypes[k]) for k, r, _ in order]
    rules = {key: (rule, layer) for key, rule, layer in order}

    def get(key: str) -> np.ndarray:
        rule, layer = rules[key]
        array = rule.to_torch(*_parts_as(flat, rule, layer, dtypes[key]))
        if on_tensor is not None:
            on_tensor(key, array.nbytes)
        return array

    with atomic_output(path, force=force) as tmp:
        write_safetensors(tmp, specs, get, max_shard_size=limit, metadata={"format": "pt"})
        with writing("config.json"):
            (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        if tokenizer_from is not None:
            with writing(tokenizer_step(tokenizer_from)):
                copy_tokenizer_files(tokenizer_from, tmp)
    return Path(path)


def tokenizer_step(src: "str | os.PathLike") -> str:
    """What ``writing`` calls the copy of ``src``'s tokenizer files (an error names them).

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp())
        >>> _ = (d / "tokenizer.json").write_text("{}")
        >>> tokenizer_step(d)
        'the tokenizer files (tokenizer.json)'
    """
    return f"the tokenizer files ({', '.join(p.name for p in tokenizer_files(src))})"


def _check_paths(flat: dict, shapes: dict) -> None:
    """Refuses parameters the config's model does not have, or lacks: none is left unwritten."""
    unknown, missing = sorted(set(flat) - set(shapes)), sorted(set(shapes) - set(flat))
    if unknown or missing:
        found = [f"{len(unknown)} unknown: {listing(unknown)}"] if unknown else []
        found += [f"{len(missing)} missing: {listing(missing)}"] if missing else []
        raise ValueError(
            f"params are not those of config's model ({'; '.join(found)}); pass the model's config"
        )


def _check_tokenizer_from(tokenizer_from: "str | os.PathLike | None") -> None:
    """Refuses a ``tokenizer_from`` that is not a directory holding tokenizer files."""
    if tokenizer_from is None:
        return
    if not isinstance(tokenizer_from, str | os.PathLike):
        raise TypeError(f"tokenizer_from must be a directory path, got {type(tokenizer_from).__name__}")
    if not Path(tokenizer_from).is_dir():
        raise ValueError(f"tokenizer_from={str(tokenizer_from)!r} is not a directory")
    if not tokenizer_files(tokenizer_from):
        raise ValueError(
            f"tokenizer_from={str(tokenizer_from)!r} holds no tokenizer files (none of "
            f"{', '.join(TOKENIZER_FILES)}); save the tokenizer there first "
            "(tokenizer.save_pretrained(dir)), or leave tokenizer_from out"
        )


def _parts_as(flat: dict, rule: Rule, layer: int | None, dtype: np.dtype) -> tuple[dict, int | None]:
    """``(params, layer)`` for ``rule.to_torch``: ``flat`` as it is, or (a fused rule whose
    parts differ in dtype) its parts at ``layer`` cast to ``dtype``, so that a stacked
    parameter is not cast whole once per layer."""
    if all(flat[p].dtype == dtype for p in rule.jax):
        return flat, layer
    if rule.per_layer:
        return {p: flat[p][layer : layer + 1].astype(dtype) for p in rule.jax}, 0
    return {p: flat[p].astype(dtype) for p in rule.jax}, layer


def save_hf(
    model: Transformer,
    path: "str | os.PathLike",
    *,
    max_shard_size: "str | int" = "5GB",
    force: bool = False,
    hf_fields: Mapping | None = None,
    tokenizer_from: "str | os.PathLike | None" = None,
) -> Path:
    """Writes ``model`` as a Hugging Face directory that ``transformers`` loads.

    Safetensors (sharded above ``max_shard_size``, with ``model.safetensors.index.json``)
    and ``config.json``. Each parameter keeps its dtype (see ``write_hf``). The directory
    is written under a temporary name and renamed when complete.

    A ``Transformer`` does not know its tokenizer's special ids or its name, so
    ``config.json`` gets ``bos_token_id``, ``eos_token_id`` and ``pad_token_id`` as None,
    unless ``hf_fields`` gives them. To keep the source's names and ids through a
    load -> save, pass them along: ``save_hf(model, out, hf_fields=read_checkpoint(src).hf_fields)``
    (or read once with ``converted = read_checkpoint(src)``, ``model = converted.model()``,
    and pass ``converted.hf_fields``).

    Args:
        model: the model.
        path: the directory to write.
        max_shard_size: bytes per safetensors shard.
        force: replace ``path`` when it exists.
        hf_fields: ``config.json`` fields to write: names, ids and generation defaults
            only (see ``write_hf``).
        tokenizer_from: a directory (the source's Hugging Face directory, or a jaxckpt
            checkpoint directory) whose tokenizer files, chat template and
            ``generation_config.json`` are copied in (see ``write_hf``).

    Raises:
        FileExistsError: when ``path`` exists and ``force`` is False.
        OutputWriteError: a write failed (a full disk, say; see ``write_hf``).
        ValueError: when the model is not expressible in its family's ``config.json``
            (names the field), ``hf_fields`` holds a field that is not a name, id or
            generation field (named), or ``tokenizer_from`` holds no tokenizer files.

    Example:
        >>> import tempfile
        >>> from jaxckpt import nn
        >>> cfg = nn.TransformerConfig.preset("tiny", n_layers=1, d_model=16, n_heads=2, ffn_dim=24)
        >>> d = tempfile.mkdtemp()
        >>> src = save_hf(nn.Transformer(cfg, rngs=nnx.Rngs(0)), os.path.join(d, "src"),
        ...               hf_fields={"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2})
        >>> sorted(os.listdir(src))
        ['config.json', 'model.safetensors']
        >>> from torch_bridge import load_hf, read_checkpoint
        >>> model = load_hf(src)  # an nn.Transformer: the ids are not in it
        >>> out = save_hf(model, os.path.join(d, "out"), hf_fields=read_checkpoint(src).hf_fields)
        >>> written = json.loads((out / "config.json").read_text())
        >>> written["bos_token_id"], written["eos_token_id"], written["pad_token_id"]
        (1, 2, 2)
        >>> _ = (src / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')  # tok.save_pretrained
        >>> out = save_hf(model, os.path.join(d, "with_tokenizer"), tokenizer_from=src)
        >>> sorted(os.listdir(out))
        ['config.json', 'model.safetensors', 'tokenizer_config.json']
    """
    if isinstance(model, Block):
        raise TypeError("save_hf writes a Transformer; the seed block is written by save_seed_block")
    options = dict(max_shard_size=max_shard_size, force=force, hf_fields=hf_fields)
    options |= dict(tokenizer_from=tokenizer_from)
    return write_hf(nnx.state(model, nnx.Param), model.config, path, **options)
