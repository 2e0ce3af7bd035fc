"""LoRA adapters in the PEFT format: ``adapter_model.safetensors`` + ``adapter_config.json``.

``peft.PeftModel.from_pretrained(transformers_base, directory)`` reads what
``write_peft_adapter`` / ``save_peft_adapter`` write, and computes what the jaxckpt LoRA
model computes. The layout is peft's own (``peft.get_peft_model_state_dict``): for each
layer ``i`` and adapted module, ``base_model.model.<module>.lora_A.weight`` ``[r, d_in]``
(our ``lora_a [d_in, r]`` transposed) and ``...lora_B.weight`` ``[d_out, r]`` (``lora_b``
transposed), with ``<module>`` the Hugging Face module (``model.layers.3.self_attn.q_proj``).
peft's scale is ``lora_alpha / r``, as ours. Each adapter keeps the dtype it trained in.

The module of each target comes from the family's conversion table (``_archs``): the rule
that holds the target's kernel alone. A kernel that Hugging Face stores fused with others
(GPT-2's ``c_attn`` holds q, k and v; Phi-3's ``qkv_proj`` and ``gate_up_proj``) has no
module of its own, so an adapter on it is refused, naming the fused module.
``_load`` reads these directories back.
"""

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from flax import nnx

from jaxckpt.nn import LORA_TARGETS, Transformer, TransformerConfig
from torch_bridge._archs import Architecture, architecture
from torch_bridge._atomic import atomic_output, writing
from torch_bridge._convert import flatten, target_shapes
from torch_bridge._table import LAYER
from torch_bridge._writers import _write_shard
from torch_bridge.peft._merge import LORA

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PREFIX = "base_model.model."
"""peft's prefix of every tensor name: its ``PeftModel`` wraps the ``transformers`` model."""

MODULES = {"q": "blocks.attn.q_proj", "k": "blocks.attn.k_proj", "v": "blocks.attn.v_proj"}
MODULES |= {"o": "blocks.attn.out_proj", "gate": "blocks.mlp.gate", "up": "blocks.mlp.up"}
MODULES |= {"down": "blocks.mlp.down"}
"""Each LoRA target (``nn.LORA_TARGETS``) -> the jaxckpt projection it adapts."""


@dataclasses.dataclass(frozen=True)
class AdapterModule:
    """Where one target's adapters live, in jaxckpt and in a PEFT directory.

    Attributes:
        target: the ``nn.LORA_TARGETS`` name (``"q"``).
        path: the jaxckpt projection (``"blocks.attn.q_proj"``); its adapter is
            ``path + ".lora"``, stacked over the layers.
        hf: the Hugging Face module, ``{i}`` for the layer (``"model.layers.{i}.self_attn.q_proj"``).
        name: its ``target_modules`` entry: the module's own name (``"q_proj"``, as
            ``nn.HF_MODULES``), or its path inside the layer where that name is not unique
            (GPT-2's ``attn.c_proj`` and ``mlp.c_proj``).
        conv1d: the base weight is stored ``[d_in, d_out]`` (GPT-2's ``Conv1D``: peft's
            ``fan_in_fan_out``).
    """

    target: str
    path: str
    hf: str
    name: str
    conv1d: bool = False

    def key(self, layer: int, matrix: str) -> str:
        """The PEFT tensor name of layer ``layer``'s ``matrix`` (``"A"`` or ``"B"``)."""
        return f"{PREFIX}{self.hf.replace(LAYER, str(layer))}.lora_{matrix}.weight"


def _layer_modules(arch: Architecture) -> list[str]:
    """The Hugging Face modules of one layer (``{i}`` templates) that the table's weights name."""
    found = [rule.torch.rsplit(".", 1)[0] for rule in arch.table.rules if rule.per_layer]
    return list(dict.fromkeys(found))


def _name(module: str, modules: list[str]) -> str:
    """``module``'s ``target_modules`` entry: its last name, unless another module of the layer
    ends the same (then its path inside the layer)."""
    last = module.rsplit(".", 1)[-1]
    if sum(m.rsplit(".", 1)[-1] == last for m in modules) == 1:
        return last
    return module.split(LAYER + ".", 1)[-1]


def fused_modules(arch: Architecture) -> dict[str, tuple[str, ...]]:
    """Hugging Face module template -> the targets it holds fused (no PEFT module of their own).

    Example:
        >>> fused_modules(architecture("gpt2"))
        {'transformer.h.{i}.attn.c_attn': ('q', 'k', 'v')}
    """
    targets = {f"{path}.kernel": target for target, path in MODULES.items()}
    out = {}
    for rule in arch.table.rules:
        parts = tuple(targets[p] for p in rule.jax if p in targets)
        if rule.per_layer and len(rule.jax) > 1 and parts:
            out[rule.torch.rsplit(".", 1)[0]] = parts
    return out


