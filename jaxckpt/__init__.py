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

# With the gpu-aot extra on a machine without an NVIDIA driver, JAX's CUDA backend cannot
# start: choose the CPU before a backend starts (JAX would fall back to it anyway, after a
# traceback), so that deviceless GPU compiles work. A no-op anywhere else.
plan.quiet_cuda_plugin_without_driver()

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
