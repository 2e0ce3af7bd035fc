"""The pre-norm decoder block: ``x + attn(norm(x))``, then ``+ mlp(norm(.))``."""

import jax
from flax import nnx

from jaxckpt._tags import tag
from jaxckpt.nn._activation_sharding import constrain
from jaxckpt.nn._attention import FULL, Attention
from jaxckpt.nn._choices import LayerKind
from jaxckpt.nn._config import TransformerConfig
from jaxckpt.nn._kv_cache import LayerCache
from jaxckpt.nn._layers import make_norm
from jaxckpt.nn._mlp import MLP
from jaxckpt.remat import Tag

ACTIVATION = ("batch", "seq", "embed")
"""The logical names of the residual stream's axes ``[B, T, D]``."""


class Block(nnx.Module):
    """One pre-norm decoder layer; its input is tagged ``Tag.LAYER_INPUT`` (the remat
    boundary; inside a remat segment of several layers the segment tags its own input
    instead: ``tag_input=False``).

    With ``cfg.post_norms`` (Gemma 2 and 3) the attention and MLP outputs are normalised
    again before their residual adds: ``x + post(attn(pre(x)))``.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from jaxckpt.nn import Block, TransformerConfig
        >>> cfg = TransformerConfig(d_model=12, n_heads=3, ffn_dim=20)
        >>> Block(cfg, rngs=nnx.Rngs(0))(jnp.ones((2, 5, 12))).shape
        (2, 5, 12)
    """

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs, attention: "str | None" = None):
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg, rngs=rngs, implementation=attention)
        self.attn_post_norm = make_norm(cfg) if cfg.post_norms else None
        self.mlp_norm = make_norm(cfg)
        self.mlp = MLP(cfg, rngs=rngs)
        self.mlp_post_norm = make_norm(cfg) if cfg.post_norms else None

    def __call__(
        self,
        x: jax.Array,
        kind: "LayerKind | tuple[LayerKind, ...]" = FULL,
        index=None,
        *,
        positions: "jax.Array | None" = None,
        segment_ids: "jax.Array | None" = None,
        cache: "LayerCache | None" = None,
        dropout_key: "jax.Array | None" = None,
        tag_input: bool = True,
    ):
        """``[B, T, D] -> [B, T, D]`` for a layer of ``kind`` (static; see ``LayerKind``), or
        of ``kind[index]`` for a tuple of kinds and a traced index (see ``Attention``, which
        also takes ``positions``, ``segment_ids`` and ``cache``; with a cache the call
        returns ``(x, new_cache)``). ``dropout_key``: the layer's key for its LoRA adapters'
        dropout (training); None: none. ``tag_input``: tag ``x`` ``Tag.LAYER_INPUT`` (False
        for a layer inside a remat segment of several, whose input is the segment's tag)."""
        attn_key, mlp_key = (None, None) if dropout_key is None else jax.random.split(dropout_key)
        x = constrain(x, *ACTIVATION)
        if tag_input:
            x = tag(x, Tag.LAYER_INPUT)
        h = self.attn(
            tag(self.attn_norm(x), Tag.NORM_OUT),
            kind,
            index,
            positions=positions,
            segment_ids=segment_ids,
            cache=cache,
            dropout_key=attn_key,
        )
        if cache is not None:
            h, cache = h
        if self.attn_post_norm is not None:
            h = self.attn_post_norm(h)
        x = constrain(x + h, *ACTIVATION)
        h = self.mlp(tag(self.mlp_norm(x), Tag.NORM_OUT), dropout_key=mlp_key)
        if self.mlp_post_norm is not None:
            h = self.mlp_post_norm(h)
        x = constrain(x + h, *ACTIVATION)
        return x if cache is None else (x, cache)
