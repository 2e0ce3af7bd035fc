"""RoPE scalings and partial rotary against Hugging Face transformers itself.

For every kind (default, linear, llama3, yarn and its variants, longrope below and above
``original_max_position_embeddings``, partial rotary) a transformers config is built with
small odd sizes, and its RotaryEmbedding module (inv_freq, attention_scaling, cos, sin) is
the oracle for ``inv_frequencies`` and ``rope_tables``; our ``RopeScaling`` is read from
the config's own standardised ``rope_parameters``. ``apply_rope`` is checked against
transformers' ``apply_rotary_pos_emb`` (LLaMA's full and Phi-3's partial rotary).
"""

import copy
import os

import numpy as np
import pytest

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.phi3 import modeling_phi3  # noqa: E402

from jaxckpt.nn._rope import apply_rope, rope_tables  # noqa: E402
from jaxckpt.nn._rope_scaling import RopeScaling, inv_frequencies  # noqa: E402

pytestmark = pytest.mark.torch

F32 = jnp.float32
INV_FREQ_RTOL = 1e-6  # torch's float32 pow (Sleef) is not correctly rounded: up to 4 ulp after llama3
TABLE_ATOL = 2e-6  # cos and sin of positions < 32 (XLA's and torch's cos differ by an ulp too)

LLAMA = dict(hidden_size=30, num_attention_heads=3, head_dim=14)  # head_dim != hidden / heads
PHI3 = dict(hidden_size=42, num_attention_heads=3)  # head_dim 14; Phi3Config has no head_dim field


def _phi3_like_factors(n: int, top: float) -> list[float]:
    """Per-frequency factors rising from 1 to ``top``, as Phi-3-mini-128k's lists do."""
    return [float(v) for v in np.round(np.geomspace(1.0, top, n), 6)]


def _rope(kind: str, theta: float, **fields) -> dict:
    return {"rope_type": kind, "rope_theta": theta} | fields


