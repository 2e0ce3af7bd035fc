"""QLoRA's quantized base: nf4 / int8 codes with per-block scales.

The round trip stays within each kind's bound (nf4: half the code book's largest gap times
the block's absmax; int8: absmax / 254), rounding to the nearest code; a quantized model
computes what the base with the dequantized kernels does, and stays within a measured
bound of the unquantized base; training moves the adapters only; the stored bytes and the
compiled step's argument bytes are the predicted ones, and the step's temp memory holds no
dequantized copy of the stack's kernels.
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxckpt import nn, plan, remat, train
from jaxckpt.cli import main
from jaxckpt.nn._lora import project
from jaxckpt.nn._quant import ERROR_PER_ABSMAX

# bitsandbytes' get_4bit_type("nf4") (bitsandbytes/functional.py), the values of QLoRA
# (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs", appendix E).
BNB_NF4 = [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
]

SIZES = dict(n_layers=3, d_model=72, n_heads=4, n_kv_heads=2, ffn_dim=136, vocab_size=101, max_len=64)
BASE = nn.TransformerConfig.preset("tiny", **SIZES)
LORA = nn.LoraConfig(rank=3, alpha=6, targets=("q", "v", "down"))
LOGITS_BOUND = {"nf4": 0.25, "int8": 0.02}
"""Relative error ``|logits_q - logits| / |logits|`` (Frobenius) of a random model of
``SIZES`` with a quantized base, against the unquantized one: measured 0.16 - 0.19 (nf4)
and 0.009 - 0.010 (int8) over seeds 0-4; 0.06 / 0.004 at d_model 40, 0.25 / 0.017 at
d_model 128 and 4 layers (each kernel's own relative error: 0.092 / 0.006)."""
PROJECTIONS = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj", "mlp.gate", "mlp.up", "mlp.down")


@functools.cache
def _model(kind: "str | None") -> nn.Transformer:
    """The LoRA model of seed 2, its base quantized (``kind``) or not: the same random kernels
    (the keys are drawn in the same order). Shared: tests only read it."""
    return nn.Transformer(BASE.replace(lora=LORA, quantize_base=kind), rngs=nnx.Rngs(2))


def _layer(model, path: str):
    group, name = path.split(".")
    return getattr(getattr(model.blocks, group), name)


def _tokens(seed=0, shape=(1, 2, 17)):
    return jax.random.randint(jax.random.key(seed), shape, 0, BASE.vocab_size)


def _flat(state) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(state)}


def _dequantized_params(model) -> dict:
    """The quantized model's state as an unquantized LoRA model's: each projection's kernel dequantized."""
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
    for path in PROJECTIONS:
        group, name = path.split(".")
        node = params["blocks"][group][name]
        del node["kernel_codes"], node["kernel_scales"]
        node["kernel"] = np.asarray(_layer(model, path).kernel())
    return params


def _logits(model, tokens) -> np.ndarray:
    return np.asarray(nnx.jit(lambda m, t: m(t))(model, tokens))


def _block_absmax(w: np.ndarray, block: int = 64) -> np.ndarray:
    """Each element's block absmax (blocks of ``block`` rows along axis -2)."""
    pad = -w.shape[-2] % block
    padded = np.pad(np.abs(w), [(0, 0)] * (w.ndim - 2) + [(0, pad), (0, 0)])
    blocks = padded.reshape(*w.shape[:-2], -1, block, w.shape[-1]).max(axis=-2, keepdims=True)
    return np.broadcast_to(blocks, (*blocks.shape[:-3], blocks.shape[-3], block, w.shape[-1])).reshape(
        padded.shape
    )[..., : w.shape[-2], :]


def test_the_nf4_code_book_is_bitsandbytes_and_the_papers():
    assert list(nn.NF4_CODE) == BNB_NF4
    # QLoRA's construction: quantiles of N(0, 1) (bitsandbytes' create_normal_map, offset
    # 0.9677083), 8 on the positive side and 7 on the negative, with an exact 0, scaled to [-1, 1].
    norm = pytest.importorskip("scipy.stats").norm
    offset = 0.9677083
    values = np.concatenate(
        [norm.ppf(np.linspace(offset, 0.5, 9)[:-1]), [0.0], -norm.ppf(np.linspace(offset, 0.5, 8)[:-1])]
    )
    values = np.sort(values) / values.max()
    np.testing.assert_allclose(nn.NF4_CODE, values, atol=2e-7)  # bitsandbytes' are fp32 roundings


