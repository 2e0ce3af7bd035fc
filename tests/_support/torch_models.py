"""Tiny random PyTorch models for the torch_bridge tests, and every way of saving them.

Built offline (no hub access): a LLaMA with GQA (5 query heads, 1 kv head, untied
head), a GPT-2 (tied head) and the seed article's ``FlashAttentionWithCheckpoint``
block computed with exact softmax attention.
"""

import json
import math
import os
from pathlib import Path

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
import transformers

VOCAB = 301  # >= 256 so that byte-level fine-tuning works, odd so axes cannot mix up
LAYERS = 3


def tiny_llama(seed: int = 0, dtype=torch.float32) -> transformers.LlamaForCausalLM:
    """LLaMA: 5 query heads and 1 kv head (GQA), head_dim 6, untied head."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=25,
        intermediate_size=37,
        num_hidden_layers=LAYERS,
        num_attention_heads=5,
        num_key_value_heads=1,
        head_dim=6,
        max_position_embeddings=64,
        rope_theta=500.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    return _randomized(transformers.LlamaForCausalLM(config), dtype)


def tiny_gpt2(seed: int = 0, dtype=torch.float32) -> transformers.GPT2LMHeadModel:
    """GPT-2: 3 heads of 5, tied head, gelu_new."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=15, n_layer=LAYERS, n_head=3, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    return _randomized(transformers.GPT2LMHeadModel(config), dtype)


def _randomized(model, dtype):
    """Norm weights and biases are 1 and 0 at init: randomise them so that a mix-up shows."""
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model.to(dtype).eval()


class SeedBlock(torch.nn.Module):
    """The seed's ``FlashAttentionWithCheckpoint`` with its blockwise loop replaced by exact
    softmax attention (the seed's loop normalises by a sum of log-sum-exps: it is wrong).

    Same parameter names and ``_forward_impl`` as the article: pre-LN, ``x + attn``,
    ``x + ffn``, exact GELU, non-causal attention.
    """

    def __init__(self, hidden_dim: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_dim // num_heads
        self.q_proj = torch.nn.Linear(hidden_dim, hidden_dim)
        self.k_proj = torch.nn.Linear(hidden_dim, hidden_dim)
        self.v_proj = torch.nn.Linear(hidden_dim, hidden_dim)
        self.out_proj = torch.nn.Linear(hidden_dim, hidden_dim)
        self.ln1 = torch.nn.LayerNorm(hidden_dim)
        self.ln2 = torch.nn.LayerNorm(hidden_dim)
        self.ffn = torch.nn.Sequential(
            torch.nn.Linear(hidden_dim, hidden_dim * 4),
            torch.nn.GELU(),
            torch.nn.Linear(hidden_dim * 4, hidden_dim),
        )

    def forward(self, x):
        b, n, d = x.shape
        x_norm = self.ln1(x)
        q, k, v = (
            p(x_norm).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        attn = (scores.softmax(-1) @ v).transpose(1, 2).contiguous().view(b, n, d)
        x = x + self.out_proj(attn)
        return x + self.ffn(self.ln2(x))


def tiny_seed_block(seed: int = 0) -> SeedBlock:
    """A seed block of hidden 21 with 3 heads, random LayerNorm weights."""
    torch.manual_seed(seed)
    return _randomized(SeedBlock(21, 3), torch.float32)


def tokens(batch: int = 2, length: int = 11, seed: int = 0) -> np.ndarray:
    """Random token ids ``[batch, length]``."""
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, length))


def torch_logits(model, ids: np.ndarray) -> np.ndarray:
    """The torch model's fp32 logits for ``ids``."""
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.float().numpy()


FORMATS = ("safetensors", "sharded-safetensors", "bin", "sharded-bin", "pt")


def save(model, directory: Path, fmt: str) -> Path:
    """Saves ``model`` in one of ``FORMATS``; returns what to load (a directory, or the
    ``.pt`` file for ``"pt"``, whose config is then ``directory / "config.json"``)."""
    directory.mkdir(parents=True, exist_ok=True)
    if fmt == "pt":
        model.config.to_json_file(directory / "config.json")
        torch.save(model.state_dict(), directory / "model.pt")
        return directory / "model.pt"
    if fmt.endswith("safetensors"):
        shard = "8KB" if fmt.startswith("sharded") else "1GB"
        model.save_pretrained(directory, max_shard_size=shard)
        return directory
    _save_bin(model, directory, sharded=fmt.startswith("sharded"))
    return directory


def _save_bin(model, directory: Path, sharded: bool) -> None:
    """``pytorch_model.bin`` (or shards + ``pytorch_model.bin.index.json``), as older
    transformers wrote them; transformers 5 no longer writes .bin itself."""
    model.config.to_json_file(directory / "config.json")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if not sharded:
        torch.save(state, directory / "pytorch_model.bin")
        return
    keys = list(state)
    groups = [keys[i : i + 7] for i in range(0, len(keys), 7)]
    weight_map = {}
    for i, group in enumerate(groups, 1):
        name = f"pytorch_model-{i:05d}-of-{len(groups):05d}.bin"
        torch.save({k: state[k] for k in group}, directory / name)
        weight_map |= dict.fromkeys(group, name)
    total = sum(v.numel() * v.element_size() for v in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps(index))


