"""The fields of every named ``TransformerConfig`` preset, as plain data.

One entry per preset. The published models take their sizes from their Hugging Face
``config.json``; ``tests/nn/test_presets.py`` checks each parameter count against the
published one.
"""

_LLAMA2 = dict(family="llama", vocab_size=32000, max_len=4096, dtype="bfloat16", norm_eps=1e-5)
# Llama 3.1 / 3.2: a 128k context by the "llama3" RoPE scaling of a model trained at 8192.
_LLAMA31 = dict(family="llama", vocab_size=128256, max_len=131072, rope_theta=500000.0, dtype="bfloat16")
_LLAMA3_SCALING = dict(kind="llama3", low_freq_factor=1.0, high_freq_factor=4.0, original_max_len=8192)
# Qwen2.5: biases on q, k and v but not on the output projection; use_sliding_window is false.
_QWEN25 = dict(
    family="qwen2",
    rope_theta=1000000.0,
    norm_eps=1e-6,
    attention_bias=True,
    attention_out_bias=False,
    dtype="bfloat16",
)
_QWEN3 = dict(
    family="qwen3",
    vocab_size=151936,
    head_dim=128,
    max_len=40960,
    rope_theta=1000000.0,
    norm_eps=1e-6,
    qk_norm=True,
    dtype="bfloat16",
)
# Gemma 2 and 3: (1 + w) RMS norms, GeGLU, norms after attention and MLP too, embeddings
# times sqrt(d_model), q.k scaled by query_pre_attn_scalar ** -0.5, tied head.
_GEMMA = dict(
    head_dim=256,
    norm_eps=1e-6,
    post_norms=True,
    embed_scale=True,
    attention_scale=256**-0.5,
    tie_embeddings=True,
    dtype="bfloat16",
)
# Gemma 3: five sliding layers then one full one; local layers use an unscaled 10k RoPE base.
_GEMMA3 = dict(
    **_GEMMA,
    family="gemma3",
    rope_theta=1000000.0,
    local_rope_theta=10000.0,
    qk_norm=True,
    layer_pattern=("sliding",) * 5 + ("full",),
)
_SMOLLM2 = dict(family="llama", vocab_size=49152, max_len=8192, tie_embeddings=True, dtype="bfloat16")