@pytest.mark.parametrize("kind", ["nf4", "int8"])
@pytest.mark.parametrize("shape", [(3, 5), (77, 7), (2, 131, 9)])
def test_the_round_trip_is_within_the_bound_and_rounds_to_the_nearest_code(kind, shape):
    w = np.asarray(jax.random.uniform(jax.random.key(len(shape) + shape[-1]), shape, minval=-3, maxval=2))
    codes, scales = nn.quantize(jnp.asarray(w), kind)
    back = np.asarray(nn.dequantize(codes, scales, kind, d_in=shape[-2]))
    assert back.shape == w.shape
    absmax = _block_absmax(w)
    err = np.abs(back - w)
    bound = ERROR_PER_ABSMAX[kind] * absmax
    assert np.all(err <= bound * (1 + 1e-6) + 1e-7), float((err / absmax).max())
    if shape[-2] > 64:  # enough values that some land near the bound: it is tight
        assert (err / absmax).max() > 0.8 * ERROR_PER_ABSMAX[kind]
    v = w / np.where(absmax > 0, absmax, 1)
    if kind == "nf4":  # the nearest code of w / absmax, by brute force
        code = np.asarray(nn.NF4_CODE, np.float32)
        want = code[np.abs(v[..., None] - code).argmin(-1)] * absmax
    else:  # round(w / (absmax / 127))
        scale = absmax / 127
        want = np.round(w / scale) * scale
    np.testing.assert_allclose(back, want, rtol=1e-6, atol=1e-7)


def test_the_storage_is_packed_codes_and_one_fp32_scale_per_block():
    w = jnp.ones((2, 131, 9), jnp.bfloat16)  # 3 blocks of 64 rows, the last padded
    codes, scales = nn.quantize(w, "nf4")
    assert (codes.shape, codes.dtype, scales.shape, scales.dtype) == (
        (2, 96, 9),
        jnp.uint8,
        (2, 3, 9),
        jnp.float32,
    )
    codes, scales = nn.quantize(w, "int8")
    assert (codes.shape, codes.dtype, scales.shape) == ((2, 192, 9), jnp.int8, (2, 3, 9))
    assert nn.dequantize(*nn.quantize(w, "nf4"), "nf4", 131, jnp.bfloat16).dtype == jnp.bfloat16
    zeros = nn.dequantize(*nn.quantize(jnp.zeros((3, 5)), "nf4"), "nf4", 3)
    assert not np.any(np.asarray(zeros))  # an all-zero block: scale 0, no nan


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match=r"quantize: kind='fp8' is not one of nf4, int8"):
        nn.quantize(jnp.ones((3, 5)), "fp8")
    with pytest.raises(ValueError, match=r"w \[\.\.\., d_in, d_out\]"):
        nn.quantize(jnp.ones(5), "nf4")
    codes, scales = nn.quantize(jnp.ones((3, 5)), "nf4")
    with pytest.raises(ValueError, match=r"do not hold d_in=70 rows"):
        nn.dequantize(codes, scales, "nf4", 70)
    like = {"p": {"kernel_codes": np.zeros((32, 5), np.uint8), "kernel_scales": np.zeros((1, 5), np.float32)}}
    with pytest.raises(
        ValueError, match=r"p\.kernel quantizes to kernel_codes \(32, 4\), the model has \(32, 5\)"
    ):
        nn.quantize_params({"p": {"kernel": np.ones((3, 4))}}, like, "nf4")


