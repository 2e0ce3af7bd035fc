"""Small configs of every family beyond LLaMA-2 and GPT-2, for the planner's accuracy: one
home for ``tests/plan/test_plan_model.py`` and ``benchmarks/speed/bench_plan_families.py``.

Each family's preset is shrunk to odd sizes (head_dim != d_model / n_heads, GQA) in the
proportions of a real model (T = 1536 in 512-key tiles: the tiles do not dominate), its
own features kept: tied heads, rope scalings, biases, q/k norm, windows, patterns.
"""

from jaxckpt import nn

SIZES = dict(d_model=232, n_heads=4, n_kv_heads=2, head_dim=56, ffn_dim=616, vocab_size=1031)

FAMILIES = {
    "llama3": ("llama3.2-1b", dict(n_layers=3)),
    "smollm2": ("smollm2-135m", dict(n_layers=3)),
    "qwen2.5": ("qwen2.5-0.5b", dict(n_layers=3)),  # q/k/v bias, no o bias
    "qwen3": ("qwen3-0.6b", dict(n_layers=3)),  # q/k norm
    "mistral": ("mistral-7b", dict(n_layers=3)),
    # (1 + w) norms, post norms, GeGLU, embedding scale, both soft caps, sliding / full
    "gemma2": ("gemma2-2b", dict(n_layers=4, sliding_window=600)),
    # and q/k norm, five sliding layers to one full one, a local RoPE base
    "gemma3": ("gemma3-1b", dict(n_layers=7, sliding_window=600)),
    # every layer sliding, partial rotary (24 of 56 dims)
    "phi3": ("phi3-mini", dict(n_layers=3, sliding_window=601, rotary_fraction=0.43, n_kv_heads=4)),
    # NoPE every second layer (no preset: SmolLM2's sizes)
    "smollm3": ("smollm2-135m", dict(family="smollm3", n_layers=4, layer_pattern=("full", "full_nope"))),
}
"""Family -> (preset, overrides of ``SIZES``)."""

BATCH, SEQ = 2, 1536


def family_config(family: str, dtype: str = "bfloat16") -> nn.TransformerConfig:
    """The family's small config in ``dtype`` (the presets compute in bf16)."""
    preset, overrides = FAMILIES[family]
    return nn.TransformerConfig.preset(preset, **{**SIZES, **overrides, "dtype": dtype})
