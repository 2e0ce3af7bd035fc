"""``jaxckpt.nn``: every layer against a small float64 numpy reference written here.

Modules are built abstractly (``nnx.eval_shape``) and filled with numpy random values:
biases and norm scales become non-trivial, and no test pays for compiling
``jax.random.normal`` once per parameter shape. Sizes are odd and pairwise distinct
(B=9, T=7, D=15, F=11, ...), so an axis mix-up fails; the eps and RoPE theta are
non-default, so reading the wrong one fails.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy.special import erf
from tolerances import assert_close

from jaxckpt import remat
from jaxckpt.nn import (
    MLP,
    PRESETS,
    Attention,
    Block,
    LayerNorm,
    RMSNorm,
    Transformer,
    TransformerConfig,
    apply_rope,
    rope_tables,
    run_blocks,
)

F32 = jnp.float32
B, T = 9, 7  # B differs from every head count, so B and N cannot be swapped unnoticed
EPS = 1e-3  # not the default 1e-5
THETA = 300.0  # not the default 10000
LLAMA = TransformerConfig(
    family="llama",
    vocab_size=37,
    d_model=15,
    n_layers=5,  # ratio_0.5 and ratio_0.25 also run a shorter last segment
    n_heads=3,
    n_kv_heads=1,
    head_dim=4,
    ffn_dim=11,
    max_len=13,
    norm_eps=EPS,
    rope_theta=THETA,
)
# The gpt2 preset shrunk. n_kv_heads and head_dim must be passed although they are the
# defaults (n_heads, d_model // n_heads): see test_preset_overrides_rederive_derived_fields.
GPT2 = TransformerConfig.preset(
    "gpt2", vocab_size=41, d_model=21, n_layers=2, n_heads=3, n_kv_heads=3, head_dim=7, ffn_dim=19, max_len=17
)


def build(make, seed: int = 0, scale: float = 0.3):
    """``make(rngs)`` built abstractly, every parameter then drawn from N(0, scale^2)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: make(nnx.Rngs(0))))
    rng = np.random.default_rng(seed)
    state = jax.tree.map(lambda s: jnp.asarray(scale * rng.standard_normal(s.shape), s.dtype), state)
    return nnx.merge(graphdef, state)


@nnx.jit
def apply(module, *args):
    """``module(*args)``, jitted: one compile instead of one per op in eager mode."""
    return module(*args)


def np_param(p) -> np.ndarray:
    return np.asarray(p[...], np.float64)


def np_dense(x: np.ndarray, linear: nnx.Linear) -> np.ndarray:
    y = x @ np_param(linear.kernel)
    return y + np_param(linear.bias) if linear.use_bias else y


def normal(seed: int, shape, scale: float = 1.0) -> np.ndarray:
    return scale * np.random.default_rng(seed).standard_normal(shape)


# ----------------------------------------------------------------------------- norms


