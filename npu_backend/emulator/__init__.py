"""A plain-torch emulator of ``torch_npu.npu_fusion_attention`` and its grad op (CPU, no Ascend).

Call path: ``npu_backend.reference_ops()`` (``"npu_reference"``) hands
``npu_fusion_attention`` / ``npu_fusion_attention_grad`` (``_fusion_attention``: the ops'
documented contract) to the NPU route in place of ``torch_npu``; they check their
arguments (``_inputs``, with the masks of ``_masks``) and run the fp32 math, layouts and
dropout bits of ``_core``. Importing it imports torch. The former name
``npu_backend.reference`` still imports the same surface.
"""

from npu_backend.emulator._fusion_attention import (
    COMPRESSED_MASK_SIZE,
    LAYOUTS,
    compressed_causal_mask,
    manual_seed,
    npu_fusion_attention,
    npu_fusion_attention_grad,
)
from npu_backend.emulator._fusion_attention import (
    _dropout_mask as _dropout_mask,  # the flat keep mask both ops use; for tests
)

__all__ = [
    "COMPRESSED_MASK_SIZE",
    "LAYOUTS",
    "compressed_causal_mask",
    "manual_seed",
    "npu_fusion_attention",
    "npu_fusion_attention_grad",
]
