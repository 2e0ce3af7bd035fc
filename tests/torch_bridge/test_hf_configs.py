"""config.json of every family: released configs read to the right ``TransformerConfig``, the
field classes (used, harmless, refused, unknown), strict mode, and the writers' round trip
through transformers' own config classes."""

import json
import math

import pytest

import torch_bridge
from jaxckpt._warnings import JaxckptWarning
from jaxckpt.nn import TransformerConfig
from torch_bridge._archs import ARCHITECTURES, architecture_of
from torch_bridge._config import translate
from torch_bridge.hf._fields import USED

# ---------------------------------------------------------------- released config.json files
# As published (every field name kept); long longrope factor lists are generated.

SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "hidden_act": "silu",
    "hidden_size": 576,
    "initializer_range": 0.041666666666666664,
    "intermediate_size": 1536,
    "is_llama_config": True,
    "max_position_embeddings": 8192,
    "model_type": "llama",
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_interleaved": False,
    "rope_scaling": None,
    "rope_theta": 100000,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.42.3",
    "unk_token_id": 0,
    "use_cache": True,
    "vocab_size": 49152,
}
_LLAMA3_ROPE = {
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}
LLAMA32_1B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": _LLAMA3_ROPE,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": _LLAMA3_ROPE | {"factor": 8.0},
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 24,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1",
    "use_cache": True,
    "use_mrope": False,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
