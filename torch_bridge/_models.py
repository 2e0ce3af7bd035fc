"""``read_checkpoint`` / ``load_hf`` and the seed block's ``.pt``: checkpoints in and out of
jaxckpt (``save_hf`` / ``write_hf`` live in ``_save``)."""

import dataclasses
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
from flax import nnx

from jaxckpt.nn import Block, Transformer, TransformerConfig, from_params
from torch_bridge._archs import Architecture, architecture, seed_block_config
from torch_bridge._config import Translation, translate
from torch_bridge._convert import (
    ConversionReport,
    convert_state_dict,
    export_state_dict,
    model_class,
)
from torch_bridge._save import save_hf as save_hf  # re-exported: torch_bridge imports them from here
from torch_bridge._save import write_hf as write_hf
from torch_bridge._sources import find_config, open_tensors
from torch_bridge._verify import verify as run_verify
from torch_bridge._writers import write_torch_file
from torch_bridge.hf import hf_name, hf_names, kept_fields, read_config_json

DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}
DTYPES |= {"fp16": "float16", "float16": "float16"}
"""Names ``dtype=`` and ``--dtype`` accept -> ``TransformerConfig`` dtype names."""


def _dtype_name(dtype) -> str:
    if str(dtype) not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[str(dtype)]


def config_from_hf(
    hf: "Mapping | str | os.PathLike", *, dtype: str = "float32", strict: bool = False
) -> TransformerConfig:
    """The ``TransformerConfig`` of a Hugging Face ``config.json`` of any supported family
    (``llama``, ``mistral``, ``qwen2``, ``qwen3``, ``gemma2``, ``gemma3_text``, ``gemma3``,
    ``phi3``, ``smollm3``, ``gpt2``).

    Fields known not to change the numbers are accepted; a field in no known class is
    warned about (``JaxckptWarning``) and ignored, or refused when ``strict``.

    Args:
        hf: the config as a dict, or the path of a ``config.json`` (or of its directory).
        dtype: parameter and compute dtype of the jaxckpt model.
        strict: refuse config fields jaxckpt does not know instead of warning.

    Raises:
        ValueError: for an unknown ``model_type``, a field jaxckpt cannot honour (named,
            with the reason), a missing required field, or (strict) an unknown field.

    Example:
        >>> cfg = config_from_hf({"model_type": "gpt2", "vocab_size": 11, "n_embd": 6, "n_layer": 1,
        ...                       "n_head": 3})
        >>> cfg.family, cfg.ffn_dim, str(cfg.activation), cfg.tie_embeddings
        ('gpt2', 24, 'gelu_tanh', True)
    """
    return _translate(*_hf_dict(hf), _dtype_name(dtype), strict=strict)[1]


def _hf_dict(hf) -> tuple[dict, str]:
    if isinstance(hf, Mapping):
        return dict(hf), "config"
    path = Path(hf)
    path = path / "config.json" if path.is_dir() else path
    return read_config_json(path), str(path)


def _translate(hf: dict, source: str, dtype: str, *, strict: bool) -> tuple[Translation, TransformerConfig]:
    """The translation of a config dict and its ``TransformerConfig``; no weight table is needed."""
    found = translate(hf, source, strict=strict)
    try:
        config = TransformerConfig(**found.fields, dtype=dtype, param_dtype=dtype)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{source}: {err}{hf_names(str(err), found.family)}") from err
    return found, config