# ----------------------------------------------------------------------------- the families
# One tiny random-init model per family, odd pairwise-distinct sizes, and every feature the
# family brings switched on where a released model has it (windows small enough to matter
# at the test's 13 tokens, soft caps small enough to bend the logits).

_SIZES = dict(vocab_size=VOCAB, hidden_size=30, intermediate_size=37, num_hidden_layers=LAYERS)
_SIZES |= dict(initializer_range=0.2)  # logits of a few units: soft caps and windows show
_HEADS = dict(num_attention_heads=5, num_key_value_heads=1, max_position_embeddings=64)


def _family_config(name: str):
    t = transformers
    heads, sizes = _HEADS, _SIZES
    match name:
        case "llama3":  # Llama 3.2: llama3 rope scaling, tied head
            rope = dict(rope_type="llama3", rope_theta=500.0, factor=8.0, low_freq_factor=1.0,
                        high_freq_factor=4.0, original_max_position_embeddings=16)  # fmt: skip
            return t.LlamaConfig(**sizes, **heads, head_dim=6, rope_parameters=rope, tie_word_embeddings=True)
        case "smollm2":  # plain LLaMA, tied head
            return t.LlamaConfig(**sizes, **heads, head_dim=6, tie_word_embeddings=True)
        case "qwen2":  # q/k/v bias, no o bias
            return t.Qwen2Config(**sizes, **heads, tie_word_embeddings=False)
        case "qwen3":  # q/k norm, head_dim != hidden / heads
            return t.Qwen3Config(**sizes, **heads, head_dim=8, tie_word_embeddings=False)
        case "mistral":  # global sliding window, head_dim != hidden / heads
            return t.MistralConfig(**sizes, **heads, head_dim=8, sliding_window=5)
        case "gemma2":
            return t.Gemma2Config(**sizes, **heads, head_dim=8, sliding_window=4, query_pre_attn_scalar=7,
                                  attn_logit_softcapping=2.0, final_logit_softcapping=3.0)  # fmt: skip
        case "gemma3":  # 2 local : 1 global, separate rope bases, linear scaling on the global layers
            rope = {"full_attention": dict(rope_type="linear", factor=4.0, rope_theta=1000.0),
                    "sliding_attention": dict(rope_type="default", rope_theta=100.0)}  # fmt: skip
            kinds = ["sliding_attention", "sliding_attention", "full_attention"]
            return t.Gemma3TextConfig(**sizes, **heads, head_dim=8, sliding_window=4, query_pre_attn_scalar=9,
                                      rope_parameters=rope, layer_types=kinds)  # fmt: skip
        case "phi3":  # fused qkv / gate_up, partial rotary, longrope (13 tokens > original 8: long factors)
            rope = dict(rope_type="longrope", rope_theta=300.0, partial_rotary_factor=0.6,
                        short_factor=[1.0, 1.5, 2.0], long_factor=[1.5, 3.0, 5.0])  # fmt: skip
            phi = dict(num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=64)
            phi |= dict(original_max_position_embeddings=8, sliding_window=7, pad_token_id=0, eos_token_id=0)
            return t.Phi3Config(**sizes, **phi, rope_parameters=rope)
        case "smollm3":  # a NoPE layer every second layer
            return t.SmolLM3Config(**sizes, **heads, no_rope_layer_interval=2, pad_token_id=0, bos_token_id=0,
                                   eos_token_id=0)  # fmt: skip
    raise ValueError(f"no tiny model for family {name!r}")


FAMILIES = ("llama3", "smollm2", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "smollm3")
"""The families of ``tiny_family`` (Hugging Face layouts beyond LLaMA-2 and GPT-2)."""


def tiny_family(name: str, seed: int = 0, dtype=torch.float32):
    """A tiny random ``*ForCausalLM`` of family ``name`` (one of ``FAMILIES``)."""
    torch.manual_seed(seed)
    config = _family_config(name)
    config._attn_implementation = "eager"
    return _randomized(transformers.AutoModelForCausalLM.from_config(config), dtype)


def tiny_gemma3_multimodal(seed: int = 0) -> "transformers.Gemma3ForConditionalGeneration":
    """A tiny Gemma 3 with its image side (a one-layer SigLIP tower): the language model is
    ``tiny_family("gemma3")``'s; jaxckpt reads only that part."""
    torch.manual_seed(seed)
    vision = transformers.SiglipVisionConfig(
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = transformers.Gemma3Config(
        text_config=_family_config("gemma3").to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        boi_token_index=VOCAB - 3,
        eoi_token_index=VOCAB - 2,
        image_token_index=VOCAB - 1,
    )
    config._attn_implementation = "eager"
    return _randomized(transformers.Gemma3ForConditionalGeneration(config), torch.float32)
