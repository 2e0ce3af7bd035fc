"""``from_params``: a model holding given parameters, with no random initialisation."""

import jax
from flax import nnx

from jaxckpt.nn._config import TransformerConfig


def from_params(cls: type[nnx.Module], config: TransformerConfig, params: dict) -> nnx.Module:
    """``cls(config)`` holding ``params`` instead of a random initialisation.

    The module is built abstractly (``nnx.eval_shape``), so no parameter is allocated
    twice. On CPU, numpy arrays aligned to 64 bytes move into JAX without a copy.

    Args:
        cls: ``Transformer`` or ``Block``.
        config: its config.
        params: the nested dict of its ``nnx.Param`` state (``nnx.to_pure_dict``), numpy
            or JAX arrays.

    Example:
        >>> import numpy as np
        >>> from jaxckpt.nn import Block, TransformerConfig, from_params
        >>> cfg = TransformerConfig(d_model=4, n_heads=2, ffn_dim=6)
        >>> params = nnx.to_pure_dict(nnx.state(Block(cfg, rngs=nnx.Rngs(0)), nnx.Param))
        >>> block = from_params(Block, cfg, jax.tree.map(np.zeros_like, params))
        >>> float(block.attn.q_proj.kernel[...].sum())
        0.0
    """
    graphdef, state = nnx.split(nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0))))
    nnx.replace_by_pure_dict(state, jax.tree.map(jax.device_put, params))
    return nnx.merge(graphdef, state)
