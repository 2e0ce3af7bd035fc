"""npu_backend: jaxckpt attention on Ascend NPUs through ``torch_npu.npu_fusion_attention``.

Importing it registers two ``jaxckpt.flash_attention`` implementations:

- ``"npu"``: the CANN fused kernels through torch_npu, forward and backward. Where
  torch_npu cannot run, using it raises an error with the reason; nothing falls back.
- ``"npu_reference"``: the same route with ``npu_backend.reference``, a plain-torch
  model of the ops' documented contract, on the CPU. It is how the route is tested
  without an NPU.

``is_available()`` and ``info()`` are safe to call on any machine.

Example:
    >>> import jax, jaxckpt, npu_backend
    >>> q = jax.random.normal(jax.random.key(0), (1, 5, 2, 8))
    >>> out = jaxckpt.flash_attention(q, q, q, is_causal=True, implementation="npu_reference")
    >>> bool(jax.numpy.allclose(out, jaxckpt.attention_reference(q, q, q, is_causal=True), atol=1e-5))
    True
"""

import importlib.util

from jaxckpt.attention import FEATURES, register_implementation
from npu_backend._availability import device_count, info, is_available, unavailable
from npu_backend._fusion import UNSUPPORTED, fusion_attention, npu_attention
from npu_backend._ops import FusionOps, reference_ops, torch_npu_ops

SUPPORTS = FEATURES - UNSUPPORTED
"""The ``jaxckpt.flash_attention`` features the NPU route takes."""


def _torch_missing() -> str | None:
    return None if importlib.util.find_spec("torch") else "PyTorch is not installed"


register_implementation(
    "npu",
    lambda p, block_sizes: npu_attention(p, torch_npu_ops()),
    supports=SUPPORTS,
    unavailable=unavailable,
)
register_implementation(
    "npu_reference",
    lambda p, block_sizes: npu_attention(p, reference_ops()),
    supports=SUPPORTS,
    unavailable=_torch_missing,
)

__all__ = [
    "SUPPORTS",
    "FusionOps",
    "device_count",
    "fusion_attention",
    "info",
    "is_available",
    "reference_ops",
    "torch_npu_ops",
    "unavailable",
]