@pytest.mark.parametrize("kind", [pytest.param("nf4", marks=pytest.mark.slow), "int8"])  # nf4: 2.9 s warm
def test_the_quantized_model_is_the_base_with_its_dequantized_kernels(kind):
    """Every block projection is quantized (the head and embedding are not) and stored
    outside ``nnx.Param``; the model computes what the unquantized LoRA model computes with
    the dequantized kernels; it stays within ``LOGITS_BOUND`` of the unquantized base."""
    base, model = _model(None), _model(kind)
    dequantized = _dequantized_params(model)
    for path in PROJECTIONS:
        layer = _layer(model, path)
        assert isinstance(layer, nn.QuantizedLinear) and layer.kind == kind
        assert nn.logical_axes(layer.kernel_codes) == nn.logical_axes(_layer(base, path).kernel)
        kernel = np.asarray(_layer(base, path).kernel[...])
        group, name = path.split(".")
        err = np.abs(dequantized["blocks"][group][name]["kernel"] - kernel)
        assert np.all(err <= ERROR_PER_ABSMAX[kind] * _block_absmax(kernel) * (1 + 1e-6) + 1e-7), path
    assert (model.blocks.attn.k_proj.lora is None) and model.blocks.attn.q_proj.lora is not None
    assert not isinstance(model.head, nn.QuantizedLinear)
    assert not any("kernel" in key for key in _flat(nnx.state(model.blocks, nnx.Param)))

    tokens = _tokens()[0]
    same = nn.from_params(nn.Transformer, BASE.replace(lora=LORA), dequantized)
    got = _logits(model, tokens)
    np.testing.assert_allclose(got, _logits(same, tokens), rtol=1e-5, atol=1e-6)
    want = _logits(base, tokens)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < LOGITS_BOUND[kind]


def test_a_quantized_projection_takes_its_adapters_dropout_key():
    layer = nn.QuantizedLinear(7, 5, kind="int8", lora=nn.LoraConfig(rank=2, dropout=0.5), rngs=nnx.Rngs(0))
    layer.lora.lora_b[...] = jnp.ones((2, 5))
    x = jax.random.normal(jax.random.key(1), (3, 7))
    plain = np.asarray(layer(x))
    np.testing.assert_array_equal(np.asarray(project(layer, x, None, 3)), plain)
    assert not np.allclose(np.asarray(project(layer, x, jax.random.key(2), 3)), plain)
    frozen = nn.QuantizedLinear(7, 5, kind="int8", rngs=nnx.Rngs(0))  # no adapter: no key taken
    np.testing.assert_array_equal(np.asarray(project(frozen, x, jax.random.key(2), 3)), np.asarray(frozen(x)))


def test_from_params_quantizes_a_plain_base():
    """A base's float kernels (a Hugging Face or converted base) are quantized on the way in;
    a quantized model's own state is taken back as it is."""
    cfg = BASE.replace(lora=LORA, quantize_base="nf4")
    base = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(_model(None), nnx.Param)))
    for group, name in (("attn", "q_proj"), ("attn", "v_proj"), ("mlp", "down")):
        del base["blocks"][group][name]["lora"]  # a plain base
    model = nn.from_params(nn.Transformer, cfg, base, seed=2)
    want = _flat(nnx.state(_model("nf4")))  # the same kernels, quantized, and the same adapters
    got = _flat(nnx.state(model))
    assert got.keys() == want.keys()
    for key, value in want.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)
    again = nn.from_params(nn.Transformer, cfg, nnx.to_pure_dict(nnx.state(model)))
    tokens = _tokens(1)[0]
    np.testing.assert_array_equal(_logits(again, tokens), _logits(model, tokens))


@pytest.mark.slow
def test_adapter_gradients_equal_the_dequantized_models():
    """The quantized matmul's backward pass (``dy @ w.T`` from the codes) gives the adapters
    the gradients of the plain LoRA model with the dequantized kernels, under remat too."""
    graphdef, adapters, rest = nnx.split(_model("nf4"), nnx.LoRAParam, ...)
    keys = iter(jax.random.split(jax.random.key(9), len(jax.tree.leaves(adapters))))
    adapters = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(next(keys), a.shape, a.dtype), adapters)
    model = nnx.merge(graphdef, adapters, rest)
    plain = nn.from_params(nn.Transformer, BASE.replace(lora=LORA), _dequantized_params(model))
    tokens = _tokens(2)

    def grads(m, preset):
        g, a, r = nnx.split(m, nnx.LoRAParam, ...)
        return jax.jit(lambda a: train.loss_and_grads(g, a, r, tokens, remat.get(preset)))(a)

    want_loss, want = grads(plain, "none")
    loss, got = grads(model, "full")  # the layers recomputed: the codes dequantized again
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.abs(np.asarray(w)).max() > 0
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def test_training_moves_the_adapters_only_and_the_base_stays_bit_identical():
    model = nn.Transformer(BASE.replace(lora=LORA, quantize_base="nf4"), rngs=nnx.Rngs(6))
    before = _flat(nnx.state(model))
    trainer = train.Trainer(model, optimizer=train.OptimizerConfig(learning_rate=3e-2, warmup_steps=0))
    tokens = _tokens(3)
    losses = [float(trainer.step(tokens)) for _ in range(5)]
    assert losses[-1] < losses[0] - 0.05, losses
    after = _flat(nnx.state(trainer.model))
    assert before.keys() == after.keys()
    for key, value in before.items():
        assert np.array_equal(value, after[key]) != ("lora" in key), key  # the base unchanged
    moments = [leaf for leaf in jax.tree.leaves(trainer.state[1]) if leaf.ndim > 0]
    assert sum(leaf.nbytes for leaf in moments) == 2 * plan.tree_bytes(
        nnx.state(trainer.model, nnx.LoRAParam)
    )


