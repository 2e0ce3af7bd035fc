"""PEFT LoRA adapters: write them, read them back, and merge LoRA deltas into weights.

Call path: ``save_peft_adapter`` / ``write_peft_adapter`` (``_adapter``) write a PEFT
adapter directory; ``load_peft_adapter`` / ``read_peft_adapter`` (``_load``) read one
back; ``merge_lora`` (``_merge``) folds the deltas into the base weights (``torch_bridge._save``
and the ``convert --merge-lora`` command).
"""

from torch_bridge.peft._adapter import adapter_tensors, save_peft_adapter, write_peft_adapter
from torch_bridge.peft._load import load_peft_adapter, peft_lora_config, read_peft_adapter
from torch_bridge.peft._merge import delta_rounding, lora_paths, merge_lora, sixteen_bit_rounding

__all__ = [
    "adapter_tensors",
    "delta_rounding",
    "load_peft_adapter",
    "lora_paths",
    "merge_lora",
    "peft_lora_config",
    "read_peft_adapter",
    "save_peft_adapter",
    "sixteen_bit_rounding",
    "write_peft_adapter",
]