def np_rms_norm(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def np_layer_norm(x, scale, bias, eps):
    mean = np.mean(x, axis=-1, keepdims=True)
    var = np.mean((x - mean) ** 2, axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * scale + bias


def test_rms_norm_matches_formula():
    x = normal(1, (B, T, 11), scale=0.05)  # mean(x^2) ~ 2.5e-3, comparable to eps
    norm = build(lambda rngs: RMSNorm(11, eps=EPS))
    scale = np_param(norm.scale)
    assert_close(apply(norm, jnp.asarray(x, F32)), np_rms_norm(x, scale, EPS), F32, name="rms_norm")
    with pytest.raises(AssertionError):  # the test can tell eps=1e-3 from the default
        assert_close(apply(norm, jnp.asarray(x, F32)), np_rms_norm(x, scale, 1e-5), F32)


def test_layer_norm_matches_formula():
    x = 0.05 * normal(2, (B, T, 11)) + 0.3  # a non-zero mean, variance ~ eps
    norm = build(lambda rngs: LayerNorm(11, eps=EPS))
    expected = np_layer_norm(x, np_param(norm.scale), np_param(norm.bias), EPS)
    assert_close(apply(norm, jnp.asarray(x, F32)), expected, F32, name="layer_norm")


@pytest.mark.parametrize("cfg", [LLAMA, GPT2], ids=["llama-rms", "gpt2-layer"])
def test_blocks_norms_use_config_eps(cfg):
    block = build(lambda rngs: Block(cfg, rngs=rngs))
    x = normal(3, (B, T, cfg.d_model), scale=0.05)
    for norm in (block.attn_norm, block.mlp_norm):
        assert type(norm) is {"rms": RMSNorm, "layer": LayerNorm}[cfg.norm]
        if cfg.norm == "rms":
            expected = np_rms_norm(x, np_param(norm.scale), cfg.norm_eps)
        else:
            expected = np_layer_norm(x, np_param(norm.scale), np_param(norm.bias), cfg.norm_eps)
        assert_close(apply(norm, jnp.asarray(x, F32)), expected, F32, name=f"{cfg.norm} norm")


# ----------------------------------------------------------------------------- rope


def np_rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """Hugging Face LLaMA's rotate-half RoPE on ``x [B, T, N, H]``."""
    h = x.shape[-1]
    inv_freq = 1.0 / theta ** (np.arange(0, h, 2) / h)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)  # [T, H]
    cos, sin = np.cos(emb)[None, :, None, :], np.sin(emb)[None, :, None, :]
    x1, x2 = x[..., : h // 2], x[..., h // 2 :]
    return x * cos + np.concatenate([-x2, x1], axis=-1) * sin


def test_rope_matches_hugging_face_rotate_half():
    h, n = 6, 5
    x = normal(4, (B, T, n, h))
    positions = np.arange(T)
    cos, sin = rope_tables(jnp.arange(T), h, THETA)
    assert cos.shape == sin.shape == (T, h) and cos.dtype == sin.dtype == F32
    out = jax.jit(apply_rope)(jnp.asarray(x, F32), cos, sin)
    assert_close(out, np_rope(x, positions, THETA), F32, name="rope")
    with pytest.raises(AssertionError):  # the test can tell theta=300 from the default
        assert_close(out, np_rope(x, positions, 10000.0), F32)
    np.testing.assert_allclose(out[:, 0], x[:, 0], rtol=1e-6, atol=1e-6)  # position 0 unchanged
    # a rotation in each (i, i + H/2) plane: the norm of every head vector is preserved
    np.testing.assert_allclose(np.linalg.norm(out, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)


def test_rope_keeps_dtype_and_takes_any_positions():
    h = 4
    positions = np.array([5, 0, 11])
    cos, sin = rope_tables(jnp.asarray(positions), h, THETA)
    x = normal(5, (2, 3, 1, h))
    out = jax.jit(apply_rope)(jnp.asarray(x, jnp.bfloat16), cos, sin)
    assert out.dtype == jnp.bfloat16
    assert_close(out, np_rope(x, positions.astype(np.float64), THETA), jnp.bfloat16, name="rope bf16")


# ----------------------------------------------------------------------------- mlp


def np_gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def np_gelu(x):
    return 0.5 * x * (1 + erf(x / math.sqrt(2)))


def np_mlp(x: np.ndarray, mlp: MLP, activation: str) -> np.ndarray:
    up = np_dense(x, mlp.up)
    if activation == "swiglu":
        gate = np_dense(x, mlp.gate)
        hidden = gate / (1 + np.exp(-gate)) * up
    else:
        hidden = {"gelu_tanh": np_gelu_tanh, "gelu": np_gelu}[activation](up)
    return np_dense(hidden, mlp.down)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("activation", ["swiglu", "gelu_tanh", "gelu"])
def test_mlp_matches_reference(activation, bias):
    cfg = LLAMA.replace(activation=activation, mlp_bias=bias)
    mlp = build(lambda rngs: MLP(cfg, rngs=rngs), scale=0.5)
    assert (mlp.gate is not None) == (activation == "swiglu")
    assert mlp.up.use_bias is mlp.down.use_bias is bias
    x = normal(6, (B, T, cfg.d_model))
    assert_close(apply(mlp, jnp.asarray(x, F32)), np_mlp(x, mlp, activation), F32, name=activation)


def test_gelu_and_gelu_tanh_differ():
    mlps = {
        a: build(lambda rngs, a=a: MLP(LLAMA.replace(activation=a), rngs=rngs)) for a in ("gelu", "gelu_tanh")
    }
    np.testing.assert_array_equal(mlps["gelu"].up.kernel[...], mlps["gelu_tanh"].up.kernel[...])
    x = normal(7, (B, T, LLAMA.d_model), scale=3.0)
    exact, tanh = (np.asarray(apply(mlps[a], jnp.asarray(x, F32))) for a in ("gelu", "gelu_tanh"))
    assert np.abs(exact - tanh).max() > 2e-4, "exact GELU and its tanh approximation agree"
    with pytest.raises(AssertionError):
        assert_close(exact, np_mlp(x, mlps["gelu"], "gelu_tanh"), F32)


# ----------------------------------------------------------------------------- attention


def np_attention(x: np.ndarray, attn: Attention, cfg: TransformerConfig) -> np.ndarray:
    """Causal softmax attention in float64 from ``attn``'s own projection weights."""
    b, t, _ = x.shape
    n, k, h = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q = np_dense(x, attn.q_proj).reshape(b, t, n, h)
    key = np_dense(x, attn.k_proj).reshape(b, t, k, h)
    value = np_dense(x, attn.v_proj).reshape(b, t, k, h)
    if cfg.positions == "rope":
        q, key = np_rope(q, np.arange(t), cfg.rope_theta), np_rope(key, np.arange(t), cfg.rope_theta)
    group = n // k  # query head i reads kv head i // group (jax.nn's GQA layout)
    key, value = np.repeat(key, group, axis=2), np.repeat(value, group, axis=2)
    logits = np.einsum("btnh,bsnh->bnts", q, key) / math.sqrt(h)
    logits = np.where(np.tril(np.ones((t, t), bool)), logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("bnts,bsnh->btnh", probs, value).reshape(b, t, n * h)
    return np_dense(out, attn.out_proj)


ATTENTION_CASES = {
    "llama-mha": LLAMA.replace(n_heads=3, n_kv_heads=3, head_dim=4),
    "llama-gqa-6/2-bias": LLAMA.replace(n_heads=6, n_kv_heads=2, head_dim=4, attention_bias=True),
    "llama-gqa-6/3-bias": LLAMA.replace(n_heads=6, n_kv_heads=3, head_dim=6, attention_bias=True),
    "gpt2-mha-bias": GPT2,
    "gpt2-gqa-6/3-odd-head": GPT2.replace(n_heads=6, n_kv_heads=3, head_dim=5),
}


@pytest.mark.parametrize("cfg", ATTENTION_CASES.values(), ids=ATTENTION_CASES.keys())
def test_attention_matches_numpy_causal_softmax(cfg):
    attn = build(lambda rngs: Attention(cfg, rngs=rngs))
    assert attn.q_proj.kernel.shape == (cfg.d_model, cfg.n_heads * cfg.head_dim)
    assert attn.k_proj.kernel.shape == (cfg.d_model, cfg.n_kv_heads * cfg.head_dim)
    assert attn.q_proj.use_bias is cfg.attention_bias
    assert attn.q_norm is None and attn.out_proj.use_bias is cfg.attention_bias
    x = normal(8, (B, T, cfg.d_model))
    assert_close(apply(attn, jnp.asarray(x, F32)), np_attention(x, attn, cfg), F32, name="attention")


def test_attention_reference_implementation_agrees_with_default():
    cfg = ATTENTION_CASES["llama-gqa-6/2-bias"]
    default = build(lambda rngs: Attention(cfg, rngs=rngs))
    reference = build(lambda rngs: Attention(cfg, rngs=rngs, implementation="reference"))
    assert (default.implementation, reference.implementation) == (None, "reference")
    x = jnp.asarray(normal(9, (B, T, cfg.d_model)), F32)
    assert_close(apply(default, x), apply(reference, x), F32, name="default vs reference")


# ----------------------------------------------------------------------------- transformer


@pytest.fixture(scope="module")
def llama():
    return build(lambda rngs: Transformer(LLAMA, rngs=rngs), scale=0.2)


@pytest.fixture(scope="module")
def gpt2():
    return build(lambda rngs: Transformer(GPT2, rngs=rngs), scale=0.2)


def tokens(cfg: TransformerConfig, seed: int = 10, b: int = B, t: int = T, high: int | None = None):
    return jnp.asarray(np.random.default_rng(seed).integers(0, high or cfg.vocab_size, (b, t)), jnp.int32)


def param_paths(model) -> set[str]:
    return {"/".join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_logits_shape_and_dtype(name, request):
    model = request.getfixturevalue(name)
    cfg = model.config
    logits = apply(model, tokens(cfg))
    assert logits.shape == (B, T, cfg.vocab_size) and logits.dtype == F32
    assert np.isfinite(np.asarray(logits)).all()


def test_learned_positions_only_in_gpt2(llama, gpt2):
    assert gpt2.pos_embed.embedding.shape == (GPT2.max_len, GPT2.d_model)
    assert "pos_embed/embedding" in param_paths(gpt2)
    assert llama.pos_embed is None
    assert not any(p.startswith("pos_embed") for p in param_paths(llama))


def test_untied_head_is_its_own_kernel(llama):
    assert llama.head.kernel.shape == (LLAMA.d_model, LLAMA.vocab_size)
    toks = tokens(LLAMA, high=LLAMA.vocab_size - 1)  # the last token never occurs
    before = np.asarray(apply(llama, toks))
    changed = nnx.clone(llama)
    changed.embed.embedding[...] = changed.embed.embedding[...].at[-1].add(1.0)
    np.testing.assert_array_equal(apply(changed, toks), before)  # an unused embedding row is unused


@nnx.jit
def final_hidden(model, toks):
    """What a gpt2 ``Transformer`` feeds its head: ``final_norm(blocks(embed + pos_embed))``."""
    x = model.embed(toks) + model.pos_embed(jnp.arange(toks.shape[1]))[None]
    return model.final_norm(run_blocks(model.blocks, x, remat.get("none"), model.config.n_layers))


def test_tied_head_reuses_the_embedding(gpt2):
    assert gpt2.head is None
    assert not any(p.startswith("head") for p in param_paths(gpt2))
    v = GPT2.vocab_size
    toks = tokens(GPT2, high=v - 1)  # the last token never occurs
    logits = np.asarray(apply(gpt2, toks))
    # logits = final_norm(hidden) @ embedding.T
    hidden = final_hidden(gpt2, toks)
    assert_close(logits, np.asarray(hidden, np.float64) @ np_param(gpt2.embed.embedding).T, F32, name="tied")
    # so the row of a token that never occurs still moves its own logit, and only that one
    changed = nnx.clone(gpt2)
    changed.embed.embedding[...] = changed.embed.embedding[...].at[-1].add(1.0)
    after = np.asarray(apply(changed, toks))
    np.testing.assert_allclose(after[..., :-1], logits[..., :-1], rtol=1e-6, atol=1e-6)
    assert np.abs(after[..., -1] - logits[..., -1]).min() > 1e-3


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_causal(name, request):
    model = request.getfixturevalue(name)
    cfg, t = model.config, 4
    toks = tokens(cfg)
    changed = toks.at[:, t].set((toks[:, t] + 1) % cfg.vocab_size)
    before, after = np.asarray(apply(model, toks)), np.asarray(apply(model, changed))
    np.testing.assert_allclose(after[:, :t], before[:, :t], rtol=1e-6, atol=1e-6)
    assert (np.abs(after[:, t:] - before[:, t:]).max(axis=-1) > 1e-4).all(), "the change did not propagate"


@nnx.jit(static_argnums=2)
def logits_under(model, toks, presets: tuple[str, ...]):
    """Logits under each remat preset, compiled as one program (forward only)."""
    return {name: model(toks, remat=name) for name in presets}


def test_remat_override_keeps_logits(llama):
    presets = tuple(p for p in remat.PRESETS if remat.has_pinned_host() or not remat.PRESETS[p].offload)
    assert {"none", "full", "ratio_0.5", "ratio_0.25"} <= set(presets)
    logits = logits_under(llama, tokens(LLAMA), presets)
    for name in presets:
        np.testing.assert_allclose(logits[name], logits["none"], rtol=1e-6, atol=1e-6, err_msg=name)


def test_bad_tokens_are_rejected(llama):
    with pytest.raises(ValueError, match="max_len"):
        llama(jnp.zeros((1, LLAMA.max_len + 1), jnp.int32))
    assert apply(llama, jnp.zeros((1, LLAMA.max_len), jnp.int32)).shape[1] == LLAMA.max_len
    for bad in (jnp.zeros((T,), jnp.int32), jnp.zeros((B, T, 1), jnp.int32), jnp.zeros((B, T), F32)):
        with pytest.raises(ValueError, match=r"integer array \[B, T\]"):
            llama(bad)


def test_bf16_compute_keeps_fp32_params():
    cfg = LLAMA.replace(dtype="bfloat16", param_dtype="float32")
    model = build(lambda rngs: Transformer(cfg, rngs=rngs), scale=0.2)
    logits = apply(model, tokens(cfg))
    assert logits.dtype == jnp.bfloat16 and logits.shape == (B, T, cfg.vocab_size)
    assert np.isfinite(np.asarray(logits, np.float32)).all()
    dtypes = {p.dtype for p in jax.tree.leaves(nnx.state(model, nnx.Param))}
    assert dtypes == {np.dtype(F32)}


# ----------------------------------------------------------------------------- param counts


@pytest.mark.parametrize(
    "name, count",
    [
        ("llama2-7b", 6_738_415_616),
        ("llama2-13b", 13_015_864_320),
        ("llama3-8b", 8_030_261_248),
        ("gpt2", 124_439_808),  # tied head, learned positions, biases, LayerNorms
    ],
)
def test_preset_param_count(name, count):
    cfg = TransformerConfig.preset(name)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))  # abstract: nothing allocated
    assert sum(math.prod(p.shape) for p in jax.tree.leaves(nnx.state(model, nnx.Param))) == count


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(family="bert"), "family"),
        (dict(n_heads=6, n_kv_heads=4, head_dim=4), "n_kv_heads"),
        (dict(head_dim=5), "head_dim"),  # rope needs an even head_dim
        (dict(d_model=16, n_heads=3, head_dim=None), "d_model"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(d_model=-15), "d_model"),
        (dict(n_layers=0), "n_layers"),
        (dict(n_heads=0), "n_heads"),
        (dict(n_kv_heads=0), "n_kv_heads"),
        (dict(head_dim=0), "head_dim"),
        (dict(ffn_dim=0), "ffn_dim"),
        (dict(max_len=0), "max_len"),
        (dict(n_layers=2.0), "n_layers"),
        (dict(n_layers=True), "n_layers"),
        (dict(norm_eps=0.0), "norm_eps"),
        (dict(dtype="float8"), "dtype"),
        (dict(param_dtype="int8"), "param_dtype"),
        (dict(norm="batch"), "norm"),
        (dict(activation="relu"), "activation"),
        (dict(positions="alibi"), "positions"),
    ],
)
def test_bad_config_names_the_field(changes, field):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        dataclasses.replace(LLAMA, **changes)
    with pytest.raises(ValueError, match=rf"\b{field}\b"):  # replace validates too
        LLAMA.replace(**changes)


