"""jaxckpt: memory-efficient transformer training in JAX.

Blockwise (FlashAttention-2) attention with a custom VJP, remat policies over
named activations, Flax NNX models and an optax training loop (and, in later
modules, a memory planner).
"""

from jaxckpt import attention, nn, remat, train
from jaxckpt.attention import BlockSizes, attention_reference, flash_attention

__version__ = "0.1.0"

__all__ = ["BlockSizes", "attention", "attention_reference", "flash_attention", "nn", "remat", "train"]
