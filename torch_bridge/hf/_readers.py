"""Hugging Face ``config.json`` -> ``TransformerConfig`` fields, one reader per family.

Each reader takes the config dict (already sorted into field classes by ``_fields``)
and a list to append notes to, and returns the ``TransformerConfig`` keyword arguments
(without the dtype). Defaults and derivations are transformers' (its ``*Config`` classes
and modeling code): a field the config leaves out takes the value transformers would use,
except the sizes of a top-level config, which are required (a missing one raises
``KeyError`` with its name).
"""

from collections.abc import Mapping

from jaxckpt.nn import period
from torch_bridge.hf._common import flat_rope_params, layer_kind, read_layer_types, read_rope
from torch_bridge.hf._fields import refusal

REQUIRED = object()
"""The default of a field the config must give."""

_SIZES = dict.fromkeys(
    ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"), REQUIRED
)
LLAMA = {**_SIZES, "num_key_value_heads": None, "head_dim": None, "max_position_embeddings": 2048}
LLAMA |= {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_theta": 10000.0, "hidden_act": "silu"}
LLAMA |= {"attention_bias": False, "mlp_bias": False}
MISTRAL = LLAMA | {"num_key_value_heads": 8, "max_position_embeddings": 131072, "sliding_window": 4096}
QWEN2 = LLAMA | {"num_key_value_heads": 32, "max_position_embeddings": 32768, "use_sliding_window": False}
QWEN2 |= {"sliding_window": 4096, "max_window_layers": 28, "layer_types": None}
QWEN3 = QWEN2 | {"head_dim": 128}
GEMMA2 = LLAMA | {"num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh"}
GEMMA2 |= {"max_position_embeddings": 8192, "tie_word_embeddings": True, "query_pre_attn_scalar": 256}
GEMMA2 |= {"sliding_window": 4096, "layer_types": None, "final_logit_softcapping": 30.0}
GEMMA2 |= {"attn_logit_softcapping": 50.0}
GEMMA3 = GEMMA2 | {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216}
GEMMA3 |= {"num_hidden_layers": 26, "num_attention_heads": 8, "max_position_embeddings": 131072}
GEMMA3 |= {"final_logit_softcapping": None}
GEMMA3 |= {"attn_logit_softcapping": None, "sliding_window_pattern": 6, "rope_theta": 1e6}
GEMMA3 |= {"rope_local_base_freq": 10000.0}
PHI3 = LLAMA | {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "sliding_window": None}
PHI3 |= {"partial_rotary_factor": None, "original_max_position_embeddings": 4096}
SMOLLM3 = LLAMA | {"num_key_value_heads": 4, "max_position_embeddings": 32768, "rope_theta": 2e6}
SMOLLM3 |= {"use_sliding_window": False, "sliding_window": None, "no_rope_layers": None}
SMOLLM3 |= {"no_rope_layer_interval": 4, "tie_word_embeddings": True, "layer_types": None}
DEFAULTS: dict[str, dict] = {"llama": LLAMA, "mistral": MISTRAL, "qwen2": QWEN2, "qwen3": QWEN3}
DEFAULTS |= {"gemma2": GEMMA2, "gemma3": GEMMA3, "phi3": PHI3, "smollm3": SMOLLM3}
"""Per family, transformers' default of each field its reader reads (``REQUIRED``: none)."""

SILU = ("silu", "swish")
GELU_TANH = ("gelu_pytorch_tanh", "gelu_new")
PHI3_ROPE_ALIASES = {"su": "longrope", "yarn": "longrope"}
"""Phi-3's legacy ``rope_type`` names, which transformers' Phi3Config maps to longrope."""


class _Config:
    """A config dict with its family's defaults: ``cfg["field"]``."""

    def __init__(self, hf: Mapping, defaults: Mapping):
        self.hf, self.defaults = hf, defaults

    def __getitem__(self, field: str):
        if field in self.hf:
            return self.hf[field]
        default = self.defaults.get(field, REQUIRED)
        if default is REQUIRED:
            raise KeyError(field)
        return default


def _check_activation(cfg: _Config, field: str, allowed: tuple[str, ...], what: str) -> None:
    if cfg[field] not in allowed:
        raise refusal(field, cfg[field], f"{what}; implemented: {', '.join(allowed)}")


def _decoder(cfg: _Config, family: str) -> dict:
    """The sizes every LLaMA-like family shares."""
    heads = cfg["num_attention_heads"]
    return dict(
        family=family,
        vocab_size=cfg["vocab_size"],
        d_model=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=cfg["num_key_value_heads"] or heads,
        head_dim=cfg["head_dim"] or cfg["hidden_size"] // heads,
        ffn_dim=cfg["intermediate_size"],
        max_len=cfg["max_position_embeddings"],
        norm_eps=cfg["rms_norm_eps"],
        tie_embeddings=bool(cfg["tie_word_embeddings"]),
    )


def _rope(cfg: _Config, aliases=None) -> dict:
    """``rope_theta`` and ``rope_scaling`` of a one-RoPE config; any partial rotary refused."""
    where, params = flat_rope_params(cfg.hf)
    params.setdefault("rope_theta", cfg["rope_theta"])
    theta, scaling = read_rope(where, params, cfg.hf, theta=cfg["rope_theta"], aliases=aliases)
    fraction = params.get("partial_rotary_factor")
    if fraction not in (None, 1, 1.0):
        raise refusal(
            f"{where}.partial_rotary_factor", fraction, "partial rotary is Phi-3's, not this family's"
        )
    return dict(rope_theta=theta, rope_scaling=scaling)


def _pattern(sliding: list[bool], window, rope: list[bool] | None = None) -> dict:
    """``layer_pattern`` and ``sliding_window`` of per-layer flags (no window: all full)."""
    rope = rope or [True] * len(sliding)
    kinds = [layer_kind(s and window is not None, r) for s, r in zip(sliding, rope, strict=True)]
    window = window if any(sliding) and window else None
    return dict(layer_pattern=tuple(kinds[: period(kinds)]), sliding_window=window)


def llama_config(hf: dict, notes: list[str]) -> dict:
    """``TransformerConfig`` fields of a ``LlamaConfig`` dict (Llama 2 and 3.x, SmolLM2).

    Example:
        >>> llama_config({"vocab_size": 11, "hidden_size": 6, "intermediate_size": 5, "num_hidden_layers": 1,
        ...               "num_attention_heads": 3, "num_key_value_heads": 1}, [])["head_dim"]
        2
    """
    cfg = _Config(hf, LLAMA)
    _check_activation(cfg, "hidden_act", SILU, "LLaMA's MLP is SwiGLU")
    bias = bool(cfg["attention_bias"])
    return _decoder(cfg, "llama") | _rope(cfg) | dict(attention_bias=bias, mlp_bias=bool(cfg["mlp_bias"]))


def mistral_config(hf: dict, notes: list[str]) -> dict:
    """``TransformerConfig`` fields of a ``MistralConfig`` dict: one window for every layer."""
    cfg = _Config(hf, MISTRAL)
    _check_activation(cfg, "hidden_act", SILU, "Mistral's MLP is SwiGLU")
    fields = _decoder(cfg, "mistral") | _rope(cfg)
    return fields | _pattern([True] * fields["n_layers"], cfg["sliding_window"])


def _qwen_window(cfg: _Config, n_layers: int) -> dict:
    """Qwen2/3: the window is on only with ``use_sliding_window``; sliding layers are those
    ``layer_types`` names, else the layers from ``max_window_layers`` on."""
    window = cfg["sliding_window"] if cfg["use_sliding_window"] else None
    if cfg["layer_types"] is not None:
        sliding = read_layer_types("layer_types", cfg["layer_types"], n_layers)
    else:
        sliding = [window is not None and i >= cfg["max_window_layers"] for i in range(n_layers)]
    return _pattern(sliding, window)


def qwen2_config(hf: dict, notes: list[str]) -> dict:
    """``TransformerConfig`` fields of a ``Qwen2Config`` dict (Qwen2, Qwen2.5): biases on q, k
    and v, none on the output projection."""
    cfg = _Config(hf, QWEN2)
    _check_activation(cfg, "hidden_act", SILU, "Qwen2's MLP is SwiGLU")
    fields = _decoder(cfg, "qwen2") | _rope(cfg) | dict(attention_bias=True, attention_out_bias=False)
    return fields | _qwen_window(cfg, fields["n_layers"])


def qwen3_config(hf: dict, notes: list[str]) -> dict:
    """``TransformerConfig`` fields of a ``Qwen3Config`` dict: q/k norms; head_dim defaults to 128."""
    cfg = _Config(hf, QWEN3)
    _check_activation(cfg, "hidden_act", SILU, "Qwen3's MLP is SwiGLU")
    fields = _decoder(cfg, "qwen3") | _rope(cfg)
    fields |= dict(attention_bias=bool(cfg["attention_bias"]), qk_norm=True)
    return fields | _qwen_window(cfg, fields["n_layers"])


def _gemma(cfg: _Config, family: str) -> dict:
    """What Gemma 2 and 3 share: norms, scales, soft caps."""
    _check_activation(cfg, "hidden_activation", GELU_TANH, "Gemma's MLP is GeGLU with tanh GELU")
    softcaps = {k: cfg[k] or None for k in ("attn_logit_softcapping", "final_logit_softcapping")}
    return _decoder(cfg, family) | dict(
        attention_bias=bool(cfg["attention_bias"]),
        post_norms=True,
        embed_scale=True,
        attention_scale=float(cfg["query_pre_attn_scalar"]) ** -0.5,
        attention_softcap=softcaps["attn_logit_softcapping"],
        logits_softcap=softcaps["final_logit_softcapping"],
    )


def gemma2_config(hf: dict, notes: list[str]) -> dict:
    """``TransformerConfig`` fields of a ``Gemma2Config`` dict: sliding and full layers alternate."""
    cfg = _Config(hf, GEMMA2)
    fields = _gemma(cfg, "gemma2") | _rope(cfg)
    n = fields["n_layers"]
    if cfg["layer_types"] is None:
        sliding = [bool((i + 1) % 2) for i in range(n)]
    else:
        sliding = read_layer_types("layer_types", cfg["layer_types"], n)
    return fields | _pattern(sliding, cfg["sliding_window"])


def gemma3_config(hf: dict, notes: list[str]) -> dict:
    """``TransformerConfig`` fields of a ``Gemma3TextConfig`` dict: five sliding layers to one
    full one, q/k norms, the sliding layers' own unscaled RoPE base."""
    cfg = _Config(hf, GEMMA3)
    fields = _gemma(cfg, "gemma3") | dict(qk_norm=True) | _gemma3_rope(cfg)
    n = fields["n_layers"]
    if cfg["layer_types"] is None:
        every = cfg["sliding_window_pattern"]
        sliding = [bool((i + 1) % every) for i in range(n)]
    else:
        sliding = read_layer_types("layer_types", cfg["layer_types"], n)
    return fields | _pattern(sliding, cfg["sliding_window"])


def _gemma3_rope(cfg: _Config) -> dict:
    """Gemma 3's two RoPEs: ``rope_parameters`` per layer type (transformers >= 5), or
    ``rope_theta`` + ``rope_scaling`` for the full layers and ``rope_local_base_freq``."""
    params = dict(cfg.hf.get("rope_parameters") or {})
    kinds = ("full_attention", "sliding_attention")
    nested = any(k in params for k in kinds)
    full = dict(params.get("full_attention") or {}) if nested else params
    local = dict(params.get("sliding_attention") or {}) if nested else {}
    full |= dict(cfg.hf.get("rope_scaling") or {})
    full.setdefault("rope_theta", cfg["rope_theta"])
    local.setdefault("rope_theta", cfg["rope_local_base_freq"])
    theta, scaling = read_rope("rope_parameters.full_attention", full, cfg.hf, theta=cfg["rope_theta"])
    local_theta, local_scaling = read_rope("rope_parameters.sliding_attention", local, cfg.hf, theta=theta)
    if (local_theta, local_scaling) == (theta, scaling):  # one RoPE for every layer
        return dict(rope_theta=theta, rope_scaling=scaling, local_rope_theta=None)
    if local_scaling is not None:
        raise refusal("rope_parameters.sliding_attention.rope_type", local_scaling.kind.value,
                      "jaxckpt's sliding layers use plain RoPE")  # fmt: skip
    return dict(rope_theta=theta, rope_scaling=scaling, local_rope_theta=local_theta)


def phi3_config(hf: dict, notes: list[str]) -> dict:
    """``TransformerConfig`` fields of a ``Phi3Config`` dict (Phi-3, 3.5, 4-mini): partial
    rotary, longrope (legacy names ``su``/``yarn``), one window for every layer."""
    cfg = _Config(hf, PHI3)
    _check_activation(cfg, "hidden_act", SILU, "Phi-3's MLP is SwiGLU")
    fields = _decoder(cfg, "phi3")
    where, params = flat_rope_params(hf)
    params.setdefault("rope_theta", cfg["rope_theta"])
    fraction = params.get("partial_rotary_factor", cfg["partial_rotary_factor"])
    top = {**hf, "original_max_position_embeddings": cfg["original_max_position_embeddings"]}
    theta, scaling = read_rope(where, params, top, theta=cfg["rope_theta"], aliases=PHI3_ROPE_ALIASES)
    if scaling is not None and scaling.kind.value != "longrope":
        raise refusal(f"{where}.rope_type", scaling.kind.value, "Phi-3 implements only longrope scaling")
    fields |= dict(rope_theta=theta, rope_scaling=scaling, rotary_fraction=float(fraction or 1.0))
    return fields | _pattern([True] * fields["n_layers"], cfg["sliding_window"])


def smollm3_config(hf: dict, notes: list[str]) -> dict:
    """``TransformerConfig`` fields of a ``SmolLM3Config`` dict: NoPE layers (``no_rope_layers``
    holds 1 for a layer with RoPE, else every ``no_rope_layer_interval``-th layer has none)."""
    cfg = _Config(hf, SMOLLM3)
    _check_activation(cfg, "hidden_act", SILU, "SmolLM3's MLP is SwiGLU")
    fields = _decoder(cfg, "smollm3") | _rope(cfg)
    fields |= dict(attention_bias=bool(cfg["attention_bias"]), mlp_bias=bool(cfg["mlp_bias"]))
    n = fields["n_layers"]
    rope = cfg["no_rope_layers"]
    if rope is None:
        rope = [int((i + 1) % cfg["no_rope_layer_interval"] != 0) for i in range(n)]
    elif not isinstance(rope, list | tuple) or len(rope) != n:
        raise ValueError(f"no_rope_layers={rope!r} must hold one 0 or 1 per layer (num_hidden_layers={n})")
    window = cfg["sliding_window"] if cfg["use_sliding_window"] else None
    if cfg["layer_types"] is not None:
        sliding = read_layer_types("layer_types", cfg["layer_types"], n)
    else:
        sliding = [window is not None and not r for r in rope]
    return fields | _pattern(sliding, window, [bool(r) for r in rope])


GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
"""GPT-2's ``activation_function`` names -> jaxckpt's activations."""


def gpt2_config(hf: dict, notes: list[str]) -> dict:
    """``TransformerConfig`` fields of a ``GPT2Config`` dict.

    Example:
        >>> gpt2_config({"vocab_size": 11, "n_embd": 6, "n_layer": 1, "n_head": 3}, [])["ffn_dim"]
        24
    """
    activation = hf.get("activation_function", "gelu_new")
    if activation not in GPT2_ACTIVATIONS:
        raise refusal("activation_function", activation, f"implemented: {', '.join(GPT2_ACTIVATIONS)}")
    if not hf.get("scale_attn_weights", True):
        raise refusal("scale_attn_weights", False, "attention is always scaled by 1/sqrt(head_dim)")
    d = hf["n_embd"]
    return dict(
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