@pytest.mark.slow
def test_the_stored_and_the_compiled_bytes_are_the_predicted():
    """nf4 stores 0.5 byte per weight + 4 / 64 for the scales (0.5625), int8 1.0625; the
    compiled step takes exactly the parameters, the quantized base, the adapters' two
    moments and the batch; and its temp memory is the unquantized LoRA step's (measured: 1.515
    MiB both; a dequantized fp32 copy of every layer's kernels would be 4.2 MiB here, one
    layer's is 1.4 MiB)."""
    sizes = dict(SIZES, n_layers=3, d_model=192, ffn_dim=448, vocab_size=61)  # d_in multiples of 64
    base = nn.TransformerConfig.preset("tiny", **sizes).replace(lora=LORA)
    weights = sizes["n_layers"] * (192 * (192 + 2 * 96 + 192) + 3 * 192 * 448)  # q, k, v (GQA), o; the MLP
    shape = (1, 1, 9)
    temps = {}
    int8 = nnx.eval_shape(lambda: nn.Transformer(base.replace(quantize_base="int8"), rngs=nnx.Rngs(0)))
    assert plan.tree_bytes(nnx.state(int8, nn.QuantizedBase)) == 1.0625 * weights
    for kind, per_weight in ((None, 0.0), ("nf4", 0.5625)):
        trainer = train.Trainer(nn.Transformer(base.replace(quantize_base=kind), rngs=nnx.Rngs(0)))
        model = trainer.model
        quantized = plan.tree_bytes(nnx.state(model, nn.QuantizedBase))
        assert quantized == per_weight * weights
        params = plan.tree_bytes(nnx.state(model, nnx.Param))
        adapters = plan.tree_bytes(nnx.state(model, nnx.LoRAParam))
        counts = plan.tree_bytes(trainer.state) - params - quantized - 2 * adapters
        assert 0 <= counts <= 64
        analysis = trainer.compile(shape).memory_analysis()
        assert (
            analysis.argument_size_in_bytes == params + quantized + 2 * adapters + counts + np.prod(shape) * 4
        )
        temps[kind] = analysis.temp_size_in_bytes
    one_layer = 4 * weights / sizes["n_layers"]
    assert temps["nf4"] <= temps[None] + one_layer, (temps, one_layer)


def test_fsdp_splits_the_quantized_base():
    """The codes and scales carry the kernel's logical axes, so FSDP splits them as it
    splits a kernel (along the largest axis that the mesh divides)."""
    model = nnx.eval_shape(
        lambda: nn.Transformer(BASE.replace(lora=LORA, quantize_base="nf4"), rngs=nnx.Rngs(0))
    )
    shardings = train.state_shardings(nnx.state(model), train.make_mesh("fsdp=8"))
    down = shardings["blocks"]["mlp"]["down"]  # d_in 136: 3 blocks of 64 rows
    assert tuple(down["kernel_codes"].get_value().spec) == (None, "fsdp", None)  # [L, 192 / 2, 72]
    assert tuple(down["kernel_scales"].get_value().spec) == (None, None, "fsdp")  # [L, 3, 72]
    assert nn.logical_axes(model.blocks.mlp.down.kernel_codes) == ("layers", "mlp", "embed")


@pytest.mark.slow
def test_the_cli_trains_qlora_and_the_loss_falls(capsys):
    argv = ["train", "--model", "tiny", "--layers", "1", "--batch", "4", "--seq", "32", "--steps", "20"]
    argv += ["--lr", "1e-2", "--lora", "8", "--quantize-base", "nf4", "--json"]
    assert main(argv) == 0
    losses = [step["loss"] for step in json.loads(capsys.readouterr().out)["steps"]]
    assert len(losses) == 20 and np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.2, losses
