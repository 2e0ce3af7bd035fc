"""Multi-head (and grouped-query) self-attention over ``flash_attention``."""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxckpt.attention import flash_attention
from jaxckpt.nn._activation_sharding import constrain
from jaxckpt.nn._config import TransformerConfig
from jaxckpt.nn._layers import make_dense
from jaxckpt.nn._rope import apply_rope, rope_tables
from jaxckpt.remat import Tag


class Attention(nnx.Module):
    """Self-attention: q/k/v projections, RoPE (llama), attention, output projection.

    Causal unless ``cfg.causal`` is False.

    The attention itself is ``jaxckpt.flash_attention`` with the config's
    ``attention`` implementation; GQA is passed through without repeating K/V.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from jaxckpt.nn import Attention, TransformerConfig
        >>> cfg = TransformerConfig(d_model=12, n_heads=3, n_kv_heads=1, head_dim=4)
        >>> Attention(cfg, rngs=nnx.Rngs(0))(jnp.ones((2, 5, 12))).shape
        (2, 5, 12)
    """

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        n, k, h, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model
        bias = cfg.attention_bias
        self.q_proj = make_dense(cfg, d, n * h, bias=bias, rngs=rngs, axes=("embed", "heads"))
        self.k_proj = make_dense(cfg, d, k * h, bias=bias, rngs=rngs, axes=("embed", "kv_heads"))
        self.v_proj = make_dense(cfg, d, k * h, bias=bias, rngs=rngs, axes=("embed", "kv_heads"))
        self.out_proj = make_dense(cfg, n * h, d, bias=bias, rngs=rngs, axes=("heads", "embed"))
        self.heads = (n, k, h)
        self.rope_theta = cfg.rope_theta if cfg.positions == "rope" else None
        self.implementation = cfg.attention
        self.causal = cfg.causal

    def __call__(self, x: jax.Array) -> jax.Array:
        """``[B, T, D] -> [B, T, D]``."""
        b, t, _ = x.shape
        n, k, h = self.heads
        heads = ("batch", "seq", "heads", "head_dim")
        q = checkpoint_name(constrain(self.q_proj(x).reshape(b, t, n, h), *heads), Tag.Q_PROJ)
        key = checkpoint_name(constrain(self.k_proj(x).reshape(b, t, k, h), *heads), Tag.K_PROJ)
        value = checkpoint_name(constrain(self.v_proj(x).reshape(b, t, k, h), *heads), Tag.V_PROJ)
        if self.rope_theta is not None:
            cos, sin = rope_tables(jnp.arange(t), h, self.rope_theta)
            q, key = apply_rope(q, cos, sin), apply_rope(key, cos, sin)
        out = flash_attention(q, key, value, is_causal=self.causal, implementation=self.implementation)
        return checkpoint_name(self.out_proj(out.reshape(b, t, n * h)), Tag.OUT_PROJ)