_LLAMA3 = dict(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
# name -> (model, config kwargs, T); the yarn and longrope parameters are those of the models named.
CASES = {
    "default": ("llama", dict(rope_parameters=_rope("default", 10000.0)), 13),
    "default_theta_5e5": ("llama", dict(rope_parameters=_rope("default", 5e5)), 11),
    "linear": ("llama", dict(rope_parameters=_rope("linear", 1e4, factor=4.0)), 13),
    "llama3.1": (
        "llama",
        dict(max_position_embeddings=131072, rope_parameters=_rope("llama3", 5e5, factor=8.0, **_LLAMA3)),
        17,
    ),
    "llama3.2": (  # head_dim 22: 11 frequencies, in all three bands (kept, smoothed, divided)
        "llama",
        dict(
            head_dim=22,
            max_position_embeddings=131072,
            rope_parameters=_rope("llama3", 5e5, factor=32.0, **_LLAMA3),
        ),
        7,
    ),
    "yarn_qwen2.5": (
        "llama",
        dict(
            max_position_embeddings=131072,
            rope_parameters=_rope("yarn", 1e6, factor=4.0, original_max_position_embeddings=32768),
        ),
        13,
    ),
    "yarn_mscale": (  # DeepSeek-V3-like; mscale != mscale_all_dim, so the attention factor is not 1
        "llama",
        dict(
            max_position_embeddings=163840,
            rope_parameters=_rope(
                "yarn",
                1e4,
                factor=40.0,
                mscale=0.707,
                mscale_all_dim=1.0,
                beta_fast=32,
                beta_slow=1,
                original_max_position_embeddings=4096,
            ),
        ),
        11,
    ),
    "yarn_no_truncate": (  # gpt-oss
        "llama",
        dict(
            max_position_embeddings=131072,
            rope_parameters=_rope(
                "yarn",
                150000.0,
                factor=32.0,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
                original_max_position_embeddings=4096,
            ),
        ),
        13,
    ),
    "yarn_betas_attention_factor": (
        "llama",
        dict(
            max_position_embeddings=65536,
            rope_parameters=_rope(
                "yarn",
                1e4,
                factor=8.0,
                beta_fast=16.0,
                beta_slow=2.0,
                attention_factor=1.25,
                original_max_position_embeddings=8192,
            ),
        ),
        9,
    ),
    "yarn_factor_from_max_len": (  # factor None: max_position_embeddings / original
        "llama",
        dict(
            max_position_embeddings=24576,
            rope_parameters=_rope("yarn", 1e4, factor=None, original_max_position_embeddings=4096),
        ),
        9,
    ),
    "partial_0.75": (  # Phi-4-mini's partial_rotary_factor: 10 of 14 dims rotated
        "phi3",
        dict(partial_rotary_factor=0.75, rope_parameters=_rope("default", 10000.0)),
        13,
    ),
}
_PHI3_LONGROPE = dict(short_factor=_phi3_like_factors(7, 1.2), long_factor=_phi3_like_factors(7, 40.0))
_PHI4_LONGROPE = dict(
    factor=8.0, short_factor=_phi3_like_factors(5, 1.1), long_factor=_phi3_like_factors(5, 20.0)
)
for _t, _side in ((13, "short"), (21, "long")):  # original_max_position_embeddings 16: T=13 short, 21 long
    _phi3 = dict(max_position_embeddings=512, original_max_position_embeddings=16)
    CASES[f"longrope_{_side}"] = (
        "phi3",
        _phi3 | dict(rope_parameters=_rope("longrope", 1e4, **_PHI3_LONGROPE)),
        _t,
    )
    CASES[f"longrope_partial_{_side}"] = (  # Phi-4-mini: longrope and partial rotary 0.75
        "phi3",
        _phi3 | dict(partial_rotary_factor=0.75, rope_parameters=_rope("longrope", 1e4, **_PHI4_LONGROPE)),
        _t,
    )
MODELS = {
    "llama": (transformers.LlamaConfig, LLAMA, modeling_llama.LlamaRotaryEmbedding),
    "phi3": (transformers.Phi3Config, PHI3, modeling_phi3.Phi3RotaryEmbedding),
}


def _hf(name: str):
    """The transformers config and its RotaryEmbedding's (inv_freq, attention_scaling, cos, sin)."""
    model, kwargs, t = CASES[name]
    config_class, sizes, rotary_class = MODELS[model]
    config = config_class(**copy.deepcopy(sizes | kwargs))  # transformers edits rope_parameters in place
    rotary = rotary_class(config)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), torch.arange(t)[None])
    inv_freq = rotary.inv_freq.numpy()  # after forward: longrope's dynamic update picked short or long
    return config, inv_freq, rotary.attention_scaling, cos[0].numpy(), sin[0].numpy()


def _ours(config, t: int):
    """Our scaling, read from the config's standardised rope_parameters, and its arguments."""
    params = dict(config.rope_parameters)
    kind = params["rope_type"]
    scaling = None if kind == "default" else RopeScaling.from_dict(params)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    return rotary_dim, params["rope_theta"], scaling, dict(max_len=config.max_position_embeddings, seq_len=t)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a.astype(np.float64) - b) / np.abs(b)))


