"""Flax NNX modules: a decoder for the LLaMA, GPT-2, Qwen, Mistral, Gemma, Phi-3 and SmolLM
families, built on ``flash_attention`` and remat.

Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jaxckpt import nn
    >>> cfg = nn.TransformerConfig.preset("tiny", n_layers=2)
    >>> model = nn.Transformer(cfg, rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((1, 8), jnp.int32), remat="save_attn").shape
    (1, 8, 256)
"""

from jaxckpt.nn._activation_sharding import activation_sharding, constrain
from jaxckpt.nn._attention import Attention
from jaxckpt.nn._block import Block
from jaxckpt.nn._build import from_params
from jaxckpt.nn._choices import GATED, LAYER_KINDS, Activation, LayerKind, Norm, Positions, RopeKind, period
from jaxckpt.nn._config import DTYPES, FAMILY_DEFAULTS, PRESETS, QUANTIZATIONS, TransformerConfig
from jaxckpt.nn._kv_cache import KVCache
from jaxckpt.nn._layers import Embedding, GemmaRMSNorm, LayerNorm, RMSNorm, logical_axes
from jaxckpt.nn._lora import HF_MODULES, LORA_TARGETS, LoraConfig, LoraLinear, trainable
from jaxckpt.nn._mlp import MLP
from jaxckpt.nn._quant import (
    NF4_CODE,
    QuantizedBase,
    QuantizedLinear,
    dequantize,
    quantize,
    quantize_params,
    quantized_matmul,
)
from jaxckpt.nn._rope import apply_rope, rope_tables
from jaxckpt.nn._rope_scaling import RopeScaling, inv_frequencies
from jaxckpt.nn._stack import run_blocks, segment_sizes
from jaxckpt.nn._transformer import Transformer

__all__ = [
    "DTYPES",
    "FAMILY_DEFAULTS",
    "GATED",
    "HF_MODULES",
    "LAYER_KINDS",
    "LORA_TARGETS",
    "MLP",
    "NF4_CODE",
    "PRESETS",
    "QUANTIZATIONS",
    "Activation",
    "Attention",
    "Block",
    "Embedding",
    "GemmaRMSNorm",
    "KVCache",
    "LayerKind",
    "LayerNorm",
    "LoraConfig",
    "LoraLinear",
    "Norm",
    "Positions",
    "QuantizedBase",
    "QuantizedLinear",
    "RMSNorm",
    "RopeKind",
    "RopeScaling",
    "Transformer",
    "TransformerConfig",
    "activation_sharding",
    "apply_rope",
    "constrain",
    "dequantize",
    "from_params",
    "inv_frequencies",
    "logical_axes",
    "period",
    "quantize",
    "quantize_params",
    "quantized_matmul",
    "rope_tables",
    "run_blocks",
    "segment_sizes",
    "trainable",
]
