"""The tiled MLP (``TransformerConfig.mlp_chunk``): the untiled numbers, one chunk's
intermediates in the compiled backward, the remat tags kept, the sharding pins inside chunks.

Sizes are odd and pairwise distinct (B=3, T=13, D=11, F=17, a chunk of 5 that leaves a
remainder), so an axis mix-up or a dropped padding row fails.
"""

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxckpt import nn, remat
from jaxckpt.nn import MLP, TransformerConfig, activation_sharding
from jaxckpt.remat import RematSpec, Tag
from jaxckpt.remat._residuals import saved_residuals

B, T, D, F, CHUNK = 3, 13, 11, 17, 5
SWIGLU = TransformerConfig(d_model=D, n_heads=1, head_dim=4, ffn_dim=F)
GELU_BIAS = TransformerConfig(
    family="gpt2", d_model=D, n_heads=1, ffn_dim=F, mlp_bias=True, activation="gelu"
)
LORA = SWIGLU.replace(lora=nn.LoraConfig(rank=3, targets=("gate", "up", "down")))
QLORA = LORA.replace(quantize_base="nf4")
CASES = {"swiglu": SWIGLU, "gelu+bias": GELU_BIAS, "swiglu+lora": LORA, "swiglu+qlora-nf4": QLORA}


def _randomised(module: nnx.Module, seed: int) -> nnx.Module:
    """``module`` with every parameter (kernels, biases, LoRA's zero ``b``) drawn afresh."""
    rng = np.random.default_rng(seed)
    state = nnx.state(module, nnx.Param)
    fresh = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape).astype(np.float32) / 3), state)
    nnx.update(module, fresh)
    return module


def _rel(a, b) -> float:
    """``max |a - b| / max |b|`` over one array (elementwise, no sum that could cancel)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def _output_and_grads(config: TransformerConfig, x, w):
    """The MLP's output ``[B, T, D]`` and, for the cotangent ``w``, the gradients towards the
    trainable parameters and x."""
    model = _randomised(MLP(config, rngs=nnx.Rngs(0)), seed=1)
    graphdef, params, rest = nnx.split(model, nn.trainable(config), ...)

    @jax.jit
    def run(params, x):
        y, vjp = jax.vjp(lambda p, x: nnx.merge(graphdef, p, rest)(x), params, x)
        return y, vjp(w)

    return run(params, x)


@pytest.mark.parametrize("name", CASES)
def test_tiled_equals_untiled_forward_and_gradients(name):
    config = CASES[name]
    key_x, key_w = jax.random.split(jax.random.key(2))
    x = jax.random.normal(key_x, (B, T, config.d_model), jnp.float32)
    w = jax.random.normal(key_w, (B, T, config.d_model), jnp.float32)
    y, (g_params, g_x) = _output_and_grads(config, x, w)
    tiled, (t_params, t_x) = _output_and_grads(config.replace(mlp_chunk=CHUNK), x, w)
    assert _rel(tiled, y) <= 1e-6
    assert _rel(t_x, g_x) <= 1e-6
    leaves, tiled_leaves = jax.tree.leaves(g_params), jax.tree.leaves(t_params)
    assert len(leaves) == len(tiled_leaves) >= 3
    for g, t in zip(leaves, tiled_leaves, strict=True):
        assert _rel(t, g) <= 1e-6


def test_a_chunk_of_t_or_more_is_the_untiled_mlp():
    """A chunk that covers T runs the plain MLP: no scan in its program."""
    x = jnp.ones((B, T, D), jnp.float32)
    for chunk, scans in ((T, False), (T + 2, False), (CHUNK, True)):
        model = MLP(SWIGLU.replace(mlp_chunk=chunk), rngs=nnx.Rngs(0))
        assert ("scan" in str(jax.make_jaxpr(model)(x))) == scans


# --- the tags under tiling: the outer remat policy decides for the chunks' values --------------

TINY = TransformerConfig.preset(
    "tiny", n_layers=1, d_model=D, n_heads=1, n_kv_heads=1, head_dim=4, ffn_dim=F, vocab_size=19
)


def _residuals(config: TransformerConfig, spec: RematSpec):
    """The residuals one remat'd layer (``nn.run_blocks``) saves for its backward pass."""
    model = nnx.eval_shape(lambda: nn.Transformer(config, rngs=nnx.Rngs(0)))  # shapes only
    graphdef, state = nnx.split(model)
    x = jax.ShapeDtypeStruct((B, T, D), jnp.float32)

    def layer(state, x):
        return jnp.sum(nn.run_blocks(nnx.merge(graphdef, state).blocks, x, spec, n_layers=1))

    return saved_residuals(layer, state, x)


