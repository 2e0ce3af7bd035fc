"""``from_params``: a model holding given parameters, with no random initialisation."""

import jax
from flax import nnx

from jaxckpt.nn._config import TransformerConfig
from jaxckpt.nn._quant import quantize_params


def from_params(
    cls: type[nnx.Module], config: TransformerConfig, params: dict, *, seed: int = 0
) -> nnx.Module:
    """``cls(config)`` holding ``params`` instead of a random initialisation.

    The module is built abstractly (``nnx.eval_shape``), so no parameter is allocated
    twice. On CPU, numpy arrays aligned to 64 bytes move into JAX without a copy.

    Args:
        cls: ``Transformer`` or ``Block``.
        config: its config.
        params: the nested dict of its ``nnx.Param`` state (``nnx.to_pure_dict``), numpy
            or JAX arrays. With ``config.lora``, a base's dict without the adapters is
            taken too: the adapters are then initialised from ``seed`` (``b`` at zero, so
            the model computes what the base does). With ``config.quantize_base``, a
            base's float ``kernel``s are quantized here (``quantize_params``); a quantized
            model's own dict (``kernel_codes``, ``kernel_scales``) is taken as it is.
        seed: the adapters' initialisation, when ``params`` has none.

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
    if config.quantize_base is not None:
        params = quantize_params(params, state, config.quantize_base)
    if config.lora is not None and not _has_adapters(params):
        params = _merged(params, _initial_adapters(cls, config, seed))
    nnx.replace_by_pure_dict(state, jax.tree.map(jax.device_put, params))
    return nnx.merge(graphdef, state)


def _has_adapters(params: dict) -> bool:
    return any(isinstance(v, dict) and ("lora" in v or _has_adapters(v)) for v in params.values())


def _initial_adapters(cls: type[nnx.Module], config: TransformerConfig, seed: int) -> dict:
    """The adapters' initial values alone (compiled: XLA drops the base's initialisation)."""
    return jax.jit(lambda: nnx.to_pure_dict(nnx.state(cls(config, rngs=nnx.Rngs(seed)), nnx.LoRAParam)))()


def _merged(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merged(out.get(key, {}), value) if isinstance(value, dict) else value
    return out
