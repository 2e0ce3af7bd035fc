"""``implementation="pallas"``: FlashAttention-2 as Pallas kernels (Triton on a GPU).

Call path: ``flash_attention`` (``jaxckpt.attention._api``) dispatches to
``pallas_attention`` (``_kernel``: padding, the custom VJP), which runs the forward
kernel (``_fwd``) and the two backward kernels (``_bwd``); both use the per-tile math of
``_tile`` on the padded layout of ``_layout``, with the block sizes of ``_blocks``.
``autotune_pallas_blocks`` (``jaxckpt.attention._autotune``) sits above ``_api``, outside
this package, because it times ``flash_attention`` itself.
"""

from jaxckpt.attention.pallas._blocks import (
    MAX_HEAD_DIM,
    PallasBlocks,
    default_pallas_blocks,
    padded_head_dim,
    pallas_blocks,
    set_pallas_blocks,
)
from jaxckpt.attention.pallas._kernel import pallas_attention, pallas_fits, pallas_note

__all__ = [
    "MAX_HEAD_DIM",
    "PallasBlocks",
    "default_pallas_blocks",
    "padded_head_dim",
    "pallas_attention",
    "pallas_blocks",
    "pallas_fits",
    "pallas_note",
    "set_pallas_blocks",
]