def _mlp_sized(residuals) -> list[tuple[int, ...]]:
    """Shapes of the saved activations ``F`` wide (not the parameters, which are arguments):
    ``[1, B, T, F]`` untiled, ``[1, n, B, chunk, F]`` stacked over chunks (the leading 1 is
    the scan over the one layer)."""
    return sorted(r.shape for r in residuals if r.shape[-1:] == (F,) and "argument" not in r.src)


def test_saved_mlp_tags_stay_saved_stacked_over_chunks():
    n = -(-T // CHUNK)
    spec = RematSpec(save={Tag.MLP_UP, Tag.MLP_GATE})
    assert _mlp_sized(_residuals(TINY, spec)) == [(1, B, T, F)] * 2
    assert _mlp_sized(_residuals(TINY.replace(mlp_chunk=CHUNK), spec)) == [(1, n, B, CHUNK, F)] * 2


def test_full_remat_saves_no_mlp_intermediate_tiled_or_not():
    for config in (TINY, TINY.replace(mlp_chunk=CHUNK)):
        assert _mlp_sized(_residuals(config, remat.get("full"))) == []


def test_without_remat_the_chunks_are_still_recomputed():
    """The ``none`` preset keeps every MLP intermediate untiled, and none tiled: each chunk
    is a ``jax.checkpoint``, whose backward recomputes it from the chunk's input."""
    assert len(_mlp_sized(_residuals(TINY, remat.get("none")))) >= 3
    assert _mlp_sized(_residuals(TINY.replace(mlp_chunk=CHUNK), remat.get("none"))) == []


# --- the sharding pins hold inside the chunks ------------------------------------------------


def _constraints(jaxpr) -> list[tuple]:
    """The ``PartitionSpec`` of every sharding constraint in ``jaxpr`` and its sub-jaxprs."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "sharding_constraint":
            found.append(tuple(eqn.params["sharding"].spec))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _constraints(sub)
    return found


def test_fsdp_pins_hold_inside_each_chunk():
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    model = MLP(SWIGLU.replace(mlp_chunk=CHUNK), rngs=nnx.Rngs(0))
    x = jnp.ones((8, T, D), jnp.float32)
    with activation_sharding(mesh, {"batch": "fsdp"}):
        jaxpr = jax.make_jaxpr(model)(x).jaxpr
    scan = next(e for e in jaxpr.eqns if e.primitive.name == "scan")
    inside = _constraints(scan.params["jaxpr"].jaxpr)
    # the chunk's input, then up and gate ([B, chunk, F]): batch over fsdp, the rest whole
    assert inside.count(("fsdp", None, None)) == 3, inside


# --- the compiled backward holds one chunk's intermediates -----------------------------------

MEM_T, MEM_CHUNK, MEM_F = 255, 51, 509
"""A layer whose MLP dominates its backward: T=255 tokens, F=509, chunks of 51 (5 chunks)."""


def _layer_temp_bytes(config: TransformerConfig) -> int:
    """XLA:CPU's temp bytes of one ``full``-remat layer's value_and_grad (params and input)."""
    model = nn.Transformer(config, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def layer(params, x):
        blocks = nnx.merge(graphdef, params, rest).blocks
        return jnp.sum(nn.run_blocks(blocks, x, remat.get("full"), n_layers=1))

    x = jax.ShapeDtypeStruct((1, MEM_T, config.d_model), jnp.float32)
    compiled = jax.jit(jax.value_and_grad(layer, argnums=(0, 1))).lower(params, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.fixture(scope="module")
def layer_temps() -> dict:
    config = TransformerConfig.preset(
        "tiny", n_layers=1, d_model=13, n_heads=1, n_kv_heads=1, head_dim=4, ffn_dim=MEM_F
    )
    return {
        "untiled": _layer_temp_bytes(config),
        "tiled": _layer_temp_bytes(config.replace(mlp_chunk=MEM_CHUNK)),
    }


@pytest.mark.slow
def test_compiled_backward_holds_one_chunk_of_intermediates(layer_temps):
    """Expected fall, from the shapes: a recomputed SwiGLU layer's backward holds 7 ``[T, F]``
    fp32 tensors on XLA:CPU, as the planner counts them (``plan.layer_graph``: the residuals
    gate, up and the activation, the activation's 3 held internals, and one F-wide
    cotangent); tiled, 7 ``[chunk, F]``. The fall is 7 x (255 - 51) x 509 x 4 = 2,907,408
    bytes, asserted within 15% (measured: 3,979,724 -> 987,216 bytes, a fall of 2,992,508)."""
    expected = 7 * (MEM_T - MEM_CHUNK) * MEM_F * 4
    fall = layer_temps["untiled"] - layer_temps["tiled"]
    assert abs(fall - expected) <= 0.15 * expected, (layer_temps, fall, expected)
    assert layer_temps["tiled"] < layer_temps["untiled"] / 3


# --- the config refuses what tiling cannot keep equal -----------------------------------------


@pytest.mark.parametrize("chunk", [0, -4, 2.5, True])
def test_mlp_chunk_must_be_a_positive_int(chunk):
    with pytest.raises(ValueError, match=r"TransformerConfig: mlp_chunk=.* must be a positive int"):
        SWIGLU.replace(mlp_chunk=chunk)


def test_lora_dropout_on_the_mlp_is_refused_by_name():
    lora = nn.LoraConfig(rank=2, targets=("q", "up"), dropout=0.1)
    with pytest.raises(ValueError, match=r"mlp_chunk=4 tiles the MLP, and lora.dropout=0.1 .*\['up'\]"):
        SWIGLU.replace(lora=lora, mlp_chunk=4)
    # dropout on attention's adapters only: the MLP has none, tiling is fine
    attention_only = dataclasses.replace(lora, targets=("q", "v"))
    assert SWIGLU.replace(lora=attention_only, mlp_chunk=4).mlp_chunk == 4


def test_mlp_chunk_round_trips_through_the_config_dict():
    config = SWIGLU.replace(mlp_chunk=CHUNK)
    assert TransformerConfig.from_dict(config.to_dict()) == config
    assert config != SWIGLU


@pytest.mark.slow
def test_a_model_under_a_spec_that_saves_and_offloads_mlp_tags_keeps_its_numbers():
    """Through the scanned, remat'd stack: ``offload_minimal`` saves the MLP's projections
    (stacked over chunks) and offloads them to host memory, tiled or not."""
    if not remat.has_pinned_host():
        pytest.skip("no pinned_host memory on this backend")
    tokens = jnp.arange(3 * T, dtype=jnp.int32).reshape(3, T) % TINY.vocab_size

    def loss_and_grads(config):
        graphdef, params, rest = nnx.split(nn.Transformer(config, rngs=nnx.Rngs(0)), nnx.Param, ...)

        def loss(params):
            return jnp.sum(nnx.merge(graphdef, params, rest)(tokens, remat="offload_minimal") ** 2)

        return jax.jit(jax.value_and_grad(loss))(params)

    expected, tiled = loss_and_grads(TINY), loss_and_grads(TINY.replace(mlp_chunk=CHUNK))
    for e, t in zip(jax.tree.leaves(expected), jax.tree.leaves(tiled), strict=True):
        assert _rel(t, e) <= 1e-6