@dataclasses.dataclass
class Converted:
    """A checkpoint read into jaxckpt parameters (not yet JAX arrays).

    Attributes:
        arch: its architecture. config: the jaxckpt config. params: the nested dict of
        numpy arrays of the model's ``nnx.Param`` state. report: what did not map cleanly.
        hf_fields: the names and ids of the source ``config.json`` that the config does not
            carry (``bos_token_id``, ``eos_token_id``, ``pad_token_id``, ``_name_or_path``,
            generation defaults; ``torch_bridge.hf._kept.KEPT``), for ``save_hf(...,
            hf_fields=...)`` to write back. Empty when read with a ``TransformerConfig``.

    Example:
        >>> import os, tempfile
        >>> from flax import nnx
        >>> from jaxckpt import nn
        >>> import torch_bridge
        >>> cfg = nn.TransformerConfig.preset("tiny", n_layers=1, d_model=16, n_heads=2, ffn_dim=24)
        >>> model = nn.Transformer(cfg, rngs=nnx.Rngs(0))
        >>> path = torch_bridge.save_hf(model, os.path.join(tempfile.mkdtemp(), "m"))
        >>> converted = torch_bridge.read_checkpoint(path)
        >>> converted.model().config == converted.config, sorted(converted.params)[:2]
        (True, ['blocks', 'embed'])
        >>> converted.hf_fields
        {'bos_token_id': None, 'eos_token_id': None, 'pad_token_id': None}
    """

    arch: Architecture
    config: TransformerConfig
    params: dict
    report: ConversionReport
    hf_fields: dict = dataclasses.field(default_factory=dict)

    def model(self) -> "Transformer | Block":
        """The jaxckpt model holding these parameters (zero-copy on CPU)."""
        return build_model(self.arch, self.config, self.params)


def build_model(arch: Architecture, config: TransformerConfig, params: dict) -> "Transformer | Block":
    """An ``nn.Transformer`` (or the seed's ``nn.Block``) holding ``params``, without a
    random initialisation; the aligned numpy buffers move into JAX without a copy."""
    return from_params(model_class(arch), config, params)


def read_checkpoint(
    path: "str | os.PathLike",
    *,
    config: "Mapping | str | os.PathLike | TransformerConfig | None" = None,
    arch: str | None = None,
    dtype: str | None = None,
    allow_missing: bool = False,
    on_tensor: Callable[[str, int], None] | None = None,
    strict: bool = False,
    verify: bool = False,
) -> Converted:
    """Reads a checkpoint, one tensor at a time, into jaxckpt parameters.

    Args:
        path: a Hugging Face directory (``config.json`` + safetensors or ``.bin``, single
            or sharded), or one ``.safetensors``/``.pt``/``.bin`` state_dict file.
        config: needed for a single file: a Hugging Face config (dict or path) or a
            ``TransformerConfig``; for a directory it replaces ``config.json``.
        arch: ``"llama"``, ``"gpt2"`` or ``"seed-block"``; default: from the config.
        dtype: ``"fp32"``/``"bf16"``/``"fp16"``: every parameter is cast to it. Default:
            each tensor keeps its own dtype when it is fp32, bf16 or fp16 (a checkpoint
            with fp32 norms and bf16 matrices stays so), any other (float64, integers,
            float8) is cast to ``config.param_dtype``; for a Hugging Face config that is
            the checkpoint's native dtype (its largest tensor's), and the compute dtype
            too. Every cast is listed in the report's ``dtype_changes``.
        allow_missing: keep missing parameters at zero instead of raising.
        on_tensor: progress callback ``(key, nbytes)``.
        strict: refuse config fields jaxckpt does not know (default: list them in the
            report's ``unknown_fields``, warn once, and go on).
        verify: run transformers' model from the same directory and the converted one on
            a short fixed input, and fail unless the logits agree within the dtype's
            tolerance (``torch_bridge._verify.TOLERANCES``); the largest difference goes in
            the report (``verified_max_abs_diff``). Needs torch and transformers, and holds
            both models in memory at once.

    Raises:
        ValueError / FileNotFoundError: naming the file, field or tensor at fault.

    Example:
        >>> import os, tempfile
        >>> from flax import nnx
        >>> from jaxckpt import nn
        >>> import torch_bridge
        >>> cfg = nn.TransformerConfig.preset("tiny", n_layers=1, d_model=16, n_heads=2, ffn_dim=24)
        >>> model = nn.Transformer(cfg, rngs=nnx.Rngs(0))
        >>> path = torch_bridge.save_hf(model, os.path.join(tempfile.mkdtemp(), "m"))
        >>> converted = torch_bridge.read_checkpoint(path)
        >>> converted.arch.name, converted.config.d_model, converted.report.problems()
        ('llama', 16, [])
    """
    if verify and config is not None:
        raise ValueError(
            f"{path}: verify=True compares with transformers' reading of the directory's own config.json; "
            "it cannot check a checkpoint read with config="
        )
    with open_tensors(path) as source:
        chosen, config, found, hf_fields = _resolve_config(path, source, config, arch, dtype, strict)
        _check_layer_count(path, source, config)
        options = dict(allow_missing=allow_missing, keep_dtypes=dtype is None, on_tensor=on_tensor)
        params, report = convert_state_dict(source, chosen, config, **options)
    report.notes.extend(found.notes)
    report.unknown_fields.extend(found.unknown)
    converted = Converted(chosen, config, params, report, hf_fields)
    if verify:
        if chosen.block:
            raise ValueError(f"{path}: verify=True checks Hugging Face models; the seed block has none")
        report.verified_max_abs_diff, report.verify_tolerance = run_verify(path, converted.model(), config)
    return converted


