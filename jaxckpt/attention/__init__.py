"""Attention kernels: pure array functions.

``flash_attention`` (blockwise FlashAttention-2 with a custom VJP),
``attention_reference`` (naive fp32 ground truth), the mask predicate, dropout,
and the implementation registry that backends such as ``npu_backend`` plug into.
"""

from jaxckpt.attention._api import flash_attention
from jaxckpt.attention._block_sizes import BlockSizes
from jaxckpt.attention._dropout import dropout_mask
from jaxckpt.attention._platform import PLATFORMS, compiling_for, platform
from jaxckpt.attention._reference import attention_reference, full_mask
from jaxckpt.attention._registry import (
    FEATURES,
    Implementation,
    available_implementations,
    features_used,
    implementations,
    register_implementation,
)
from jaxckpt.attention._validate import AttentionInputs, normalize

__all__ = [
    "FEATURES",
    "PLATFORMS",
    "AttentionInputs",
    "BlockSizes",
    "Implementation",
    "attention_reference",
    "available_implementations",
    "compiling_for",
    "dropout_mask",
    "features_used",
    "flash_attention",
    "full_mask",
    "implementations",
    "normalize",
    "platform",
    "register_implementation",
]
