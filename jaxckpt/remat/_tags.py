"""The names of every activation that jaxckpt tags with ``checkpoint_name``.

A remat policy refers to activations by these names, so a tag string is written
exactly once, here. Attention tags are placed by the attention kernels; the model
tags arrive with the ``jaxckpt.nn`` modules.
"""

import enum


class Tag(enum.StrEnum):
    """``checkpoint_name`` tags placed by jaxckpt.

    Example:
        >>> from jaxckpt.remat import Tag
        >>> str(Tag.ATTN_OUT)
        'attn_out'
    """

    ATTN_OUT = "attn_out"
    """Attention output ``[B, T, N, H]`` (before the output projection)."""
    ATTN_LSE = "attn_lse"
    """Attention log-sum-exp, fp32, kept for the flash backward pass."""