PRESET_FIELDS: dict[str, dict] = {
    "tiny": dict(n_kv_heads=2),
    "small": dict(d_model=512, n_layers=8, n_heads=8, ffn_dim=1376, max_len=2048),
    "gpt2": dict(
        family="gpt2",
        vocab_size=50257,
        d_model=768,
        n_layers=12,
        n_heads=12,
        ffn_dim=3072,
        attention_bias=True,
        mlp_bias=True,
        tie_embeddings=True,
    ),
    "llama2-7b": dict(**_LLAMA2, d_model=4096, n_layers=32, n_heads=32, ffn_dim=11008),
    "llama2-13b": dict(**_LLAMA2, d_model=5120, n_layers=40, n_heads=40, ffn_dim=13824),
    "llama3-8b": dict(
        family="llama",
        vocab_size=128256,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        max_len=8192,
        rope_theta=500000.0,
        dtype="bfloat16",
    ),
    # meta-llama/Llama-3.2-1B
    "llama3.2-1b": dict(
        **_LLAMA31,
        d_model=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        head_dim=64,
        ffn_dim=8192,
        rope_scaling=dict(**_LLAMA3_SCALING, factor=32.0),
        tie_embeddings=True,
    ),
    # meta-llama/Llama-3.2-3B
    "llama3.2-3b": dict(
        **_LLAMA31,
        d_model=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        head_dim=128,
        ffn_dim=8192,
        rope_scaling=dict(**_LLAMA3_SCALING, factor=32.0),
        tie_embeddings=True,
    ),
    # meta-llama/Llama-3.1-8B
    "llama3.1-8b": dict(
        **_LLAMA31,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        rope_scaling=dict(**_LLAMA3_SCALING, factor=8.0),
    ),
    # meta-llama/Llama-3.3-70B-Instruct (the long-context benchmark's 70B)
    "llama3.3-70b": dict(
        **_LLAMA31,
        d_model=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim=28672,
        rope_scaling=dict(**_LLAMA3_SCALING, factor=8.0),
    ),
    # Qwen/Qwen2.5-0.5B
    "qwen2.5-0.5b": dict(
        **_QWEN25,
        vocab_size=151936,
        d_model=896,
        n_layers=24,
        n_heads=14,
        n_kv_heads=2,
        ffn_dim=4864,
        max_len=32768,
        tie_embeddings=True,
    ),
    # Qwen/Qwen2.5-7B
    "qwen2.5-7b": dict(
        **_QWEN25,
        vocab_size=152064,
        d_model=3584,
        n_layers=28,
        n_heads=28,
        n_kv_heads=4,
        ffn_dim=18944,
        max_len=131072,
    ),
    # Qwen/Qwen3-0.6B
    "qwen3-0.6b": dict(
        **_QWEN3, d_model=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=3072, tie_embeddings=True
    ),
    # Qwen/Qwen3-8B
    "qwen3-8b": dict(**_QWEN3, d_model=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=12288),
    # mistralai/Mistral-7B-v0.3: v0.3, not v0.1 (vocab 32000, a 4096 sliding window): the
    # 32768-token vocabulary, full attention everywhere.
    "mistral-7b": dict(
        family="mistral",
        vocab_size=32768,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        max_len=32768,
        rope_theta=1000000.0,
        dtype="bfloat16",
    ),
    # google/gemma-2-2b: sliding (4096) and full layers alternate, soft caps on both logits.
    "gemma2-2b": dict(
        **_GEMMA,
        family="gemma2",
        vocab_size=256000,
        d_model=2304,
        n_layers=26,
        n_heads=8,
        n_kv_heads=4,
        ffn_dim=9216,
        max_len=8192,
        sliding_window=4096,
        layer_pattern=("sliding", "full"),
        attention_softcap=50.0,
        logits_softcap=30.0,
    ),
    # google/gemma-3-1b-pt: no RoPE scaling.
    "gemma3-1b": dict(
        **_GEMMA3,
        vocab_size=262144,
        d_model=1152,
        n_layers=26,
        n_heads=4,
        n_kv_heads=1,
        ffn_dim=6912,
        max_len=32768,
        sliding_window=512,
    ),
    # google/gemma-3-4b-pt, its text model (text_config): linear RoPE scaling x8 on the full layers.
    "gemma3-4b": dict(
        **_GEMMA3,
        vocab_size=262208,
        d_model=2560,
        n_layers=34,
        n_heads=8,
        n_kv_heads=4,
        ffn_dim=10240,
        max_len=131072,
        sliding_window=1024,
        rope_scaling=dict(kind="linear", factor=8.0),
    ),
    # microsoft/Phi-3-mini-4k-instruct: every layer sliding (2047 keys); RoPE on every head
    # dim (no partial_rotary_factor), no scaling (the 128k variant's is longrope).
    "phi3-mini": dict(
        family="phi3",
        vocab_size=32064,
        d_model=3072,
        n_layers=32,
        n_heads=32,
        ffn_dim=8192,
        max_len=4096,
        sliding_window=2047,
        layer_pattern=("sliding",),
        dtype="bfloat16",
    ),
    # HuggingFaceTB/SmolLM2-135M (a LlamaForCausalLM)
    "smollm2-135m": dict(
        **_SMOLLM2, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_dim=1536, rope_theta=100000.0
    ),
    # HuggingFaceTB/SmolLM2-1.7B (a LlamaForCausalLM)
    "smollm2-1.7b": dict(
        **_SMOLLM2, d_model=2048, n_layers=24, n_heads=32, ffn_dim=8192, rope_theta=130000.0
    ),
}
"""Preset name -> ``TransformerConfig`` fields."""
