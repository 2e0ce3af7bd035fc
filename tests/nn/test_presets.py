"""The presets of published models: each one's parameter count is the released checkpoint's, and
its fields are those of the model's Hugging Face ``config.json``.

Three oracles: the published counts written below; a by-hand reading of each ``config.json``
(``hf_fields``); and, with torch, transformers itself, which builds the model from the same
dict on the meta device (no memory) and counts its parameters.
"""

import math
import os

import jax
import pytest
from flax import nnx

from jaxckpt.nn import PRESETS, Transformer

# The model's config.json (for gemma3-4b: the text_config of google/gemma-3-4b-pt), with the
# fields it leaves to transformers' defaults written out; ids, dropouts and other fields that
# change neither the weights nor the forward pass left off.
HF_CONFIGS: dict[str, dict] = {
    "llama3.2-1b": dict(  # meta-llama/Llama-3.2-1B
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        attention_bias=False, mlp_bias=False, tie_word_embeddings=True,
    ),
    "llama3.2-3b": dict(  # meta-llama/Llama-3.2-3B
        model_type="llama", vocab_size=128256, hidden_size=3072, intermediate_size=8192,
        num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        attention_bias=False, mlp_bias=False, tie_word_embeddings=True,
    ),
    "llama3.1-8b": dict(  # meta-llama/Llama-3.1-8B
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
    ),
    "llama3.3-70b": dict(  # meta-llama/Llama-3.3-70B-Instruct
        model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
    ),
    "qwen2.5-0.5b": dict(  # Qwen/Qwen2.5-0.5B
        model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
        use_sliding_window=False, sliding_window=32768, max_window_layers=24, tie_word_embeddings=True,
    ),
    "qwen2.5-7b": dict(  # Qwen/Qwen2.5-7B
        model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=1000000.0,
        use_sliding_window=False, sliding_window=131072, max_window_layers=28, tie_word_embeddings=False,
    ),
    "qwen3-0.6b": dict(  # Qwen/Qwen3-0.6B
        model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None,
        attention_bias=False, use_sliding_window=False, sliding_window=None, max_window_layers=28,
        tie_word_embeddings=True,
    ),
    "qwen3-8b": dict(  # Qwen/Qwen3-8B
        model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None,
        attention_bias=False, use_sliding_window=False, sliding_window=None, max_window_layers=36,
        tie_word_embeddings=False,
    ),
    "mistral-7b": dict(  # mistralai/Mistral-7B-v0.3
        model_type="mistral", vocab_size=32768, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000.0, sliding_window=None,
        tie_word_embeddings=False,
    ),
    "gemma2-2b": dict(  # google/gemma-2-2b
        model_type="gemma2", vocab_size=256000, hidden_size=2304, intermediate_size=9216,
        num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0,
        hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, sliding_window=4096,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, attention_bias=False,
        tie_word_embeddings=True,
    ),
    "gemma3-1b": dict(  # google/gemma-3-1b-pt
        model_type="gemma3_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
        num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
        rope_local_base_freq=10000.0, rope_scaling=None, hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=256, sliding_window=512, sliding_window_pattern=6,
        attn_logit_softcapping=None, final_logit_softcapping=None, attention_bias=False,
        tie_word_embeddings=True,
    ),
    "gemma3-4b": dict(  # google/gemma-3-4b-pt, text_config (the language model only)
        model_type="gemma3_text", vocab_size=262208, hidden_size=2560, intermediate_size=10240,
        num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=1000000.0,
        rope_local_base_freq=10000.0, rope_scaling=dict(rope_type="linear", factor=8.0),
        hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, sliding_window=1024,
        sliding_window_pattern=6, attn_logit_softcapping=None, final_logit_softcapping=None,
        attention_bias=False, tie_word_embeddings=True,
    ),
    "phi3-mini": dict(  # microsoft/Phi-3-mini-4k-instruct
        model_type="phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
        max_position_embeddings=4096, original_max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_theta=10000.0, rope_scaling=None, sliding_window=2047, attention_bias=False,
        tie_word_embeddings=False,
    ),
    "smollm2-135m": dict(  # HuggingFaceTB/SmolLM2-135M
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0, rope_scaling=None,
        attention_bias=False, mlp_bias=False, tie_word_embeddings=True,
    ),
    "smollm2-1.7b": dict(  # HuggingFaceTB/SmolLM2-1.7B
        model_type="llama", vocab_size=49152, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=32,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=130000.0, rope_scaling=None,
        attention_bias=False, mlp_bias=False, tie_word_embeddings=True,
    ),
}  # fmt: skip

# The parameters of the released checkpoint: its safetensors total_size over the dtype's size,
# a tied embedding counted once (the model cards round these).
PUBLISHED: dict[str, int] = {
    "llama3.2-1b": 1_235_814_400,  # 1.24B
    "llama3.2-3b": 3_212_749_824,  # 3.21B
    "llama3.1-8b": 8_030_261_248,  # 8.03B, llama3-8b's sizes
    "llama3.3-70b": 70_553_706_496,  # 70.6B (141,107,412,992 bytes of bfloat16)
    "qwen2.5-0.5b": 494_032_768,  # 0.49B
    "qwen2.5-7b": 7_615_616_512,  # 7.61B
    "qwen3-0.6b": 596_049_920,  # 0.6B (0.44B without the embedding)
    "qwen3-8b": 8_190_735_360,  # 8.2B (6.95B without the embeddings)
    "mistral-7b": 7_248_023_552,  # 7.25B
    "gemma2-2b": 2_614_341_888,  # 2.61B
    "gemma3-1b": 999_885_952,  # 1B
    "gemma3-4b": 3_880_263_168,  # the language model of the 4.3B image-text model
    "phi3-mini": 3_821_079_552,  # 3.8B
    "smollm2-135m": 134_515_008,  # 135M
    "smollm2-1.7b": 1_711_376_384,  # 1.7B
}
NAMES = tuple(PUBLISHED)

