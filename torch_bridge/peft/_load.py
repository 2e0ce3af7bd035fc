"""PEFT LoRA adapter directories (written by peft, or by ``write_peft_adapter``) read back
into a jaxckpt LoRA model, to continue training or to run it.

``peft_lora_config`` gives the ``nn.LoraConfig`` a directory holds (for the model to build);
``read_peft_adapter`` its adapters as the pure dict of the model's ``nnx.LoRAParam`` state,
checked against the model's config; ``load_peft_adapter`` puts them into a model.
"""

import json
import os
import re
from pathlib import Path

import numpy as np
from flax import nnx

from jaxckpt.nn import LORA_TARGETS, LoraConfig, Transformer, TransformerConfig
from torch_bridge._archs import Architecture, architecture
from torch_bridge._convert import common_dtype, flatten, listing, target_shapes, unflatten
from torch_bridge._sources import open_tensors
from torch_bridge._table import LAYER
from torch_bridge.peft._adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PREFIX, adapter_modules, fused_modules
from torch_bridge.peft._merge import LORA

WEIGHT_FILES = (ADAPTER_WEIGHTS, "adapter_model.bin")
"""The adapter's weight file, in the order looked for (peft's ``safe_serialization=False``
writes the .bin)."""

REFUSED = {
    "use_dora": "DoRA (a learned magnitude per output) is not a plain LoRA",
    "use_rslora": "rank-stabilised LoRA scales by lora_alpha / sqrt(r); jaxckpt scales by alpha / r",
    "rank_pattern": "per-module ranks; jaxckpt has one rank",
    "alpha_pattern": "per-module alphas; jaxckpt has one alpha",
    "layers_to_transform": "adapters on some layers only; jaxckpt adapts every layer",
    "layer_replication": "replicated layers",
    "modules_to_save": "whole modules trained beside the adapters",
    "lora_bias": "a trained bias on lora_B",
    "target_parameters": "adapters on parameters, not modules",
    "trainable_token_indices": "trained token embeddings",
    "use_qalora": "QA-LoRA's pooled inputs",
}
"""``adapter_config.json`` fields whose set value (not null, false or empty) jaxckpt cannot
hold, and why."""

DTYPE_NAMES = ("float32", "bfloat16", "float16")


def read_peft_config(path: "str | os.PathLike") -> dict:
    """``adapter_config.json`` of the PEFT directory ``path``, checked to hold a plain LoRA.

    Raises:
        FileNotFoundError: when the directory or its ``adapter_config.json`` is missing.
        ValueError: for invalid JSON, a ``peft_type`` other than ``"LORA"``, a ``bias``
            other than ``"none"``, or a field of ``REFUSED`` that is set (named, with why).

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp())
        >>> _ = (d / ADAPTER_CONFIG).write_text('{"peft_type": "LORA", "r": 4, "use_dora": true}')
        >>> read_peft_config(d)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: ...adapter_config.json: use_dora=True is not supported (DoRA (a learned magnitude...
    """
    file = Path(path) / ADAPTER_CONFIG
    if not file.is_file():
        raise FileNotFoundError(f"{file} does not exist: {path} is not a PEFT adapter directory")
    try:
        fields = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{file}: not valid JSON ({err})") from err
    if fields.get("peft_type") != "LORA":
        raise ValueError(
            f'{file}: peft_type={fields.get("peft_type")!r}; jaxckpt reads LoRA adapters ("LORA")'
        )
    if fields.get("bias", "none") != "none":
        raise ValueError(f'{file}: bias={fields["bias"]!r} trains biases too; jaxckpt reads bias="none"')
    for field, why in REFUSED.items():
        if fields.get(field) not in (None, False, {}, [], ""):
            raise ValueError(f"{file}: {field}={fields[field]!r} is not supported ({why})")
    for field in ("r", "lora_alpha"):
        if not isinstance(fields.get(field), int | float) or fields[field] <= 0:
            raise ValueError(f"{file}: {field}={fields.get(field)!r} must be a positive number")
    return fields


def _weights(path: Path) -> Path:
    found = next((path / name for name in WEIGHT_FILES if (path / name).is_file()), None)
    if found is None:
        raise FileNotFoundError(f"{path} holds no adapter weights (none of {', '.join(WEIGHT_FILES)})")
    return found


