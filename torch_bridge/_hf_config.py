"""Hugging Face ``config.json`` <-> ``jaxckpt.nn.TransformerConfig``, for LLaMA and GPT-2.

Every field of a config is either carried over, known to leave the weights and the
forward pass alone (ids, labels, output flags), noted (dropout: jaxckpt models have
none), or refused: a field we cannot honour raises a ``ValueError`` that names it. No
field is silently dropped.
"""

from collections.abc import Callable

from jaxckpt.nn import TransformerConfig

HARMLESS = frozenset(
    {
        "_name_or_path", "architectures", "chunk_size_feed_forward", "dtype", "torch_dtype", "id2label",
        "label2id", "is_encoder_decoder", "model_type", "output_attentions", "output_hidden_states",
        "problem_type", "return_dict", "transformers_version", "use_cache", "bos_token_id", "eos_token_id",
        "pad_token_id", "initializer_range", "tokenizer_class", "pretraining_tp", "summary_type",
        "summary_use_proj", "summary_activation", "summary_proj_to_labels", "summary_first_dropout",
        "task_specific_params", "add_cross_attention", "reorder_and_upcast_attn",
    }
)  # fmt: skip
"""Fields that change neither the weights nor the forward pass (add_cross_attention and
reorder_and_upcast_attn are checked below: only their harmless values pass)."""

DROPOUTS = frozenset({"attention_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"})
"""Training-only fields: jaxckpt models apply no dropout; a non-zero value is noted."""

GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
_GPT2_ACTIVATION_NAMES = {"gelu_tanh": "gelu_new", "gelu": "gelu"}


def _refuse(field: str, value, why: str) -> ValueError:
    return ValueError(f"{field}={value!r} is not supported by jaxckpt ({why})")


def _check_fields(hf: dict, used: set[str], notes: list[str]) -> None:
    """Refuses every field that is neither used, harmless nor a noted dropout."""
    for field, value in hf.items():
        if field in used or field in HARMLESS:
            continue
        if field in DROPOUTS:
            if value:
                notes.append(f"{field}={value} is not applied: jaxckpt models have no dropout")
            continue
        raise _refuse(field, value, "unknown field; jaxckpt cannot tell whether it changes the numbers")
    for field, bad in (("add_cross_attention", True), ("reorder_and_upcast_attn", True)):
        if hf.get(field) == bad:
            raise _refuse(field, bad, "not implemented")


def _rope_theta(hf: dict) -> float:
    """The RoPE base from ``rope_parameters`` (transformers >= 5) or ``rope_theta`` and
    ``rope_scaling`` (older); any rope type but the default is refused."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for field, entry in (("rope_parameters", params), ("rope_scaling", scaling)):
        kind = entry.get("rope_type", entry.get("type", "default"))
        if kind != "default":
            raise _refuse(f"{field}.rope_type", kind, "only the default RoPE is implemented")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def llama_config(hf: dict, notes: list[str]) -> dict:
    """``TransformerConfig`` fields of a ``LlamaConfig`` dict."""
    if hf.get("hidden_act", "silu") != "silu":
        raise _refuse("hidden_act", hf["hidden_act"], "LLaMA's MLP is SwiGLU; only 'silu' is implemented")
    heads = hf["num_attention_heads"]
    fields = dict(
        family="llama",
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        ffn_dim=hf["intermediate_size"],
        max_len=hf.get("max_position_embeddings", 2048),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=_rope_theta(hf),
        attention_bias=bool(hf.get("attention_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )
    used = {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"}
    used |= {"head_dim", "intermediate_size", "max_position_embeddings", "rms_norm_eps", "rope_theta"}
    used |= {"rope_parameters", "rope_scaling", "attention_bias", "mlp_bias", "tie_word_embeddings"}
    _check_fields(hf, used | {"hidden_act"}, notes)
    return fields


def gpt2_config(hf: dict, notes: list[str]) -> dict:
    """``TransformerConfig`` fields of a ``GPT2Config`` dict."""
    activation = hf.get("activation_function", "gelu_new")
    if activation not in GPT2_ACTIVATIONS:
        raise _refuse("activation_function", activation, f"implemented: {', '.join(GPT2_ACTIVATIONS)}")
    if not hf.get("scale_attn_weights", True):
        raise _refuse("scale_attn_weights", False, "attention is always scaled by 1/sqrt(head_dim)")
    if hf.get("scale_attn_by_inverse_layer_idx", False):
        raise _refuse("scale_attn_by_inverse_layer_idx", True, "not implemented")
    d = hf["n_embd"]
    fields = dict(
        family="gpt2",
        vocab_size=hf["vocab_size"],
        d_model=d,
        n_layers=hf["n_layer"],
        n_heads=hf["n_head"],
        ffn_dim=hf.get("n_inner") or 4 * d,
        max_len=hf.get("n_positions", 1024),
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        activation=GPT2_ACTIVATIONS[activation],
        attention_bias=True,
        mlp_bias=True,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )
    used = {"vocab_size", "n_embd", "n_layer", "n_head", "n_inner", "n_positions", "layer_norm_epsilon"}
    used |= {"activation_function", "scale_attn_weights", "scale_attn_by_inverse_layer_idx"}
    _check_fields(hf, used | {"tie_word_embeddings", "n_ctx"}, notes)
    return fields


def _require(config: TransformerConfig, arch: str, **expected) -> None:
    for field, value in expected.items():
        if getattr(config, field) != value:
            raise ValueError(
                f"a {arch} checkpoint needs {field}={value!r}; this model has {getattr(config, field)!r}"
            )


def llama_hf_config(config: TransformerConfig) -> dict:
    """The ``config.json`` of a ``LlamaForCausalLM`` with this model's sizes."""
    _require(config, "LLaMA", norm="rms", activation="swiglu", positions="rope", causal=True)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.ffn_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_len,
        "rms_norm_eps": config.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "rope_theta": config.rope_theta,
        "attention_bias": config.attention_bias,
        "mlp_bias": config.mlp_bias,
        "attention_dropout": 0.0,
        "tie_word_embeddings": config.tie_embeddings,
        "dtype": config.param_dtype,
    }


def gpt2_hf_config(config: TransformerConfig) -> dict:
    """The ``config.json`` of a ``GPT2LMHeadModel`` with this model's sizes."""
    _require(config, "GPT-2", norm="layer", positions="learned", causal=True)
    _require(config, "GPT-2", attention_bias=True, mlp_bias=True, n_kv_heads=config.n_heads)
    _require(config, "GPT-2", head_dim=config.d_model // config.n_heads)
    if config.activation not in _GPT2_ACTIVATION_NAMES:
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
        "activation_function": _GPT2_ACTIVATION_NAMES[config.activation],
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "tie_word_embeddings": config.tie_embeddings,
        "dtype": config.param_dtype,
    }


READERS: dict[str, Callable[[dict, list[str]], dict]] = {"llama": llama_config, "gpt2": gpt2_config}
"""``model_type`` -> the function reading its config.json into TransformerConfig fields."""
