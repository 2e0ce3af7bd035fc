"""Remat policies over named activations.

``Tag`` lists every ``checkpoint_name`` jaxckpt places; a policy saving
``Tag.ATTN_OUT`` and ``Tag.ATTN_LSE`` lets the backward pass skip the attention
forward recompute.
"""

from jaxckpt.remat._tags import Tag

__all__ = ["Tag"]
