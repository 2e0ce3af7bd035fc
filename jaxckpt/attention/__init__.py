"""Attention kernels: pure array functions.

``flash_attention`` (blockwise FlashAttention-2 with a custom VJP, and the same
algorithm as a Pallas kernel: Triton on a GPU; JAX's Splash kernel on a TPU),
``attention_reference`` (naive fp32 ground truth), the mask predicate, dropout,
and the implementation registry that backends such as ``npu_backend`` plug into.
"""

from jaxckpt.attention._api import MANUAL_PARTITIONING, flash_attention, resolve_implementation
from jaxckpt.attention._autotune import autotune_pallas_blocks
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
from jaxckpt.attention.pallas import MAX_HEAD_DIM as PALLAS_MAX_HEAD_DIM
from jaxckpt.attention.pallas import (
    PallasBlocks,
    default_pallas_blocks,
    pallas_blocks,
    set_pallas_blocks,
)

__all__ = [
    "FEATURES",
    "MANUAL_PARTITIONING",
    "PALLAS_MAX_HEAD_DIM",
    "PLATFORMS",
    "AttentionInputs",
    "BlockSizes",
    "Implementation",
    "PallasBlocks",
    "attention_reference",
    "autotune_pallas_blocks",
    "available_implementations",
    "compiling_for",
    "default_pallas_blocks",
    "dropout_mask",
    "features_used",
    "flash_attention",
    "full_mask",
    "implementations",
    "normalize",
    "pallas_blocks",
    "platform",
    "register_implementation",
    "resolve_implementation",
    "set_pallas_blocks",
]