_FAMILIES = {
    "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral", "gemma2": "gemma2",
    "gemma3_text": "gemma3", "phi3": "phi3",
}  # fmt: skip


_ROPE_NAMES = {"rope_type": "kind", "original_max_position_embeddings": "original_max_len"}


def param_count(name: str) -> int:
    """The parameters of the preset's model, built abstractly (nothing allocated)."""
    cfg = PRESETS[name]
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    return sum(math.prod(p.shape) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))


def hf_sliding(hf: dict) -> list[bool]:
    """Per layer, whether Hugging Face's model attends through its sliding window."""
    n, kind = hf["num_hidden_layers"], hf["model_type"]
    if kind == "gemma2":
        return [i % 2 == 0 for i in range(n)]
    if kind == "gemma3_text":
        return [(i + 1) % hf["sliding_window_pattern"] != 0 for i in range(n)]
    if kind in ("qwen2", "qwen3"):
        return [hf["use_sliding_window"] and i >= hf["max_window_layers"] for i in range(n)]
    return [hf.get("sliding_window") is not None] * n  # llama has none; mistral and phi3: every layer


def hf_fields(hf: dict) -> dict:
    """The ``TransformerConfig`` fields that ``hf`` (a config.json) means, read by hand."""
    kind = hf["model_type"]
    gemma = kind.startswith("gemma")
    heads = hf["num_attention_heads"]
    sliding = any(hf_sliding(hf))
    scaling = hf.get("rope_scaling")
    return dict(
        family=_FAMILIES[kind],
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=hf["num_key_value_heads"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        ffn_dim=hf["intermediate_size"],
        max_len=hf["max_position_embeddings"],
        norm_eps=hf["rms_norm_eps"],
        rope_theta=hf["rope_theta"],
        rope_scaling=None if scaling is None else {_ROPE_NAMES.get(k, k): v for k, v in scaling.items()},
        local_rope_theta=hf.get("rope_local_base_freq"),
        rotary_fraction=hf.get("partial_rotary_factor", 1.0),
        # Qwen2's q, k and v projections always have a bias, its output projection none.
        attention_bias=kind == "qwen2" or hf.get("attention_bias", False),
        attention_out_bias=kind != "qwen2" and hf.get("attention_bias", False),
        mlp_bias=hf.get("mlp_bias", False),
        tie_embeddings=hf["tie_word_embeddings"],
        sliding_window=hf["sliding_window"] if sliding else None,
        layer_sliding=hf_sliding(hf),
        norm="gemma_rms" if gemma else "rms",
        activation="geglu_tanh" if gemma else "swiglu",
        qk_norm=kind in ("qwen3", "gemma3_text"),
        post_norms=gemma,
        embed_scale=gemma,
        attention_scale=hf["query_pre_attn_scalar"] ** -0.5 if gemma else None,
        attention_softcap=hf.get("attn_logit_softcapping"),
        logits_softcap=hf.get("final_logit_softcapping"),
        dtype="bfloat16",
        param_dtype="float32",
    )


def test_every_published_preset_is_here():
    assert set(HF_CONFIGS) == set(PUBLISHED)
    assert set(PUBLISHED) <= set(PRESETS)


@pytest.mark.parametrize("name", NAMES)
def test_param_count_is_the_published_one(name):
    assert param_count(name) == PUBLISHED[name]


@pytest.mark.parametrize("name", NAMES)
def test_preset_mirrors_the_hf_config(name):
    cfg = PRESETS[name]
    want = hf_fields(HF_CONFIGS[name])
    got = {field: getattr(cfg, field) for field in want if field != "layer_sliding"}
    got["layer_sliding"] = [kind.sliding for kind in cfg.layer_kinds]
    got["rope_scaling"] = cfg.rope_scaling and cfg.rope_scaling.to_dict()
    assert got == want
    assert all(kind.rope for kind in cfg.layer_kinds)


# ----------------------------------------------------------------------------- transformers


def _transformers():
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    torch = pytest.importorskip("torch")
    return torch, pytest.importorskip("transformers")


def hf_config(name: str):
    _, transformers = _transformers()
    fields = dict(HF_CONFIGS[name])
    return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)


@pytest.mark.torch
@pytest.mark.parametrize("name", NAMES)
def test_transformers_counts_the_same(name):
    """transformers builds the released model from the same dict, on the meta device."""
    torch, transformers = _transformers()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(name))
    count = sum(p.numel() for p in model.parameters())
    assert count == PUBLISHED[name]
    assert param_count(name) == count


@pytest.mark.torch
@pytest.mark.parametrize("name", NAMES)
def test_transformers_layer_types_are_ours(name):
    """Which layers slide, and the window, as transformers reads the config."""
    hf = hf_config(name)
    types = getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers
    window = getattr(hf, "sliding_window", None)
    if window is not None and not hasattr(hf, "layer_types"):  # mistral, phi3: every layer slides
        types = ["sliding_attention"] * hf.num_hidden_layers
    cfg = PRESETS[name]
    assert [kind.sliding for kind in cfg.layer_kinds] == [t == "sliding_attention" for t in types]
    assert cfg.sliding_window == (window if "sliding_attention" in types else None)
