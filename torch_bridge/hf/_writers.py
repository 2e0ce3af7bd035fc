"""``TransformerConfig`` -> Hugging Face ``config.json``, one writer per family.

Each writer refuses (``ValueError`` naming the field) a config its family cannot express,
and writes the transformers >= 5 form (``rope_parameters``, ``layer_types``) that
``AutoConfig`` / ``AutoModelForCausalLM.from_pretrained`` read back to the same
architecture (and ``_readers`` to the same config).
"""

from jaxckpt.nn import TransformerConfig
from torch_bridge.hf._common import hf_layer_types, hf_rope, kinds_of

_OFF = dict(
    qk_norm=False,
    post_norms=False,
    embed_scale=False,
    attention_softcap=None,
    logits_softcap=None,
    local_rope_theta=None,
    rotary_fraction=1.0,
)
GPT2_ACTIVATION_NAMES = {"gelu_tanh": "gelu_new", "gelu": "gelu"}
"""jaxckpt's activations -> GPT-2's ``activation_function``."""


def _require(config: TransformerConfig, arch: str, **expected) -> None:
    for field, value in expected.items():
        if getattr(config, field) != value:
            raise ValueError(
                f"a {arch} checkpoint needs {field}={value!r}; this model has {getattr(config, field)!r}"
            )


def _decoder(config: TransformerConfig, arch: str, *, gated: str = "swiglu", norm: str = "rms", **off):
    """Checks the choices of a LLaMA-like family, and that every feature not in ``off``'s
    overrides is off."""
    _require(config, arch, norm=norm, activation=gated, positions="rope", causal=True)
    _require(config, arch, **(_OFF | off))
    _require(config, arch, attention_out_bias=config.attention_bias)
    default_scale = config.head_dim**-0.5
    if "attention_scale" not in off and config.attention_scale not in (None, default_scale):
        raise ValueError(f"a {arch} checkpoint scales q.k by head_dim**-0.5; this model has "
                         f"attention_scale={config.attention_scale!r}")  # fmt: skip


def _kinds(config: TransformerConfig, arch: str, *, sliding: str = "none", nope: bool = False) -> list:
    """The per-layer kinds, checked: ``sliding`` is ``"none"``, ``"all"`` (one window for
    every layer or none) or ``"any"``; NoPE layers only with ``nope``."""
    kinds = kinds_of(config)
    if not nope and not all(k.rope for k in kinds):
        raise ValueError(
            f"a {arch} checkpoint has RoPE on every layer; layer_pattern={config.layer_pattern!r}"
        )
    flags = {k.sliding for k in kinds}
    if (sliding == "none" and True in flags) or (sliding == "all" and len(flags) > 1):
        what = "no sliding window" if sliding == "none" else "one window for every layer or none"
        raise ValueError(f"a {arch} checkpoint has {what}; layer_pattern={config.layer_pattern!r}")
    return kinds


TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
"""Written as None: a ``TransformerConfig`` does not know its tokenizer's ids, and the
families' defaults (SmolLM3's pad 128004, say) may not even be in a small vocabulary.
``save_hf(..., hf_fields=...)`` writes the real ones."""


def _base(config: TransformerConfig, model_type: str, architecture: str, head_dim: bool = True) -> dict:
    out = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.ffn_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_len,
        "rms_norm_eps": config.norm_eps,
        "rope_parameters": hf_rope(config.rope_theta, config.rope_scaling),
        "rope_theta": config.rope_theta,
        "attention_dropout": 0.0,
        "tie_word_embeddings": config.tie_embeddings,
        "dtype": config.param_dtype,
        **dict.fromkeys(TOKEN_IDS),
    }
    if not head_dim:
        del out["head_dim"]
    return out


