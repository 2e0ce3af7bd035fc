"""The fields of every named ``TransformerConfig`` preset, as plain data.

One entry per preset. The published models take their sizes from their Hugging Face
``config.json``; ``tests/test_presets.py`` checks each parameter count against the
published one.
"""

_LLAMA2 = dict(family="llama", vocab_size=32000, max_len=4096, dtype="bfloat16", norm_eps=1e-5)

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
}
"""Preset name -> ``TransformerConfig`` fields."""
