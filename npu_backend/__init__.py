"""npu_backend: jaxckpt attention on Ascend NPUs through ``torch_npu.npu_fusion_attention``.

Importing it registers three ``jaxckpt.flash_attention`` implementations; that call is
the only front door (it validates the arguments once, with the same signature for
every route):

- ``"npu"``: the CANN fused kernels through torch_npu, forward and backward. Where
  torch_npu cannot run, using it raises an error with the reason; nothing falls back.
- ``"npu_reference"``: the same route with ``npu_backend.emulator``, a plain-torch
  model of the ops' documented contract, on the CPU. It is how the route is tested
  without an NPU.
- ``"npu_ffi"``: the second route, an XLA FFI custom call (``npu_backend/ffi``) with
  its C++ CPU kernel (causal and window only). On Ascend it would need a JAX PJRT
  backend for the NPU, which does not exist publicly.

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
from npu_backend import _ffi
from npu_backend._availability import device_count, info, is_available, unavailable
from npu_backend._fusion import UNSUPPORTED, npu_attention
from npu_backend._ops import FusionOps, reference_ops, torch_npu_ops

SUPPORTS = FEATURES - UNSUPPORTED
"""The ``jaxckpt.flash_attention`` features the NPU route takes."""


def _torch_missing() -> str | None:
    return None if importlib.util.find_spec("torch") else "PyTorch is not installed"


# None of them holds the [B, N, T, S] scores in JAX memory (materializes_scores=False):
# the CANN kernels and the FFI's C++ kernel are flash kernels, and npu_reference's torch
# model computes its scores on the host, inside the callback.
register_implementation(
    "npu",
    lambda p, block_sizes: npu_attention(p, torch_npu_ops()),
    supports=SUPPORTS,
    unavailable=unavailable,
    shares_dropout_mask=False,
    materializes_scores=False,
)
register_implementation(
    "npu_reference",
    lambda p, block_sizes: npu_attention(p, reference_ops()),
    supports=SUPPORTS,
    unavailable=_torch_missing,
    shares_dropout_mask=False,
    materializes_scores=False,
)
register_implementation(
    "npu_ffi",
    _ffi.ffi_attention_normalized,
    supports=_ffi.SUPPORTED_FEATURES,
    unavailable=_ffi.missing,
    materializes_scores=False,
)

__all__ = [
    "SUPPORTS",
    "FusionOps",
    "device_count",
    "info",
    "is_available",
    "reference_ops",
    "torch_npu_ops",
    "unavailable",
]