def llama_hf_config(config: TransformerConfig) -> dict:
    """The ``config.json`` of a ``LlamaForCausalLM`` with this model's sizes.

    Example:
        >>> llama_hf_config(TransformerConfig(n_layers=1))["num_hidden_layers"]
        1
    """
    _decoder(config, "LLaMA")
    _kinds(config, "LLaMA")
    out = _base(config, "llama", "LlamaForCausalLM") | {"hidden_act": "silu"}
    return out | {"attention_bias": config.attention_bias, "mlp_bias": config.mlp_bias}


def mistral_hf_config(config: TransformerConfig) -> dict:
    """The ``config.json`` of a ``MistralForCausalLM``: one window (or none) for every layer."""
    _decoder(config, "Mistral")
    _require(config, "Mistral", attention_bias=False, mlp_bias=False)
    sliding = _kinds(config, "Mistral", sliding="all")[0].sliding
    out = _base(config, "mistral", "MistralForCausalLM") | {"hidden_act": "silu"}
    return out | {"sliding_window": config.sliding_window if sliding else None}


def _qwen_window(config: TransformerConfig, kinds: list) -> dict:
    sliding = [k.sliding for k in kinds]
    return {
        "use_sliding_window": any(sliding),
        "sliding_window": config.sliding_window if any(sliding) else None,
        "max_window_layers": sliding.index(True) if any(sliding) else config.n_layers,
        "layer_types": hf_layer_types(config),
    }


def qwen2_hf_config(config: TransformerConfig) -> dict:
    """The ``config.json`` of a ``Qwen2ForCausalLM``: biases on q, k and v only."""
    _require(config, "Qwen2", attention_bias=True, attention_out_bias=False, mlp_bias=False)
    _decoder(config.replace(attention_out_bias=True), "Qwen2")
    kinds = _kinds(config, "Qwen2", sliding="any")
    return _base(config, "qwen2", "Qwen2ForCausalLM") | {"hidden_act": "silu"} | _qwen_window(config, kinds)


def qwen3_hf_config(config: TransformerConfig) -> dict:
    """The ``config.json`` of a ``Qwen3ForCausalLM``: q/k norms."""
    _decoder(config, "Qwen3", qk_norm=True)
    _require(config, "Qwen3", mlp_bias=False)
    kinds = _kinds(config, "Qwen3", sliding="any")
    out = _base(config, "qwen3", "Qwen3ForCausalLM") | {"hidden_act": "silu"}
    return out | {"attention_bias": config.attention_bias} | _qwen_window(config, kinds)


def _gemma(config: TransformerConfig, arch: str, model_type: str, architecture: str, qk_norm: bool) -> dict:
    _decoder(config, arch, gated="geglu_tanh", norm="gemma_rms", qk_norm=qk_norm, post_norms=True,
             embed_scale=True, attention_softcap=config.attention_softcap,
             logits_softcap=config.logits_softcap, local_rope_theta=config.local_rope_theta,
             attention_scale=config.attention_scale)  # fmt: skip
    _require(config, arch, mlp_bias=False)
    _kinds(config, arch, sliding="any")
    scalar = (config.attention_scale or config.head_dim**-0.5) ** -2
    scalar = round(scalar) if abs(scalar - round(scalar)) < 1e-6 * scalar else scalar
    out = _base(config, model_type, architecture) | {"hidden_activation": "gelu_pytorch_tanh"}
    return out | {
        "attention_bias": config.attention_bias,
        "query_pre_attn_scalar": scalar,
        "sliding_window": config.sliding_window,
        "layer_types": hf_layer_types(config),
        "attn_logit_softcapping": config.attention_softcap,
        "final_logit_softcapping": config.logits_softcap,
    }


def gemma2_hf_config(config: TransformerConfig) -> dict:
    """The ``config.json`` of a ``Gemma2ForCausalLM``."""
    _require(config, "Gemma 2", local_rope_theta=None)
    return _gemma(config, "Gemma 2", "gemma2", "Gemma2ForCausalLM", qk_norm=False)