MISTRAL_7B_V01 = {
    "architectures": ["MistralForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.34.0.dev0",
    "use_cache": True,
    "vocab_size": 32000,
}
MISTRAL_7B_V03 = MISTRAL_7B_V01 | {
    "attention_dropout": 0.0,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "transformers_version": "4.42.0.dev0",
    "vocab_size": 32768,
}
MISTRAL_NEMO = MISTRAL_7B_V03 | {
    "head_dim": 128,
    "hidden_size": 5120,
    "max_position_embeddings": 1024000,
    "num_hidden_layers": 40,
    "vocab_size": 131072,
}
GEMMA2_2B = {
    "architectures": ["Gemma2ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0,
    "bos_token_id": 2,
    "cache_implementation": "hybrid",
    "eos_token_id": 1,
    "final_logit_softcapping": 30.0,
    "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 2304,
    "initializer_range": 0.02,
    "intermediate_size": 9216,
    "max_position_embeddings": 8192,
    "model_type": "gemma2",
    "num_attention_heads": 8,
    "num_hidden_layers": 26,
    "num_key_value_heads": 4,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "torch_dtype": "float32",
    "transformers_version": "4.42.4",
    "use_cache": True,
    "vocab_size": 256000,
}
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": None,
    "bos_token_id": 2,
    "cache_implementation": "hybrid",
    "eos_token_id": 1,
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "initializer_range": 0.02,
    "intermediate_size": 6912,
    "max_position_embeddings": 32768,
    "model_type": "gemma3_text",
    "num_attention_heads": 4,
    "num_hidden_layers": 26,
    "num_key_value_heads": 1,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0",
    "use_cache": True,
    "vocab_size": 262144,
}
GEMMA3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0",
    "vision_config": {
        "hidden_size": 1152,
        "image_size": 896,
        "intermediate_size": 4304,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
        "vision_use_head": False,
    },
}
_PHI3_AUTO_MAP = {
    "AutoConfig": "configuration_phi3.Phi3Config",
    "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM",
}
PHI3_MINI_4K = {
    "_name_or_path": "Phi-3-mini-4k-instruct",
    "architectures": ["Phi3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": _PHI3_AUTO_MAP,
    "bos_token_id": 1,
    "embd_pdrop": 0.0,
    "eos_token_id": 32000,
    "hidden_act": "silu",
    "hidden_size": 3072,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 4096,
    "model_type": "phi3",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "original_max_position_embeddings": 4096,
    "pad_token_id": 32000,
    "resid_pdrop": 0.0,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "sliding_window": 2047,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.2",
    "use_cache": True,
    "vocab_size": 32064,
}


def _factors(n: int, start: float, step: float) -> list[float]:
    return [round(start + step * i, 4) for i in range(n)]


PHI3_MINI_128K = PHI3_MINI_4K | {
    "_name_or_path": "Phi-3-mini-128k-instruct",
    "max_position_embeddings": 131072,
    "rope_scaling": {
        "long_factor": _factors(48, 1.08, 1.2),
        "short_factor": _factors(48, 1.0, 0.05),
        "type": "longrope",
    },
    "sliding_window": 262144,
}
PHI3_MINI_128K_SU = PHI3_MINI_128K | {"rope_scaling": PHI3_MINI_128K["rope_scaling"] | {"type": "su"}}
"""The first release's name of longrope (transformers 5.24's Phi3Config itself fails on it)."""
PHI4_MINI = {
    "architectures": ["Phi3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": _PHI3_AUTO_MAP,
    "bos_token_id": 199999,
    "embd_pdrop": 0.0,
    "eos_token_id": 199999,
    "full_attn_mod": 1,
    "hidden_act": "silu",
    "hidden_size": 3072,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "interpolate_factor": 1,
    "lm_head_bias": False,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "phi3",
    "num_attention_heads": 24,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "original_max_position_embeddings": 4096,
    "pad_token_id": 199999,
    "partial_rotary_factor": 0.75,
    "resid_pdrop": 0.0,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "long_factor": _factors(48, 1.0, 1.5),
        "short_factor": _factors(48, 1.0, 0.0),
        "type": "longrope",
    },
    "rope_theta": 10000.0,
    "sliding_window": 262144,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0",
    "use_cache": True,
    "vocab_size": 200064,
}
SMOLLM3_3B = {
    "architectures": ["SmolLM3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": None,
    "eos_token_id": 128012,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 11008,
    "layer_types": ["full_attention"] * 36,
    "max_position_embeddings": 65536,
    "max_window_layers": 28,
    "mlp_bias": False,
    "model_type": "smollm3",
    "no_rope_layer_interval": 4,
    "no_rope_layers": [1, 1, 1, 0] * 9,
    "num_attention_heads": 16,
    "num_hidden_layers": 36,
    "num_key_value_heads": 4,
    "pad_token_id": 128004,
    "pretraining_tp": 2,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 5000000.0,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.54.0.dev0",
    "use_cache": False,
    "use_sliding_window": False,
    "vocab_size": 128256,
}

_GEMMA = dict(
    norm="gemma_rms", activation="geglu_tanh", post_norms=True, embed_scale=True, tie_embeddings=True
)
_LLAMA3_SCALING = dict(
    kind="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_len=8192
)
RELEASED = {
    "smollm2-135m": (
        SMOLLM2_135M,
        dict(
            family="llama",
            d_model=576,
            n_heads=9,
            n_kv_heads=3,
            head_dim=64,
            rope_theta=100000.0,
            tie_embeddings=True,
            rope_scaling=None,
        ),
    ),
    "llama3.2-1b": (
        LLAMA32_1B,
        dict(
            family="llama",
            n_layers=16,
            n_kv_heads=8,
            head_dim=64,
            tie_embeddings=True,
            rope_theta=500000.0,
            rope_scaling=_LLAMA3_SCALING,
            max_len=131072,
        ),
    ),
    "llama3.1-8b": (
        LLAMA31_8B,
        dict(
            family="llama",
            ffn_dim=14336,
            tie_embeddings=False,
            rope_scaling=_LLAMA3_SCALING | dict(factor=8.0),
        ),
    ),
    "qwen2.5-0.5b": (
        QWEN25_05B,
        dict(
            family="qwen2",
            attention_bias=True,
            attention_out_bias=False,
            head_dim=64,
            sliding_window=None,
            layer_pattern=("full",),
            norm_eps=1e-6,
        ),
    ),
    "qwen3-0.6b": (
        QWEN3_06B,
        dict(
            family="qwen3",
            head_dim=128,
            qk_norm=True,
            attention_bias=False,
            n_kv_heads=8,
            layer_pattern=("full",),
        ),
    ),
    "mistral-7b-v0.1": (
        MISTRAL_7B_V01,
        dict(family="mistral", sliding_window=4096, layer_pattern=("sliding",), head_dim=128, n_kv_heads=8),
    ),
    "mistral-7b-v0.3": (
        MISTRAL_7B_V03,
        dict(
            family="mistral", sliding_window=None, layer_pattern=("full",), rope_theta=1e6, vocab_size=32768
        ),
    ),
    "mistral-nemo": (MISTRAL_NEMO, dict(family="mistral", d_model=5120, head_dim=128)),
    "gemma2-2b": (
        GEMMA2_2B,
        dict(
            family="gemma2",
            **_GEMMA,
            head_dim=256,
            attention_scale=256**-0.5,
            attention_softcap=50.0,
            logits_softcap=30.0,
            sliding_window=4096,
            layer_pattern=("sliding", "full"),
            qk_norm=False,
        ),
    ),
    "gemma3-1b": (
        GEMMA3_1B,
        dict(
            family="gemma3",
            **_GEMMA,
            qk_norm=True,
            n_kv_heads=1,
            sliding_window=512,
            layer_pattern=("sliding",) * 5 + ("full",),
            rope_theta=1e6,
            local_rope_theta=10000.0,
            rope_scaling=None,
            attention_softcap=None,
            logits_softcap=None,
            vocab_size=262144,
        ),
    ),
    "gemma3-4b": (
        GEMMA3_4B,
        dict(
            family="gemma3",
            **_GEMMA,
            qk_norm=True,
            d_model=2560,
            n_layers=34,
            n_heads=8,
            n_kv_heads=4,
            head_dim=256,
            vocab_size=262208,
            sliding_window=1024,
            layer_pattern=("sliding",) * 5 + ("full",),
            local_rope_theta=10000.0,
            rope_scaling=dict(kind="linear", factor=8.0),
            max_len=131072,
        ),
    ),
    "phi3-mini-4k": (
        PHI3_MINI_4K,
        dict(
            family="phi3",
            head_dim=96,
            rotary_fraction=1.0,
            sliding_window=2047,
            layer_pattern=("sliding",),
            rope_scaling=None,
            norm_eps=1e-5,
        ),
    ),
    "phi3-mini-128k": (PHI3_MINI_128K, dict(family="phi3", sliding_window=262144, max_len=131072)),
    "phi4-mini": (
        PHI4_MINI,
        dict(family="phi3", rotary_fraction=0.75, head_dim=128, n_kv_heads=8, tie_embeddings=True),
    ),
    "smollm3-3b": (
        SMOLLM3_3B,
        dict(
            family="smollm3",
            rope_theta=5e6,
            tie_embeddings=True,
            sliding_window=None,
            layer_pattern=("full", "full", "full", "full_nope"),
        ),
    ),
}
"""Name -> (config.json, the TransformerConfig fields it must give)."""


def _expected(value):
    return value.to_dict() if hasattr(value, "to_dict") else value


@pytest.mark.parametrize("name", RELEASED)
def test_released_configs_read_without_warnings(name):
    hf, expected = RELEASED[name]
    config = torch_bridge.config_from_hf(hf)  # any JaxckptWarning fails the test
    got = {k: _expected(getattr(config, k)) for k in expected}
    want = {k: v if k != "rope_scaling" or v is None else dict(v) for k, v in expected.items()}
    if got.get("rope_scaling") is not None:
        assert got["rope_scaling"].items() >= want["rope_scaling"].items()
        got.pop("rope_scaling"), want.pop("rope_scaling")
    assert got == want


def test_longrope_factors_and_original_length():
    scaling = torch_bridge.config_from_hf(PHI3_MINI_128K).rope_scaling
    assert scaling.kind == "longrope" and scaling.original_max_len == 4096
    assert len(scaling.short_factor) == len(scaling.long_factor) == 96 // 2
    assert torch_bridge.config_from_hf(PHI3_MINI_128K_SU).rope_scaling == scaling
    phi4 = torch_bridge.config_from_hf(PHI4_MINI)
    assert len(phi4.rope_scaling.long_factor) == phi4.rotary_dim // 2 == 48


def test_notes_for_the_multimodal_gemma3_and_nonzero_dropout(tmp_path):
    found = translate(GEMMA3_4B)
    assert any("only its language model" in note for note in found.notes) and found.unknown == []
    noted = translate(SMOLLM2_135M | {"attention_dropout": 0.1})
    assert noted.notes == ["attention_dropout=0.1 is not applied: jaxckpt models have no dropout"]


# ---------------------------------------------------------------------------- the field classes


def _tiny_llama(**changes) -> dict:
    base = {"model_type": "llama", "vocab_size": 11, "hidden_size": 12, "intermediate_size": 7}
    return base | {"num_hidden_layers": 1, "num_attention_heads": 3, "num_key_value_heads": 1} | changes


def _file(tmp_path, hf: dict):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    return path


def test_an_unknown_field_warns_once_and_strict_refuses_it(tmp_path):
    path = _file(tmp_path, _tiny_llama(fancy_gate=3, other_knob="x"))
    with pytest.warns(JaxckptWarning) as caught:
        config = torch_bridge.config_from_hf(path)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert str(path) in message and "fancy_gate=3" in message and "other_knob='x'" in message
    assert config.d_model == 12
    with pytest.raises(
        ValueError, match=r"config\.json: unknown config field\(s\) fancy_gate=3.*strict=True"
    ):
        torch_bridge.config_from_hf(path, strict=True)


def test_unknown_rope_keys_are_unknown_fields():
    hf = _tiny_llama(rope_parameters={"rope_type": "default", "rope_theta": 10.0, "mrope_section": [1, 2]})
    with pytest.warns(JaxckptWarning, match=r"rope_parameters\.mrope_section"):
        found = translate(hf)
    assert found.unknown == ["rope_parameters.mrope_section=[1, 2]"]


REFUSED = [
    (dict(quantization_config={"bits": 4}), "quantization_config", "quantized weights"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), r"rope_scaling\.rope_type='dynamic'", "NTK"),
    (dict(rope_parameters={"rope_type": "mystery"}), r"rope_parameters\.rope_type='mystery'", "implemented"),
    (dict(rope_interleaved=True), "rope_interleaved=True", "GPT-J"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5", "partial rotary"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'", "SwiGLU"),
    (dict(sliding_window=16), "sliding_window=16", "sliding window"),
    (dict(per_layer_config={"0": {}}), "per_layer_config", "per-layer"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention=True", "non-causal"),
]


@pytest.mark.parametrize("changes, field, reason", REFUSED, ids=[r[1].split("=")[0] for r in REFUSED])
def test_refused_fields_name_the_file_the_field_and_the_reason(tmp_path, changes, field, reason):
    path = _file(tmp_path, _tiny_llama(**changes))
    with pytest.raises(ValueError, match=rf"{tmp_path.name}.config\.json: .*{field}.*{reason}"):
        torch_bridge.config_from_hf(path)


def test_refused_family_features(tmp_path):
    gemma3 = GEMMA3_1B | {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}}
    with pytest.raises(ValueError, match=r"sliding_attention\.rope_type='linear'"):
        torch_bridge.config_from_hf(gemma3)
    with pytest.raises(ValueError, match=r"layer_types\[1\]='chunked_attention'"):
        torch_bridge.config_from_hf(GEMMA2_2B | {"layer_types": ["full_attention", "chunked_attention"] * 13})
    with pytest.raises(ValueError, match=r"rope_scaling\.rope_type='linear'.*longrope"):
        torch_bridge.config_from_hf(PHI3_MINI_4K | {"rope_scaling": {"type": "linear", "factor": 2.0}})
    with pytest.raises(ValueError, match=r"text_config=3"):
        torch_bridge.config_from_hf(GEMMA3_4B | {"text_config": 3})


def test_missing_field_and_unknown_model_type_name_the_file(tmp_path):
    hf = _tiny_llama()
    del hf["hidden_size"]
    with pytest.raises(ValueError, match=r"config\.json: required field 'hidden_size' is missing"):
        torch_bridge.config_from_hf(_file(tmp_path, hf))
    with pytest.raises(
        ValueError, match=r"config\.json: unknown architecture model_type='bert'.*qwen2.*gemma3_text"
    ):
        torch_bridge.config_from_hf(_file(tmp_path, {"model_type": "bert"}))


class _Recording(dict):
    """A dict that records the keys read from it."""

    def __init__(self, *args):
        super().__init__(*args)
        self.read: set[str] = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)


