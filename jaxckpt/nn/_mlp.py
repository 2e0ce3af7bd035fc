"""The feed-forward block: SwiGLU, GeGLU-tanh, GELU-tanh or exact GELU, with every tensor tagged."""

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxckpt.nn._activation_sharding import constrain
from jaxckpt.nn._choices import GATED, Activation
from jaxckpt.nn._config import TransformerConfig
from jaxckpt.nn._layers import make_dense
from jaxckpt.nn._lora import project
from jaxckpt.remat import Tag

ACTIVATIONS = {
    Activation.SWIGLU: jax.nn.silu,
    Activation.GEGLU_TANH: lambda x: jax.nn.gelu(x, approximate=True),
    Activation.GELU_TANH: lambda x: jax.nn.gelu(x, approximate=True),
    Activation.GELU: lambda x: jax.nn.gelu(x, approximate=False),
}
"""``Activation`` -> its nonlinearity (applied to the gate when the activation is in ``GATED``)."""


class MLP(nnx.Module):
    """``down(act(gate(x)) * up(x))`` for a gated activation (SwiGLU, GeGLU), else ``down(act(up(x)))``.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from jaxckpt.nn import MLP, TransformerConfig
        >>> cfg = TransformerConfig(d_model=6, n_heads=3, ffn_dim=10)
        >>> MLP(cfg, rngs=nnx.Rngs(0))(jnp.ones((1, 3, 6))).shape
        (1, 3, 6)
    """

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        self.gated = cfg.activation in GATED
        d, f, bias = cfg.d_model, cfg.ffn_dim, cfg.mlp_bias
        self.gate = (
            make_dense(cfg, d, f, bias=bias, rngs=rngs, axes=("embed", "mlp"), target="gate")
            if self.gated
            else None
        )
        self.up = make_dense(cfg, d, f, bias=bias, rngs=rngs, axes=("embed", "mlp"), target="up")
        self.down = make_dense(cfg, f, d, bias=bias, rngs=rngs, axes=("mlp", "embed"), target="down")
        self.activation = cfg.activation

    def __call__(self, x: jax.Array, *, dropout_key: "jax.Array | None" = None) -> jax.Array:
        """``[B, T, D] -> [B, T, D]``; ``dropout_key``: for the LoRA adapters' dropout (training)."""
        hidden_axes = ("batch", "seq", "mlp")
        up = checkpoint_name(constrain(project(self.up, x, dropout_key, 0), *hidden_axes), Tag.MLP_UP)
        if self.gated:
            gate = checkpoint_name(
                constrain(project(self.gate, x, dropout_key, 1), *hidden_axes), Tag.MLP_GATE
            )
            hidden = ACTIVATIONS[self.activation](gate) * up
        else:
            hidden = ACTIVATIONS[self.activation](up)
        hidden = checkpoint_name(hidden, Tag.MLP_ACT)
        return checkpoint_name(project(self.down, hidden, dropout_key, 2), Tag.MLP_DOWN)
