"""jaxckpt: memory-efficient transformer training in JAX.

Blockwise (FlashAttention-2) attention with a custom VJP (``attention``), remat
policies over named activations (``remat``), Flax NNX models (``nn``), an optax
training loop with data parallel + FSDP and orbax checkpoints (``train``), and a
memory planner that predicts a train step's peak, picks the cheapest remat spec that
fits a budget and verifies it against XLA's compiled memory analysis (``plan``).

Example:
    >>> import jax, jaxckpt
    >>> q = jax.random.normal(jax.random.key(0), (1, 7, 2, 8))  # [B, T, N, H]
    >>> out = jaxckpt.flash_attention(q, q, q, is_causal=True)
    >>> bool(jax.numpy.allclose(out, jaxckpt.attention_reference(q, q, q, is_causal=True), atol=1e-5))
    True
"""

from jaxckpt import attention, nn, plan, remat, train
from jaxckpt.attention import BlockSizes, attention_reference, flash_attention
from jaxckpt.generate import (
    generate,
)  # the function: jaxckpt.generate(...); the package's names import from it

# With the gpu-aot (tpu-aot) extra on a machine without an NVIDIA driver (TPU chips), JAX's
# CUDA (TPU) backend cannot start: leave it out before a backend starts (JAX would fall back
# anyway, after a traceback, or seconds of looking for chips), so that deviceless compiles
# work. A no-op where every installed plugin has its device.
plan.quiet_plugins_without_devices()

__version__ = "0.1.0"

__all__ = [
    "BlockSizes",
    "attention",
    "attention_reference",
    "flash_attention",
    "generate",
    "nn",
    "plan",
    "remat",
    "train",
]