def test_odd_head_dim_is_fine_without_rope():
    assert LLAMA.replace(positions="none", head_dim=5).head_dim == 5
    assert GPT2.replace(head_dim=5).head_dim == 5


def test_unknown_preset_lists_valid_ones():
    with pytest.raises(ValueError, match="llama2-77b") as info:
        TransformerConfig.preset("llama2-77b")
    assert all(name in str(info.value) for name in PRESETS)


def test_preset_with_overrides():
    cfg = TransformerConfig.preset("tiny", n_layers=2)
    assert cfg.n_layers == 2
    assert cfg == dataclasses.replace(PRESETS["tiny"], n_layers=2)
    assert PRESETS["tiny"].n_layers != 2  # the preset itself is untouched
    with pytest.raises(ValueError, match="n_kv_heads"):
        TransformerConfig.preset("tiny", n_heads=6, n_kv_heads=4, head_dim=16)


def test_family_defaults():
    assert (LLAMA.norm, LLAMA.activation, LLAMA.positions) == ("rms", "swiglu", "rope")
    assert (GPT2.norm, GPT2.activation, GPT2.positions) == ("layer", "gelu_tanh", "learned")
    assert TransformerConfig(n_heads=4).n_kv_heads == 4
    assert TransformerConfig(d_model=28, n_heads=7).head_dim == 4