def test_every_field_a_reader_reads_is_in_its_used_class():
    for name, (hf, _) in RELEASED.items():
        family = architecture_of(hf).name
        inner = hf.get("text_config", hf) | {"model_type": family}
        recording = _Recording(inner)
        ARCHITECTURES[family].read(recording, [])
        assert recording.read <= USED[family] | {"model_type"}, name


# ------------------------------------------------------------------------- derivations


def test_layer_patterns_are_derived_as_transformers_does():
    qwen = QWEN25_05B | {"use_sliding_window": True, "sliding_window": 7, "max_window_layers": 20}
    cfg = torch_bridge.config_from_hf(qwen)
    assert cfg.layer_pattern == ("full",) * 20 + ("sliding",) * 4 and cfg.sliding_window == 7
    smol = SMOLLM3_3B | {"num_hidden_layers": 6, "no_rope_layers": None, "layer_types": None}
    smol |= {"no_rope_layer_interval": 3}
    assert torch_bridge.config_from_hf(smol).layer_pattern == ("full", "full", "full_nope")
    gemma = GEMMA3_1B | {"num_hidden_layers": 5, "sliding_window_pattern": 2}
    assert torch_bridge.config_from_hf(gemma).layer_pattern == ("sliding", "full")
    odd = GEMMA2_2B | {"num_hidden_layers": 3, "layer_types": ["full_attention"] + ["sliding_attention"] * 2}
    assert torch_bridge.config_from_hf(odd).layer_pattern == ("full", "sliding", "sliding")
    qwen3 = torch_bridge.config_from_hf({k: v for k, v in QWEN3_06B.items() if k != "head_dim"})
    assert qwen3.head_dim == 128  # Qwen3Config's default, not hidden_size / heads
    assert math.isclose(
        torch_bridge.config_from_hf(GEMMA2_2B | {"query_pre_attn_scalar": 144}).attention_scale, 1 / 12
    )


