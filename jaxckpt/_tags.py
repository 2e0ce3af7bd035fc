"""The names of every activation that jaxckpt tags with ``checkpoint_name``.

A remat policy refers to activations by these names, so a tag string is written
exactly once, here. The attention kernels place ``ATTN_OUT`` and ``ATTN_LSE``;
the ``jaxckpt.nn`` modules place the others. This module is on the ground floor
(it imports no layer), so the kernels can tag without importing ``jaxckpt.remat``,
which re-exports :class:`Tag`.
"""

import enum


class Tag(enum.StrEnum):
    """``checkpoint_name`` tags placed by jaxckpt.

    Example:
        >>> from jaxckpt.remat import Tag
        >>> str(Tag.ATTN_OUT)
        'attn_out'
    """

    LAYER_INPUT = "layer_input"
    """The residual stream entering a block ``[B, T, D]``."""
    NORM_OUT = "norm_out"
    """The output of each pre-norm (before attention and before the MLP) ``[B, T, D]``."""
    Q_PROJ = "q_proj"
    """Query projection ``[B, T, N, H]`` (before RoPE)."""
    K_PROJ = "k_proj"
    """Key projection ``[B, S, K, H]`` (before RoPE)."""
    V_PROJ = "v_proj"
    """Value projection ``[B, S, K, H]``."""
    ATTN_OUT = "attn_out"
    """Attention output ``[B, T, N, H]`` (before the output projection)."""
    ATTN_LSE = "attn_lse"
    """Attention log-sum-exp, fp32, kept for the flash backward pass."""
    OUT_PROJ = "out_proj"
    """Attention output projection ``[B, T, D]``."""
    MLP_GATE = "mlp_gate"
    """Gate projection of a gated MLP (SwiGLU) ``[B, T, F]``."""
    MLP_UP = "mlp_up"
    """Up projection of the MLP ``[B, T, F]``."""
    MLP_ACT = "mlp_act"
    """Hidden activation of the MLP, the input of the down projection ``[B, T, F]``."""
    MLP_DOWN = "mlp_down"
    """Down projection of the MLP ``[B, T, D]``."""
    LINEAR_OUT = "linear_out"
    """Every dense projection's matmul output, before its bias (what ``save_dots`` saves)."""


PROJECTIONS = frozenset(
    {Tag.Q_PROJ, Tag.K_PROJ, Tag.V_PROJ, Tag.OUT_PROJ, Tag.MLP_GATE, Tag.MLP_UP, Tag.MLP_DOWN}
)
"""The tags that are matmul outputs (what ``minimal`` keeps besides the attention residuals)."""
QKV = frozenset({Tag.Q_PROJ, Tag.K_PROJ, Tag.V_PROJ})
ATTENTION_RESIDUALS = frozenset({Tag.ATTN_OUT, Tag.ATTN_LSE})