def gemma3_hf_config(config: TransformerConfig) -> dict:
    """The ``config.json`` of a text-only ``Gemma3ForCausalLM`` (``gemma3_text``): RoPE per
    layer type (the sliding layers' base unscaled)."""
    out = _gemma(config, "Gemma 3", "gemma3_text", "Gemma3ForCausalLM", qk_norm=True)
    full = hf_rope(config.rope_theta, config.rope_scaling)
    local = full if config.local_rope_theta is None else hf_rope(config.local_rope_theta, None)
    del out["rope_theta"]
    return out | {"rope_parameters": {"full_attention": full, "sliding_attention": local}}


def phi3_hf_config(config: TransformerConfig) -> dict:
    """The ``config.json`` of a ``Phi3ForCausalLM``: partial rotary, longrope, one window."""
    _decoder(config, "Phi-3", rotary_fraction=config.rotary_fraction)
    _require(config, "Phi-3", attention_bias=False, mlp_bias=False, head_dim=config.d_model // config.n_heads)
    scaling = config.rope_scaling
    if scaling is not None and scaling.kind != "longrope":
        raise ValueError(
            f"a Phi-3 checkpoint has longrope scaling or none; this model has {scaling.kind.value!r}"
        )
    sliding = _kinds(config, "Phi-3", sliding="all")[0].sliding
    original = (scaling.original_max_len if scaling is not None else None) or config.max_len
    rope = hf_rope(config.rope_theta, scaling, partial_rotary_factor=config.rotary_fraction)
    out = _base(config, "phi3", "Phi3ForCausalLM", head_dim=False) | {"hidden_act": "silu"}
    return out | {
        "rope_parameters": rope,
        "partial_rotary_factor": config.rotary_fraction,
        "original_max_position_embeddings": original,
        "sliding_window": config.sliding_window if sliding else None,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
    }


def smollm3_hf_config(config: TransformerConfig) -> dict:
    """The ``config.json`` of a ``SmolLM3ForCausalLM``: NoPE layers (``no_rope_layers``)."""
    _decoder(config, "SmolLM3")
    kinds = _kinds(config, "SmolLM3", sliding="any", nope=True)
    sliding = [k.sliding for k in kinds]
    out = _base(config, "smollm3", "SmolLM3ForCausalLM") | {"hidden_act": "silu"}
    return out | {
        "attention_bias": config.attention_bias,
        "mlp_bias": config.mlp_bias,
        "no_rope_layers": [int(k.rope) for k in kinds],
        "use_sliding_window": any(sliding),
        "sliding_window": config.sliding_window if any(sliding) else None,
        "layer_types": hf_layer_types(config),
    }


def gpt2_hf_config(config: TransformerConfig) -> dict:
    """The ``config.json`` of a ``GPT2LMHeadModel`` with this model's sizes.

    Example:
        >>> gpt2_hf_config(TransformerConfig(family="gpt2", attention_bias=True, mlp_bias=True))["n_embd"]
        128
    """
    _require(config, "GPT-2", norm="layer", positions="learned", causal=True)
    _require(config, "GPT-2", attention_bias=True, attention_out_bias=True, mlp_bias=True)
    _require(config, "GPT-2", n_kv_heads=config.n_heads, head_dim=config.d_model // config.n_heads)
    _require(config, "GPT-2", **_OFF, attention_scale=None, layer_pattern=("full",))
    if config.activation not in GPT2_ACTIVATION_NAMES:
        raise ValueError(f"a GPT-2 checkpoint needs a GELU MLP; this model has {config.activation!r}")
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_embd": config.d_model,
        "n_layer": config.n_layers,
        "n_head": config.n_heads,
        "n_inner": config.ffn_dim,
        "n_positions": config.max_len,
        "layer_norm_epsilon": config.norm_eps,
        "activation_function": GPT2_ACTIVATION_NAMES[config.activation],
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "tie_word_embeddings": config.tie_embeddings,
        "dtype": config.param_dtype,
    }
