"""Attention kernels: pure array functions.

``flash_attention`` (blockwise FlashAttention-2 with a custom VJP, and the same
algorithm as a Pallas kernel: Triton on a GPU; JAX's Splash kernel on a TPU),
``attention_reference`` (naive fp32 ground truth), the mask predicate, dropout,
and the implementation registry that backends such as ``npu_backend`` plug into;
``context_parallel_attention`` runs the blockwise kernel over a sequence sharded along a
mesh axis (all-gather or ring), with the load-balanced ``zigzag_order``;
``collective_bytes`` reads a compiled program's communication from its HLO.
"""

from jaxckpt.attention._api import MANUAL_PARTITIONING, flash_attention, resolve_implementation
from jaxckpt.attention._autotune import autotune_pallas_blocks
from jaxckpt.attention._block_sizes import BlockSizes
from jaxckpt.attention._collectives import COLLECTIVES, CollectiveBytes, collective_bytes
from jaxckpt.attention._context_parallel import (
    CONTEXT_PARALLEL_STRATEGIES,
    check_strategy,
    context_parallel_attention,
    from_zigzag,
    to_zigzag,
    zigzag_order,
)
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
from jaxckpt.attention._splash import splash_block
from jaxckpt.attention._validate import AttentionInputs, normalize
from jaxckpt.attention.pallas import MAX_HEAD_DIM as PALLAS_MAX_HEAD_DIM
from jaxckpt.attention.pallas import (
    PallasBlocks,
    default_pallas_blocks,
    pallas_blocks,
    set_pallas_blocks,
)

__all__ = [
    "COLLECTIVES",
    "CONTEXT_PARALLEL_STRATEGIES",
    "FEATURES",
    "MANUAL_PARTITIONING",
    "PALLAS_MAX_HEAD_DIM",
    "PLATFORMS",
    "AttentionInputs",
    "BlockSizes",
    "CollectiveBytes",
    "Implementation",
    "PallasBlocks",
    "attention_reference",
    "autotune_pallas_blocks",
    "available_implementations",
    "check_strategy",
    "collective_bytes",
    "compiling_for",
    "context_parallel_attention",
    "default_pallas_blocks",
    "dropout_mask",
    "features_used",
    "flash_attention",
    "from_zigzag",
    "full_mask",
    "implementations",
    "normalize",
    "pallas_blocks",
    "platform",
    "register_implementation",
    "resolve_implementation",
    "set_pallas_blocks",
    "splash_block",
    "to_zigzag",
    "zigzag_order",
]