@pytest.mark.parametrize("name", CASES)
def test_frequencies_and_tables_match_transformers(name):
    t = CASES[name][2]
    config, hf_inv_freq, hf_attention, hf_cos, hf_sin = _hf(name)
    rotary_dim, theta, scaling, kw = _ours(config, t)
    inv_freq, attention = inv_frequencies(rotary_dim, theta, scaling, **kw)
    assert inv_freq.dtype == np.float32 and inv_freq.shape == hf_inv_freq.shape == (rotary_dim // 2,)
    assert _rel(inv_freq, hf_inv_freq) <= INV_FREQ_RTOL, (inv_freq, hf_inv_freq)
    assert attention == pytest.approx(hf_attention, rel=1e-12, abs=0)
    cos, sin = rope_tables(jnp.arange(t), rotary_dim, theta, scaling, **kw)
    assert cos.shape == sin.shape == hf_cos.shape == (t, rotary_dim) and cos.dtype == sin.dtype == F32
    np.testing.assert_allclose(cos, hf_cos, rtol=0, atol=TABLE_ATOL * max(1.0, hf_attention))
    np.testing.assert_allclose(sin, hf_sin, rtol=0, atol=TABLE_ATOL * max(1.0, hf_attention))


def test_the_cases_reach_every_branch():
    """llama3.2 has frequencies in all three bands; yarn's ramp is inside (0, 1) somewhere;
    longrope's short and long frequencies differ, and the attention factors are not 1."""
    wavelen = 2 * np.pi / inv_frequencies(22, 500000.0)[0]
    assert (
        (wavelen < 8192 / 4).any() and (wavelen > 8192).any() and ((wavelen > 2048) & (wavelen < 8192)).any()
    )
    for name in ("yarn_qwen2.5", "yarn_mscale", "yarn_no_truncate", "yarn_betas_attention_factor"):
        config, hf_inv_freq, attention, _, _ = _hf(name)
        base = inv_frequencies(14, config.rope_parameters["rope_theta"])[0]
        ratio = hf_inv_freq / base  # 1: extrapolated, 1 / factor: interpolated, between: ramped
        factor = config.rope_parameters["factor"]
        assert ((ratio < 0.999) & (ratio > 1.001 / factor)).any(), (name, ratio)
        assert attention != 1.0
    _, short, short_attention, _, _ = _hf("longrope_short")
    _, long, long_attention, _, _ = _hf("longrope_long")
    assert (
        not np.allclose(short, long) and short_attention == long_attention == 1.5
    )  # sqrt(1 + ln 32 / ln 16)


@pytest.mark.parametrize("seq_len", [4096, 4097])
def test_longrope_phi3_mini_128k_sizes(seq_len):
    """Phi-3-mini-128k's sizes (head_dim 96, original 4096, max 131072) through
    ROPE_INIT_FUNCTIONS: short factor up to 4096, long factor from 4097."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0}
    rope |= {"short_factor": _phi3_like_factors(48, 1.1), "long_factor": _phi3_like_factors(48, 50.0)}
    config = transformers.Phi3Config(
        hidden_size=96 * 3,
        num_attention_heads=3,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        rope_parameters=rope,
    )
    hf_inv_freq, hf_attention = ROPE_INIT_FUNCTIONS["longrope"](config, seq_len=seq_len)
    rotary_dim, theta, scaling, kw = _ours(config, seq_len)
    inv_freq, attention = inv_frequencies(rotary_dim, theta, scaling, **kw)
    assert _rel(inv_freq, hf_inv_freq.numpy()) <= INV_FREQ_RTOL
    assert attention == pytest.approx(hf_attention, rel=1e-12, abs=0)
    factors = scaling.long_factor if seq_len > 4096 else scaling.short_factor
    np.testing.assert_allclose(inv_frequencies(96, theta)[0] / inv_freq, factors, rtol=1e-5)


def test_yarn_original_max_len_defaults_to_max_len():
    """transformers fills a missing original_max_position_embeddings with max_position_embeddings."""
    config = transformers.LlamaConfig(
        **LLAMA, max_position_embeddings=4096, rope_parameters={"rope_type": "yarn", "factor": 4.0}
    )
    assert config.rope_parameters["original_max_position_embeddings"] == 4096
    hf_inv_freq, hf_attention = ROPE_INIT_FUNCTIONS["yarn"](config)
    scaling = RopeScaling(kind="yarn", factor=4.0)
    inv_freq, attention = inv_frequencies(14, config.rope_parameters["rope_theta"], scaling, max_len=4096)
    assert _rel(inv_freq, hf_inv_freq.numpy()) <= INV_FREQ_RTOL and attention == hf_attention


@pytest.mark.parametrize("model, rotary_dim", [("llama", 14), ("phi3", 14), ("phi3", 10), ("phi3", 4)])
def test_apply_rope_matches_apply_rotary_pos_emb(model, rotary_dim):
    b, t, n, h = 3, 7, 5, 14
    rng = np.random.default_rng(rotary_dim)
    q, k = (rng.standard_normal((b, t, n, h)).astype(np.float32) for _ in range(2))
    inv_freq = inv_frequencies(rotary_dim, 300.0)[0]
    emb = np.concatenate([np.arange(t)[:, None] * inv_freq[None]] * 2, axis=-1).astype(np.float32)
    cos, sin = np.cos(emb), np.sin(emb)  # [T, R], shared by both sides
    hf = modeling_llama.apply_rotary_pos_emb if model == "llama" else modeling_phi3.apply_rotary_pos_emb
    as_torch = [torch.from_numpy(a.transpose(0, 2, 1, 3).copy()) for a in (q, k)]  # [B, N, T, H]
    hf_q, hf_k = hf(*as_torch, torch.from_numpy(cos)[None], torch.from_numpy(sin)[None], unsqueeze_dim=1)
    for x, theirs in ((q, hf_q), (k, hf_k)):
        ours = jax.jit(apply_rope)(jnp.asarray(x), jnp.asarray(cos), jnp.asarray(sin))
        np.testing.assert_allclose(ours, theirs.numpy().transpose(0, 2, 1, 3), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(ours[..., rotary_dim:], x[..., rotary_dim:])  # passed through


def _old_apply_rope(x, cos, sin):
    """``apply_rope`` before partial rotary, verbatim."""
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return (x32 * cos + rotated * sin).astype(x.dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_full_rotary_is_bit_identical_to_the_old_formula(dtype):
    x = jnp.asarray(np.random.default_rng(3).standard_normal((3, 7, 5, 6)), dtype)
    cos, sin = rope_tables(jnp.arange(7), 6, 300.0)
    new, old = jax.jit(apply_rope)(x, cos, sin), jax.jit(_old_apply_rope)(x, cos, sin)
    assert new.dtype == dtype and bool(jnp.array_equal(new, old))
    # the old tables (inv_freq in XLA's float32 pow) differ from the new (numpy's) by float32 rounding
    old_inv = 1.0 / (300.0 ** (jnp.arange(0, 6, 2, dtype=F32) / 6))
    old_emb = jnp.concatenate([jnp.arange(7, dtype=F32)[:, None] * old_inv[None]] * 2, axis=-1)
    np.testing.assert_allclose(cos, jnp.cos(old_emb), rtol=0, atol=1e-6)


def test_partial_rotary_keeps_dtype_and_the_pass_through_bits():
    x = jnp.asarray(np.random.default_rng(4).standard_normal((3, 7, 5, 14)), jnp.bfloat16)
    cos, sin = rope_tables(jnp.arange(7), 10, 10000.0)
    out = apply_rope(x, cos, sin)
    assert out.dtype == jnp.bfloat16 and out.shape == x.shape
    assert bool(jnp.array_equal(out[..., 10:], x[..., 10:]))


def test_rope_tables_trace_positions_and_take_a_static_seq_len():
    """Packed documents restart at 0: seq_len, not the positions, picks longrope's factors."""
    scaling = RopeScaling(
        kind="longrope",
        original_max_len=16,
        short_factor=_phi3_like_factors(5, 1.1),
        long_factor=_phi3_like_factors(5, 20.0),
    )
    positions = jnp.concatenate([jnp.arange(11), jnp.arange(10)])  # 21 tokens, two documents
    tables = jax.jit(lambda p: rope_tables(p, 10, 1e4, scaling, max_len=256, seq_len=21))(positions)
    long_inv_freq, attention = inv_frequencies(10, 1e4, scaling, max_len=256, seq_len=21)
    emb = np.asarray(positions, np.float32)[:, None] * long_inv_freq[None]
    np.testing.assert_allclose(tables[0][:, :5], np.cos(emb) * attention, rtol=0, atol=TABLE_ATOL)
    short = rope_tables(positions, 10, 1e4, scaling, max_len=256, seq_len=11)[0]
    assert not np.allclose(short, tables[0])


@pytest.mark.parametrize(
    "name", [n for n in CASES if CASES[n][1]["rope_parameters"]["rope_type"] != "default"]
)
def test_scaling_round_trips_and_hashes(name):
    scaling = _ours(_hf(name)[0], 1)[2]
    assert RopeScaling.from_dict(scaling.to_dict()) == scaling
    assert hash(RopeScaling.from_dict(scaling.to_dict())) == hash(scaling)


@pytest.mark.parametrize(
    "fields, match",
    [
        (
            dict(kind="dynamic", factor=2.0),
            r"rope_scaling\.kind='dynamic' is not implemented.*linear, llama3",
        ),
        (dict(kind="default"), r"kind='default'.*rope_scaling=None"),
        (dict(kind="ntk"), r"rope_scaling\.kind='ntk' is not implemented; the implemented kinds are linear"),
        (dict(kind="linear"), r"rope_scaling\.factor=None: kind=linear needs factor"),
        (dict(kind="linear", factor=-2.0), r"rope_scaling\.factor=-2\.0 must be a positive number"),
        (
            dict(kind="llama3", factor=8.0, high_freq_factor=4.0, original_max_len=8192),
            r"rope_scaling\.low_freq_factor=None: kind=llama3 needs factor, low_freq_factor, high_freq",
        ),
        (
            dict(kind="llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0, original_max_len=8192),
            r"low_freq_factor=4\.0 must be less than rope_scaling\.high_freq_factor=1\.0",
        ),
        (
            dict(kind="longrope", short_factor=[1.0], long_factor=[2.0]),
            r"rope_scaling\.original_max_len=None: kind=longrope .*top level of config\.json",
        ),
        (dict(kind="longrope", short_factor=[1.0, "x"]), r"rope_scaling\.short_factor=\[1\.0, 'x'\]"),
        (
            dict(kind="yarn", factor=4.0, original_max_len=4096.0),
            r"original_max_len=4096\.0 must be a positive int",
        ),
        (dict(kind="yarn", factor=4.0, truncate="no"), r"rope_scaling\.truncate='no'"),
    ],
)
def test_rope_scaling_refuses_bad_fields(fields, match):
    with pytest.raises(ValueError, match=match):
        RopeScaling(**fields)


def test_inv_frequencies_and_apply_rope_refuse_bad_arguments():
    longrope = RopeScaling(
        kind="longrope", original_max_len=16, short_factor=[1.0] * 3, long_factor=[2.0] * 5
    )
    with pytest.raises(
        ValueError, match=r"rope_scaling\.short_factor has 3 entries; rotary_dim=10 needs .* = 5"
    ):
        inv_frequencies(10, 1e4, longrope, max_len=64)
    with pytest.raises(ValueError, match=r"max_len=None, but rope_scaling\.factor=None"):
        inv_frequencies(10, 1e4, RopeScaling(kind="yarn", original_max_len=16))
    with pytest.raises(ValueError, match=r"rotary_dim=7 must be even"):
        inv_frequencies(7, 1e4)
    with pytest.raises(ValueError, match=r"theta=0\.0 must be a positive number"):
        inv_frequencies(8, 0.0)
    cos, sin = rope_tables(jnp.arange(7), 8, 1e4)
    with pytest.raises(ValueError, match=r"cos\.shape\[-1\]=8 must be even and in \(0, H=6\]"):
        apply_rope(jnp.ones((1, 7, 2, 6), F32), cos, sin)
    with pytest.raises(ValueError, match=r"do not match x\.shape=\(1, 5, 2, 8\)"):
        apply_rope(jnp.ones((1, 5, 2, 8), F32), cos, sin)