def adapter_modules(arch: Architecture, targets=LORA_TARGETS, shapes: Mapping | None = None) -> dict:
    """Target -> ``AdapterModule`` of each of ``targets`` that ``arch`` can hold as a PEFT module.

    Args:
        arch: the family.
        targets: the targets wanted.
        shapes: ``target_shapes`` of the model, when given: a target whose projection the
            model lacks (GPT-2 has no ``gate``: neither its kernel nor an adapter) is left out.

    Raises:
        ValueError: for a target that Hugging Face stores fused with others (names the module).

    Example:
        >>> modules = adapter_modules(architecture("llama"), ("q", "down"))
        >>> modules["q"].key(2, "A"), modules["down"].name
        ('base_model.model.model.layers.2.self_attn.q_proj.lora_A.weight', 'down_proj')
        >>> adapter_modules(architecture("gpt2"), ("o",))["o"].name
        'attn.c_proj'
    """
    layer = _layer_modules(arch)
    fused = {part: module for module, parts in fused_modules(arch).items() for part in parts}
    present = [t for t in LORA_TARGETS if shapes is None or _has(shapes, t)]
    out = {}
    for target in (t for t in targets if t in present):
        kernel = f"{MODULES[target]}.kernel"
        if target in fused:
            plain = ",".join(t for t in present if t not in fused)
            raise ValueError(
                f"the {target!r} adapter cannot be written for {arch.name}: Hugging Face stores its "
                f"projection fused ({fused[target]} holds {', '.join(fused_parts(arch, target))}), and a "
                f"PEFT adapter is on a whole module; adapt only {plain} (--lora-targets)"
            )
        rule = next((r for r in arch.table.rules if r.jax == (kernel,)), None)
        if rule is None or not rule.per_layer:
            raise ValueError(
                f"{arch.name} has no Hugging Face weight for the {target!r} projection ({kernel})"
            )
        module = rule.torch.rsplit(".", 1)[0]
        out[target] = AdapterModule(target, MODULES[target], module, _name(module, layer), not rule.transpose)
    return out


def fused_parts(arch: Architecture, target: str) -> tuple[str, ...]:
    """The targets stored in the same fused Hugging Face module as ``target``."""
    return next(parts for parts in fused_modules(arch).values() if target in parts)


def _has(shapes: Mapping, target: str) -> bool:
    """Whether the model of ``shapes`` has ``target``'s projection (its kernel or its adapter)."""
    return f"{MODULES[target]}.kernel" in shapes or f"{MODULES[target]}.{LORA}.lora_a" in shapes


def _number(value: float) -> "int | float":
    """``value`` as peft writes it: an int when it is whole."""
    return int(value) if float(value).is_integer() else float(value)


def peft_config(config: TransformerConfig, modules: Mapping, base_model_name_or_path: str | None) -> dict:
    """The ``adapter_config.json`` fields peft writes for a LoRA of ``config.lora`` on ``modules``.

    Example:
        >>> from jaxckpt import nn
        >>> cfg = nn.TransformerConfig.preset("tiny", lora=nn.LoraConfig(rank=4, alpha=8, targets="q,v"))
        >>> fields = peft_config(cfg, adapter_modules(architecture("llama"), cfg.lora.targets), None)
        >>> fields["peft_type"], fields["r"], fields["lora_alpha"], fields["target_modules"]
        ('LORA', 4, 8, ['q_proj', 'v_proj'])
    """
    lora = config.lora
    return {
        "alpha_pattern": {},
        "auto_mapping": None,
        "base_model_name_or_path": base_model_name_or_path,
        "bias": "none",
        "exclude_modules": None,
        "fan_in_fan_out": any(m.conv1d for m in modules.values()),
        "inference_mode": True,
        "init_lora_weights": True,
        "layer_replication": None,
        "layers_pattern": None,
        "layers_to_transform": None,
        "lora_alpha": _number(lora.alpha),
        "lora_bias": False,
        "lora_dropout": lora.dropout,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": lora.rank,
        "rank_pattern": {},
        "revision": None,
        "target_modules": [m.name for m in modules.values()],
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": False,
    }


def _checked_arch(config: TransformerConfig) -> Architecture:
    """The Hugging Face family of a LoRA ``config``, or a ValueError saying why there is none."""
    arch = architecture(config.family)
    if arch.block or arch.hf_config is None:
        raise ValueError(f"family {arch.name!r} has no Hugging Face model for a PEFT adapter to go on")
    if config.lora is None:
        raise ValueError(
            "config.lora is None: the model has no LoRA adapters to write; train with --lora R "
            "(TransformerConfig.lora), or export the whole model (save_hf, jaxckpt convert --to torch)"
        )
    return arch


