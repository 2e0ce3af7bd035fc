"""torch_bridge: PyTorch / Hugging Face checkpoints in and out of jaxckpt, and torch
functions callable (and differentiable) from jitted JAX code.

torch is imported lazily, on first use, with an install hint when it is missing;
``jaxckpt`` itself never imports torch or this package.

Example:
    >>> import tempfile, os
    >>> from flax import nnx
    >>> from jaxckpt import nn
    >>> import torch_bridge
    >>> cfg = nn.TransformerConfig.preset("tiny", n_layers=1, d_model=16, n_heads=2, ffn_dim=24)
    >>> model = nn.Transformer(cfg, rngs=nnx.Rngs(0))
    >>> path = torch_bridge.save_hf(model, os.path.join(tempfile.mkdtemp(), "m"))
    >>> torch_bridge.load_hf(path).config.d_model
    16
"""

from torch_bridge._archs import ARCHITECTURES, Architecture, architecture, architecture_of, seed_block_config
from torch_bridge._atomic import OutputWriteError
from torch_bridge._convert import (
    ConversionReport,
    convert_state_dict,
    export_order,
    export_state_dict,
    target_shapes,
)
from torch_bridge._models import (
    Converted,
    config_from_hf,
    load_hf,
    load_seed_block,
    read_checkpoint,
    save_hf,
    save_seed_block,
    write_hf,
)
from torch_bridge._sources import TensorSource, open_tensors
from torch_bridge._table import Rule, Table
from torch_bridge._writers import parse_shard_size, write_safetensors
from torch_bridge.interop import call_torch, to_jax, to_torch
from torch_bridge.peft import (
    delta_rounding,
    load_peft_adapter,
    merge_lora,
    peft_lora_config,
    read_peft_adapter,
    save_peft_adapter,
    write_peft_adapter,
)

__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "ConversionReport",
    "Converted",
    "OutputWriteError",
    "Rule",
    "Table",
    "TensorSource",
    "architecture",
    "architecture_of",
    "call_torch",
    "config_from_hf",
    "convert_state_dict",
    "delta_rounding",
    "export_order",
    "export_state_dict",
    "load_hf",
    "load_peft_adapter",
    "load_seed_block",
    "merge_lora",
    "open_tensors",
    "parse_shard_size",
    "peft_lora_config",
    "read_checkpoint",
    "read_peft_adapter",
    "save_hf",
    "save_peft_adapter",
    "save_seed_block",
    "seed_block_config",
    "target_shapes",
    "to_jax",
    "to_torch",
    "write_hf",
    "write_peft_adapter",
    "write_safetensors",
]