# ------------------------------------------------------------------- through transformers

transformers_only = pytest.mark.torch


def _transformers_dict(hf: dict) -> dict:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoConfig.for_model(**hf).to_dict()


@transformers_only
@pytest.mark.parametrize("name", RELEASED)
def test_transformers_own_config_reads_the_same(name):
    hf, _ = RELEASED[name]
    assert torch_bridge.config_from_hf(_transformers_dict(hf)) == torch_bridge.config_from_hf(hf)


ARCHITECTURE = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "hidden_act",
    "hidden_activation",
    "attention_bias",
    "mlp_bias",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "no_rope_layers",
)
"""The transformers config attributes that decide the architecture (when a family has them)."""


def _architecture(config, family: str) -> dict:
    out = {k: getattr(config, k) for k in ARCHITECTURE if k in USED[family] and hasattr(config, k)}
    out["head_dim"] = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = {k: v for k, v in config.rope_parameters.items() if v is not None and k != "type"}
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if family == "qwen2" or family == "qwen3" or family == "smollm3":
        window = window if config.use_sliding_window else None
    if family in ("mistral", "phi3"):
        kinds = ["sliding_attention" if window else "full_attention"] * config.num_hidden_layers
    kinds = [k if window else "full_attention" for k in kinds]
    out |= dict(rope=rope, layer_types=kinds, sliding_window=window if "sliding_attention" in kinds else None)
    if family == "phi3":
        out["original_max_position_embeddings"] = config.original_max_position_embeddings
    return out