def adapter_tensors(params: "Mapping | nnx.State", config: TransformerConfig) -> tuple[dict, dict]:
    """``(modules, tensors)``: the ``AdapterModule`` of each target, and PEFT tensor name ->
    array (``[r, d_in]`` / ``[d_out, r]``, the adapter's own dtype), layer by layer.

    Raises:
        ValueError: as ``write_peft_adapter``.
    """
    arch = _checked_arch(config)
    modules = adapter_modules(arch, config.lora.targets, target_shapes(arch, config))
    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)
    flat = flatten(params)
    tensors = {}
    for layer in range(config.n_layers):
        for module in modules.values():
            for matrix, name in (("A", "lora_a"), ("B", "lora_b")):
                path = f"{module.path}.{LORA}.{name}"
                if path not in flat:
                    raise ValueError(
                        f"params hold no {path}, which config.lora (targets {module.target!r}) needs"
                    )
                tensors[module.key(layer, matrix)] = np.asarray(flat[path][layer]).T
    return modules, tensors


def write_peft_adapter(
    params: "Mapping | nnx.State",
    config: TransformerConfig,
    path: "str | os.PathLike",
    *,
    base_model_name_or_path: str | None = None,
    force: bool = False,
) -> Path:
    """Writes the LoRA adapters in ``params`` as a PEFT adapter directory.

    ``adapter_model.safetensors`` holds each adapter in its own dtype; ``adapter_config.json``
    holds ``r``, ``lora_alpha``, ``lora_dropout``, the Hugging Face ``target_modules``,
    ``peft_type: "LORA"``, ``task_type: "CAUSAL_LM"`` and peft's other fields. The
    directory is written under a temporary name and renamed when complete. The base is not
    written: peft puts the adapter on the base model it is given.

    Args:
        params: the model's ``nnx.Param`` state (or ``nnx.LoRAParam`` state), or its pure dict.
        config: the model's config (``config.lora`` set).
        path: the directory to write.
        base_model_name_or_path: the base model's name or directory, for ``adapter_config.json``
            (peft's ``AutoPeftModelForCausalLM`` loads it from there).
        force: replace ``path`` when it exists.

    Raises:
        FileExistsError: when ``path`` exists and ``force`` is False.
        OutputWriteError: a write failed (a full disk, say): one line naming ``path`` and the
            file; nothing partial is left (with ``force``, the old ``path`` is unchanged).
        ValueError: for a config without adapters (``config.lora`` None), a family with no
            Hugging Face model (the seed block), a target Hugging Face stores fused (GPT-2's
            ``c_attn``, Phi-3's ``qkv_proj``: named), or params lacking an adapter.

    Example:
        >>> import tempfile
        >>> from jaxckpt import nn
        >>> cfg = nn.TransformerConfig.preset("tiny", n_layers=1, d_model=16, n_heads=2, ffn_dim=24, lora=3)
        >>> params = nnx.state(nn.Transformer(cfg, rngs=nnx.Rngs(0)), nnx.LoRAParam)
        >>> out = write_peft_adapter(params, cfg, os.path.join(tempfile.mkdtemp(), "adapter"))
        >>> sorted(os.listdir(out)), json.loads((out / ADAPTER_CONFIG).read_text())["target_modules"]
        (['adapter_config.json', 'adapter_model.safetensors'], ['q_proj', 'k_proj', 'v_proj', 'o_proj'])
    """
    modules, tensors = adapter_tensors(params, config)
    fields = peft_config(config, modules, base_model_name_or_path)
    entries = [(key, array.shape, array.dtype) for key, array in tensors.items()]
    with atomic_output(path, force=force) as tmp:
        _write_shard(tmp / ADAPTER_WEIGHTS, entries, tensors.__getitem__, {"format": "pt"})
        with writing(ADAPTER_CONFIG):
            (tmp / ADAPTER_CONFIG).write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")
    return Path(path)


def save_peft_adapter(
    model: Transformer,
    path: "str | os.PathLike",
    *,
    base_model_name_or_path: str | None = None,
    force: bool = False,
) -> Path:
    """Writes ``model``'s LoRA adapters as a PEFT adapter directory (see ``write_peft_adapter``).

    Example:
        >>> import tempfile
        >>> from jaxckpt import nn
        >>> cfg = nn.TransformerConfig.preset("tiny", n_layers=1, d_model=16, n_heads=2, ffn_dim=24, lora=3)
        >>> model = nn.Transformer(cfg, rngs=nnx.Rngs(0))
        >>> out = save_peft_adapter(model, os.path.join(tempfile.mkdtemp(), "a"))
        >>> json.loads((out / ADAPTER_CONFIG).read_text())["r"]
        3
    """
    options = dict(base_model_name_or_path=base_model_name_or_path, force=force)
    return write_peft_adapter(nnx.state(model, nnx.LoRAParam), model.config, path, **options)