def _layout(path: Path, arch: Architecture, shapes: dict, n_layers: int) -> tuple[dict, dict]:
    """``(modules, keys)``: the ``AdapterModule`` of each target the directory holds, and each
    tensor's name -> ``(shape, dtype)``.

    Raises:
        ValueError: for tensors of no adapted module jaxckpt has (a fused one named), or of
            layers the model lacks.
    """
    with open_tensors(_weights(path)) as source:
        keys = {key: (tuple(source.shape(key)), np.dtype(source.dtype(key))) for key in source.keys()}  # noqa: SIM118
    fused = {part for parts in fused_modules(arch).values() for part in parts}
    plain = [t for t in LORA_TARGETS if t not in fused]
    known = adapter_modules(arch, plain, shapes)
    modules = {t: m for t, m in known.items() if m.key(0, "A") in keys}
    expected = {m.key(i, x) for m in modules.values() for i in range(n_layers) for x in "AB"}
    unexpected = sorted(set(keys) - expected)
    if unexpected:
        raise ValueError(
            f"{path}: {len(unexpected)} tensor(s) no {n_layers}-layer jaxckpt {arch.name} adapter holds: "
            f"{listing(unexpected)}{_fused_hint(unexpected, arch)}"
        )
    missing = sorted(expected - set(keys))
    if missing:
        raise ValueError(f"{path}: {len(missing)} adapter tensor(s) missing: {listing(missing)}")
    return modules, keys


def _fused_hint(keys: list[str], arch: Architecture) -> str:
    """Why ``keys`` of a fused Hugging Face module cannot load, or nothing."""
    found = []
    for module, parts in fused_modules(arch).items():
        pattern = re.escape(PREFIX + module).replace(re.escape(LAYER), r"\d+") + r"\.lora_[AB]\.weight"
        if any(re.fullmatch(pattern, key) for key in keys):
            found.append(f"{module.rsplit('.', 1)[-1]} holds {', '.join(parts)} in one module")
    if not found:
        return ""
    return f" ({'; '.join(found)}: jaxckpt adapts them apart, so a PEFT adapter on it does not map)"


def peft_lora_config(path: "str | os.PathLike", config: TransformerConfig) -> LoraConfig:
    """The ``nn.LoraConfig`` of the PEFT adapter directory ``path`` for a base of ``config``'s
    family: its ``r``, ``lora_alpha``, ``lora_dropout``, the targets its tensors adapt, and
    their dtype (storage dtype of the adapters).

    Use it to build the model an adapter loads into:
    ``config.replace(lora=peft_lora_config(path, config))``.

    Raises:
        FileNotFoundError / ValueError: as ``read_peft_config``, and for tensors of modules
            jaxckpt cannot adapt (see ``read_peft_adapter``).

    Example:
        >>> import tempfile
        >>> from jaxckpt import nn
        >>> from torch_bridge import save_peft_adapter
        >>> cfg = nn.TransformerConfig.preset("tiny", n_layers=1, d_model=16, n_heads=2, ffn_dim=24)
        >>> lora = nn.LoraConfig(rank=3, alpha=6, targets="q,down", dtype="bfloat16")
        >>> model = nn.Transformer(cfg.replace(lora=lora), rngs=nnx.Rngs(0))
        >>> out = save_peft_adapter(model, os.path.join(tempfile.mkdtemp(), "a"))
        >>> peft_lora_config(out, cfg) == lora
        True
    """
    path = Path(path)
    fields = read_peft_config(path)
    arch = architecture(config.family)
    base = config.replace(lora=None, quantize_base=None)
    modules, keys = _layout(path, arch, target_shapes(arch, base), config.n_layers)
    if not modules:
        raise ValueError(f"{path}: holds no adapter of a {arch.name} projection")
    dtype = str(common_dtype(dtype for _, dtype in keys.values()))
    return LoraConfig(
        rank=int(fields["r"]),
        alpha=float(fields["lora_alpha"]),
        targets=tuple(t for t in LORA_TARGETS if t in modules),
        dropout=float(fields.get("lora_dropout") or 0.0),
        dtype=dtype if dtype in DTYPE_NAMES else "float32",
    )


def _mismatches(found: LoraConfig, lora: LoraConfig) -> list[str]:
    """What differs between the adapter's config and the model's, named both ways."""
    checks = (("r", "rank", found.rank, lora.rank), ("lora_alpha", "alpha", found.alpha, lora.alpha))
    checks += (("target modules", "targets", found.targets, lora.targets),)
    return [
        f"{theirs}: {a!r} in the adapter, {b!r} in config.lora.{ours}"
        for theirs, ours, a, b in checks
        if a != b
    ]


