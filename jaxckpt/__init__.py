"""jaxckpt: memory-efficient transformer training in JAX.

Blockwise (FlashAttention-2) attention with a custom VJP, remat policies over
named activations, and (in later modules) a memory planner, Flax NNX models and
a training loop.
"""

from jaxckpt import attention, remat
from jaxckpt.attention import BlockSizes, attention_reference, flash_attention

__version__ = "0.1.0"

__all__ = ["BlockSizes", "attention", "attention_reference", "flash_attention", "remat"]
