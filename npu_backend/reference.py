"""The former name of :mod:`npu_backend.emulator` (plain-torch ``npu_fusion_attention``), kept importable."""

from npu_backend.emulator import (
    COMPRESSED_MASK_SIZE,
    LAYOUTS,
    compressed_causal_mask,
    manual_seed,
    npu_fusion_attention,
    npu_fusion_attention_grad,
)

__all__ = [
    "COMPRESSED_MASK_SIZE",
    "LAYOUTS",
    "compressed_causal_mask",
    "manual_seed",
    "npu_fusion_attention",
    "npu_fusion_attention_grad",
]
