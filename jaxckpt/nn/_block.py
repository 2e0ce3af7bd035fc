"""The pre-norm decoder block: ``x + attn(norm(x))``, then ``+ mlp(norm(.))``."""

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxckpt.nn._activation_sharding import constrain
from jaxckpt.nn._attention import Attention
from jaxckpt.nn._config import TransformerConfig
from jaxckpt.nn._layers import make_norm
from jaxckpt.nn._mlp import MLP
from jaxckpt.remat import Tag

ACTIVATION = ("batch", "seq", "embed")
"""The logical names of the residual stream's axes ``[B, T, D]``."""


class Block(nnx.Module):
    """One pre-norm decoder layer; its input is tagged ``Tag.LAYER_INPUT``.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from jaxckpt.nn import Block, TransformerConfig
        >>> cfg = TransformerConfig(d_model=12, n_heads=3, ffn_dim=20)
        >>> Block(cfg, rngs=nnx.Rngs(0))(jnp.ones((2, 5, 12))).shape
        (2, 5, 12)
    """

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = make_norm(cfg)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """``[B, T, D] -> [B, T, D]``."""
        x = checkpoint_name(constrain(x, *ACTIVATION), Tag.LAYER_INPUT)
        x = constrain(x + self.attn(checkpoint_name(self.attn_norm(x), Tag.NORM_OUT)), *ACTIVATION)
        return constrain(x + self.mlp(checkpoint_name(self.mlp_norm(x), Tag.NORM_OUT)), *ACTIVATION)