@transformers_only
@pytest.mark.parametrize("name", RELEASED)
def test_written_configs_read_back_the_same_in_transformers_and_here(name):
    transformers = pytest.importorskip("transformers")
    hf, _ = RELEASED[name]
    config = torch_bridge.config_from_hf(hf)
    written = ARCHITECTURES[config.family].hf_config(config)
    theirs = transformers.AutoConfig.for_model(**written)
    assert torch_bridge.config_from_hf(theirs.to_dict()) == config
    original = transformers.AutoConfig.for_model(**hf)
    original = original.get_text_config() if hf["model_type"] == "gemma3" else original
    assert _architecture(theirs, config.family) == _architecture(original, config.family)


@pytest.mark.parametrize("family", sorted(a.name for a in ARCHITECTURES.values() if a.model_type))
def test_every_family_has_a_reader_and_a_writer_and_a_model_type(family):
    arch = ARCHITECTURES[family]
    assert arch.read is not None and arch.hf_config is not None and arch.model_type == family
    assert TransformerConfig(family=family).family == family


@transformers_only
def test_gemma3_with_one_rope_for_every_layer_round_trips():
    transformers = pytest.importorskip("transformers")
    config = torch_bridge.config_from_hf(GEMMA3_1B).replace(
        rope_scaling={"kind": "linear", "factor": 2.0}, local_rope_theta=None
    )
    written = ARCHITECTURES["gemma3"].hf_config(config)
    assert written["rope_parameters"]["sliding_attention"]["rope_type"] == "linear"
    assert torch_bridge.config_from_hf(transformers.AutoConfig.for_model(**written).to_dict()) == config