def test_preset_overrides_rederive_derived_fields():
    cfg = TransformerConfig.preset(
        "gpt2", vocab_size=97, d_model=24, n_layers=3, n_heads=3, ffn_dim=40, max_len=32
    )
    assert (cfg.n_kv_heads, cfg.head_dim) == (3, 8)


# ----------------------------------------------------------------------------- layer patterns

PATTERNED = LLAMA.replace(
    n_layers=5, layer_pattern=("sliding", "full_nope", "full"), sliding_window=3, local_rope_theta=77.0
)
"""Layers that differ: three kinds, the pattern cut short (5 layers of a period of 3)."""


def _unrolled(blocks, kinds, x):
    """The stack applied layer by layer, each block with its own kind (no scan, no remat)."""
    graphdef, state = nnx.split(blocks)
    for i, kind in enumerate(kinds):
        x = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))(x, kind)
    return x


@functools.partial(nnx.jit, static_argnums=2)
def _patterned_output_and_grads(blocks, x, spec: str | None):
    """The patterned stack's output on ``x`` and the gradients of ``sum(sin(output))``
    with respect to ``blocks``: scanned under remat ``spec``, or unrolled layer by layer
    (``spec=None``, the reference). Jitted: in eager mode every op, forward and backward,
    compiled its own small program."""
    kinds = PATTERNED.layer_kinds

    def run(b):
        if spec is None:
            return _unrolled(b, kinds, x)
        return run_blocks(b, x, remat.get(spec), PATTERNED.n_layers, kinds)

    grads = nnx.grad(lambda b: jnp.sum(jnp.sin(run(b))))(blocks)
    return run(blocks), nnx.state(grads)


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["none", "full", "ratio_0.5"])  # plain, per layer, segments + a shorter one
def test_a_patterned_stack_is_its_layers_in_order_under_every_remat(spec):
    kinds = PATTERNED.layer_kinds
    assert [k.sliding for k in kinds] == [True, False, False, True, False]
    assert [k.rope for k in kinds] == [True, False, True, True, False]
    model = build(lambda rngs: Transformer(PATTERNED, rngs=rngs), scale=0.2)
    x = jnp.asarray(normal(4, (B, T, PATTERNED.d_model)), F32)
    out, grads = _patterned_output_and_grads(model.blocks, x, spec)
    want, expected = _patterned_output_and_grads(model.blocks, x, None)  # compiled once per module
    assert_close(out, want, F32, name=f"{spec} forward")
    for (path, g), (_, r) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(expected), strict=True):
        assert_close(g[...], r[...], F32, name=f"{spec} grad {path}")


def _eqns(jaxpr, primitive: str) -> list:
    """The equations of ``primitive`` in ``jaxpr`` and, outside them, in its sub-jaxprs."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == primitive:
            found.append(eqn)
            continue
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                found += _eqns(inner, primitive)
    return found


def test_a_patterned_stack_is_one_scan_with_a_branch_per_window():
    cfg = PATTERNED.replace(n_layers=9)  # three kinds, three layers of each; two windows
    model = build(lambda rngs: Transformer(cfg, rngs=rngs))
    jaxpr = jax.make_jaxpr(lambda m, t: m(t))(model, jnp.zeros((1, 5), jnp.int32))
    scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert [e.params["length"] for e in scans] == [9]
    switches = _eqns(scans[0].params["jaxpr"].jaxpr, "cond")
    assert [len(e.params["branches"]) for e in switches] == [2]  # the attention, once per window
    report = remat.describe(model, (2, 5), "full")
    assert [(r.tag, r.count) for r in report.residuals] == [(remat.Tag.LAYER_INPUT, 3)] * 3