def _check_layer_count(path, source, config: TransformerConfig) -> None:
    """Every layer has tensors of its own: a config with more layers than the checkpoint has
    tensors is not its config (and listing the missing tensors of millions of layers would
    take minutes and gigabytes)."""
    if config.n_layers > len(source):
        raise ValueError(
            f"{path}: the config has {config.n_layers} layers ({hf_name('n_layers', config.family)}), "
            f"but the weights hold {len(source)} tensors in all; is it this checkpoint's config?"
        )


def native_dtype(source) -> str:
    """The dtype name of a checkpoint: its largest tensor's (``"float32"`` when unknown)."""
    largest = max(source.keys(), key=lambda k: int(np.prod(source.shape(k))), default=None)
    return DTYPES.get(str(source.dtype(largest)), "float32") if largest is not None else "float32"


def _resolve_config(
    path, source, config, arch, dtype, strict
) -> tuple[Architecture, TransformerConfig, Translation, dict]:
    """The architecture and jaxckpt config of a checkpoint, its translation's findings and
    the Hugging Face config's kept fields (``kept_fields``).

    The dtype is ``dtype`` when given; else a ``TransformerConfig``'s own, or the
    checkpoint's native dtype for a Hugging Face config."""
    if config is None:
        config = find_config(path)
        if config is None:
            raise ValueError(
                f"{path}: a single state_dict file needs an explicit config= "
                "(a Hugging Face config.json or a TransformerConfig)"
            )
    if isinstance(config, TransformerConfig):
        if dtype is not None:
            config = config.replace(dtype=_dtype_name(dtype), param_dtype=_dtype_name(dtype))
        return architecture(arch or config.family), config, Translation(config.family, {}), {}
    name = _dtype_name(dtype) if dtype is not None else native_dtype(source)
    hf, where = _hf_dict(config)
    found, config = _translate(hf, where, name, strict=strict)
    return architecture(arch or found.family), config, found, kept_fields(hf)


def load_hf(
    path: "str | os.PathLike",
    *,
    dtype: str | None = None,
    strict: bool = False,
    verify: bool = False,
    **options,
) -> Transformer:
    """A jaxckpt ``nn.Transformer`` from a Hugging Face checkpoint of any supported family.

    The model holds what changes the numbers; the ``config.json``'s names and token ids
    (``bos_token_id``...) are in ``read_checkpoint(path).hf_fields``, for ``save_hf``.

    Args:
        path: the model directory (``config.json`` + ``model.safetensors``, sharded
            safetensors with their index, ``pytorch_model.bin`` or sharded ``.bin``), or a
            single state_dict file together with ``config=``.
        dtype: ``"fp32"``, ``"bf16"`` or ``"fp16"``; default: each tensor's own (see
            ``read_checkpoint``).
        strict: refuse config fields jaxckpt does not know (default: warn once and go on).
        verify: check the logits against transformers' (see ``read_checkpoint``).
        **options: ``config``, ``arch``, ``allow_missing``, ``on_tensor`` of
            ``read_checkpoint``.

    Example:
        >>> import tempfile, torch, transformers
        >>> d = tempfile.mkdtemp()
        >>> cfg = transformers.LlamaConfig(vocab_size=11, hidden_size=6, intermediate_size=10,
        ...     num_hidden_layers=1, num_attention_heads=3, num_key_value_heads=1)
        >>> transformers.LlamaForCausalLM(cfg).save_pretrained(d)
        >>> model = load_hf(d)
        >>> model.config.n_kv_heads, model.config.d_model
        (1, 6)
    """
    converted = read_checkpoint(path, dtype=dtype, strict=strict, verify=verify, **options)
    if converted.arch.block:
        raise ValueError(f"{path}: the seed block is one layer, not a model; use load_seed_block")
    return converted.model()


