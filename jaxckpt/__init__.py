"""jaxckpt: memory-efficient transformer training in JAX.

Blockwise (FlashAttention-2) attention with a custom VJP, remat policies over
named activations, Flax NNX models, an optax training loop and memory
measurement of the compiled train step (the budget solver is on its way).
"""

from jaxckpt import attention, nn, plan, remat, train
from jaxckpt.attention import BlockSizes, attention_reference, flash_attention

__version__ = "0.1.0"

__all__ = [
    "BlockSizes",
    "attention",
    "attention_reference",
    "flash_attention",
    "nn",
    "plan",
    "remat",
    "train",
]