def read_peft_adapter(path: "str | os.PathLike", config: TransformerConfig) -> dict:
    """The adapters of the PEFT directory ``path`` as the pure dict of the ``nnx.LoRAParam``
    state of the model ``config`` describes (``{"blocks": {"attn": {"q_proj": {"lora":
    {"lora_a": [L, d_in, r], "lora_b": [L, r, d_out]}}}}}``), in the dtype they were saved in.

    Args:
        path: a directory holding ``adapter_config.json`` and ``adapter_model.safetensors``
            (or ``adapter_model.bin``), as peft's ``save_pretrained`` writes them.
        config: the model's config, with ``lora`` set to the adapter's rank, alpha and targets
            (``peft_lora_config`` gives them).

    Raises:
        ValueError: naming each of r, lora_alpha and the target modules that differ between
            the adapter and ``config.lora``; tensors of modules jaxckpt does not adapt (a fused
            one, e.g. GPT-2's ``c_attn``, named) or of layers the model lacks; missing tensors;
            shapes that differ (both named); and the fields of ``read_peft_config``.

    Example:
        >>> import tempfile
        >>> from jaxckpt import nn
        >>> from torch_bridge import save_peft_adapter
        >>> cfg = nn.TransformerConfig.preset("tiny", n_layers=1, d_model=16, n_heads=2, ffn_dim=24, lora=3)
        >>> model = nn.Transformer(cfg, rngs=nnx.Rngs(0))
        >>> out = save_peft_adapter(model, os.path.join(tempfile.mkdtemp(), "a"))
        >>> read_peft_adapter(out, cfg)["blocks"]["attn"]["q_proj"]["lora"]["lora_a"].shape
        (1, 16, 3)
        >>> read_peft_adapter(out, cfg.replace(lora=nn.LoraConfig(rank=5, alpha=3, targets="q")))
        ... # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: ...: the adapter does not fit the model: r: 3 in the adapter, 5 in config.lora.rank; ...
    """
    path = Path(path)
    if config.lora is None:
        raise ValueError(
            f"{path}: config.lora is None; build the model with lora=peft_lora_config(path, config)"
        )
    found = peft_lora_config(path, config)
    problems = _mismatches(found, config.lora)
    if problems:
        raise ValueError(
            f"{path}: the adapter does not fit the model: {'; '.join(problems)}; "
            "build the model with lora=peft_lora_config(path, config)"
        )
    arch = architecture(config.family)
    shapes = target_shapes(arch, config)
    modules = adapter_modules(arch, config.lora.targets, shapes)
    out = {}
    with open_tensors(_weights(path)) as source:
        for module in modules.values():
            for matrix, name in (("A", "lora_a"), ("B", "lora_b")):
                target = f"{module.path}.{LORA}.{name}"
                layers = [source[module.key(i, matrix)] for i in range(config.n_layers)]
                wrong = [(module.key(i, matrix), a.shape) for i, a in enumerate(layers)]
                wrong = [(k, s) for k, s in wrong if s[::-1] != shapes[target].shape[1:]]
                if wrong:
                    expected = shapes[target].shape[1:][::-1]
                    raise ValueError(
                        f"{path}: {wrong[0][0]} has shape {wrong[0][1]}, the model needs {expected}"
                    )
                out[target] = np.stack([a.T for a in layers])
    return unflatten(out)


def load_peft_adapter(model: Transformer, path: "str | os.PathLike") -> Transformer:
    """Puts the adapters of the PEFT directory ``path`` into ``model`` (in place, and returns
    it), cast to the model's adapter dtype (``config.lora.dtype``).

    Raises:
        ValueError: as ``read_peft_adapter`` (mismatched r, alpha or targets are named).

    Example:
        >>> import tempfile
        >>> from jaxckpt import nn
        >>> from torch_bridge import save_peft_adapter
        >>> cfg = nn.TransformerConfig.preset("tiny", n_layers=1, d_model=16, n_heads=2, ffn_dim=24, lora=3)
        >>> model = nn.Transformer(cfg, rngs=nnx.Rngs(0))
        >>> out = save_peft_adapter(model, os.path.join(tempfile.mkdtemp(), "a"))
        >>> other = load_peft_adapter(nn.Transformer(cfg, rngs=nnx.Rngs(1)), out)  # another init
        >>> a, b = (m.blocks.attn.q_proj.lora.lora_a[...] for m in (model, other))
        >>> bool((a == b).all())
        True
    """
    adapters = flatten(read_peft_adapter(path, model.config))
    state = nnx.state(model, nnx.LoRAParam)
    current = flatten(nnx.to_pure_dict(state))
    cast = {p: np.asarray(a).astype(current[p].dtype) for p, a in adapters.items()}
    nnx.replace_by_pure_dict(state, unflatten(cast))
    nnx.update(model, state)
    return model