def load_seed_block(
    path: "str | os.PathLike", *, num_heads: int, dtype: str | None = None, allow_missing: bool = False
) -> Block:
    """The seed article's ``FlashAttentionWithCheckpoint`` block as a jaxckpt ``nn.Block``.

    ``hidden_dim`` is read from ``q_proj.weight``; ``num_heads`` cannot be, so give it.

    Example:
        >>> import os, tempfile, torch
        >>> sd = {f"{n}.{k}": torch.zeros(6, 6) if k == "weight" else torch.zeros(6)
        ...       for n in ("q_proj", "k_proj", "v_proj", "out_proj") for k in ("weight", "bias")}
        >>> sd |= {f"ln{i}.{k}": torch.ones(6) for i in (1, 2) for k in ("weight", "bias")}
        >>> sd |= {"ffn.0.weight": torch.zeros(24, 6), "ffn.0.bias": torch.zeros(24),
        ...        "ffn.2.weight": torch.zeros(6, 24), "ffn.2.bias": torch.zeros(6)}
        >>> path = os.path.join(tempfile.mkdtemp(), "block.pt")
        >>> torch.save(sd, path)
        >>> load_seed_block(path, num_heads=3).attn.heads
        (3, 3, 2)
    """
    config = seed_config_of(path, num_heads, dtype)
    return read_checkpoint(path, config=config, arch="seed-block", allow_missing=allow_missing).model()


def seed_config_of(path: "str | os.PathLike", num_heads: int, dtype: str | None = None) -> TransformerConfig:
    """The config of the seed-block state_dict at ``path``: ``hidden_dim`` from
    ``q_proj.weight``, the dtype from ``dtype`` or the file."""
    if not isinstance(num_heads, int) or num_heads <= 0:
        raise ValueError(f"num_heads={num_heads!r} must be a positive int (the seed block's head count)")
    with open_tensors(path) as source:
        if "q_proj.weight" not in source:
            raise ValueError(f"{path}: no 'q_proj.weight'; this is not a seed-block state_dict")
        hidden_dim = source.shape("q_proj.weight")[1]
        name = _dtype_name(dtype) if dtype is not None else native_dtype(source)
    if hidden_dim % num_heads:
        raise ValueError(f"num_heads={num_heads} does not divide the block's hidden_dim={hidden_dim}")
    return seed_block_config(hidden_dim, num_heads, dtype=name, param_dtype=name)


def save_seed_block(block: Block, path: "str | os.PathLike", *, force: bool = False) -> Path:
    """Writes an ``nn.Block`` as the seed block's torch ``.pt`` state_dict.

    Raises:
        FileExistsError: when ``path`` exists and ``force`` is False.

    Example:
        >>> import os, tempfile, torch
        >>> from flax import nnx
        >>> from jaxckpt import nn
        >>> block = nn.Block(seed_block_config(6, 2), rngs=nnx.Rngs(0))
        >>> path = save_seed_block(block, os.path.join(tempfile.mkdtemp(), "block.pt"))
        >>> torch.load(path, weights_only=True)["q_proj.weight"].shape
        torch.Size([6, 6])
    """
    path = Path(path)
    if path.exists() and not force:
        raise FileExistsError(f"{path} exists; pass force=True to replace it")
    tensors = export_state_dict(nnx.state(block, nnx.Param), "seed-block", _block_config(block))
    return write_torch_file(path, tensors)


def _block_config(block: Block) -> TransformerConfig:
    n, _, h = block.attn.heads
    return seed_block_config(n * h, n)
