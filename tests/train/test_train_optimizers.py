"""``train.OptimizerConfig``: AdamW (float32 or bfloat16 moments), Adafactor and SGD with
momentum train, hold the state bytes they should (in the tree and in the compiled step),
cover the LoRA adapters only, checkpoint, and offload their state to host memory."""

import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxckpt import nn, train
from jaxckpt.cli import main
from jaxckpt.train import _offload

# d_model and ffn_dim >= 128: optax's Adafactor factors the [L, d_model, ffn_dim] kernels.
CFG = nn.TransformerConfig.preset(
    "tiny", d_model=130, n_layers=1, n_heads=5, n_kv_heads=1, head_dim=26, ffn_dim=134
)
REMAT = "none"  # the step these tests compile (a run setting: Trainer(remat=), RunConfig.remat)
SHAPE = (1, 3, 18)
FAST = dict(learning_rate=1e-2, warmup_steps=0)


def _batch(seed=1):
    return jax.random.randint(jax.random.key(seed), SHAPE, 0, CFG.vocab_size)


def _nbytes(tree) -> int:
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _param_leaves(model, wrt=nnx.Param):
    return jax.tree.leaves(nnx.state(model, wrt))


def _adafactor_bytes(params) -> int:
    """optax's factored state, from the shapes alone: a leaf whose two largest dims are both
    >= 128 keeps a row and a column statistic (and a 1-element placeholder for v), any
    other leaf a full v (and two placeholders); all float32."""
    total = 0
    for p in params:
        dims = sorted(p.shape)[-2:]
        if len(dims) == 2 and min(dims) >= 128:
            big = sorted(range(p.ndim), key=lambda d: p.shape[d])[-2:]
            rows = math.prod(s for d, s in enumerate(p.shape) if d != big[1])
            cols = math.prod(s for d, s in enumerate(p.shape) if d != big[0])
            total += rows + cols + 1
        else:
            total += p.size + 2
    return 4 * total


def _expected_state_bytes(name: str, moments_dtype, params) -> int:
    p = sum(x.size for x in params)
    return {
        ("adamw", None): 2 * 4 * p,
        ("adamw", "bfloat16"): 2 * 2 * p,  # half of float32: mu and nu both in bf16
        ("sgd", None): 4 * p,  # the momentum trace
        ("adafactor", None): _adafactor_bytes(params),
    }[name, moments_dtype]


def _moment_bytes(optimizer) -> int:
    """The optimizer state's array bytes, scalars (step counts) left out."""
    return sum(x.nbytes for x in jax.tree.leaves(nnx.state(optimizer.opt_state)) if x.ndim)


@functools.cache
def _compiled_trainer(name: str, moments_dtype: str | None) -> tuple[train.Trainer, jax.stages.Compiled]:
    """A trainer of ``name`` and its compiled step, built once per module: the test that
    trains each optimizer and the one that compares their compiled argument bytes share
    the compile (the argument bytes do not change as the trainer steps)."""
    config = train.OptimizerConfig(name=name, moments_dtype=moments_dtype, **FAST)
    trainer = train.Trainer(nn.Transformer(CFG, rngs=nnx.Rngs(0)), optimizer=config, remat=REMAT)
    return trainer, trainer.compile(SHAPE)


@pytest.mark.parametrize(
    "name, moments_dtype", [("adamw", None), ("adamw", "bfloat16"), ("adafactor", None), ("sgd", None)]
)
def test_each_optimizer_trains_and_holds_the_state_it_should(name, moments_dtype):
    trainer, compiled = _compiled_trainer(name, moments_dtype)
    model, optimizer = nnx.merge(trainer.graphdef, trainer.state)
    params = _param_leaves(model)
    assert _moment_bytes(optimizer) == _expected_state_bytes(name, moments_dtype, params)
    if moments_dtype:
        dtypes = {x.dtype for x in jax.tree.leaves(nnx.state(optimizer.opt_state)) if x.ndim}
        assert dtypes == {jnp.dtype(moments_dtype)}
    # The compiled step's arguments are the state (model + optimizer) and the batch; jit
    # leaves out the arguments it never reads: Adafactor's 1-element placeholders.
    unread = _nbytes(trainer.state) + math.prod(SHAPE) * 4 - compiled.memory_analysis().argument_size_in_bytes
    assert unread == 0 or (name == "adafactor" and 0 < unread <= 8 * len(params)), unread
    losses = [float(trainer.step(_batch())) for _ in range(6)]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.05, losses


@pytest.mark.slow  # the test above checks each compiled state against its tree
def test_bfloat16_moments_halve_the_compiled_state():
    """From the compiled steps' argument bytes, no tree sizes: bf16 moments save one
    params-sized float32 tree (2 x 4 bytes -> 2 x 2 bytes per parameter), and SGD's momentum
    is one params-sized tree fewer than AdamW's two."""

    def argument_bytes(name="adamw", moments_dtype=None) -> int:
        return _compiled_trainer(name, moments_dtype)[1].memory_analysis().argument_size_in_bytes

    params = _nbytes(_param_leaves(nn.Transformer(CFG, rngs=nnx.Rngs(0))))
    adamw = argument_bytes()
    assert adamw - argument_bytes(moments_dtype="bfloat16") == params
    assert abs(adamw - argument_bytes(name="sgd") - params) <= 16  # a step count or two


@pytest.mark.parametrize("name", list(train.OPTIMIZERS))
def test_lora_optimizer_state_covers_the_adapters_only(name):
    cfg = CFG.replace(lora=nn.LoraConfig(rank=3, targets=("q", "v", "down")), param_dtype="bfloat16")
    model = nn.Transformer(cfg, rngs=nnx.Rngs(0))
    optimizer = train.OptimizerConfig(name=name).build(model)
    adapters = _param_leaves(model, nnx.LoRAParam)
    assert len(adapters) == 6 and len(_param_leaves(model)) > len(adapters)
    paths = [path for path, x in nnx.to_flat_state(nnx.state(optimizer.opt_state)) if x.get_value().ndim]
    assert paths and all("lora" in path for path in paths), paths
    assert _moment_bytes(optimizer) == _expected_state_bytes(name, None, adapters)


def test_stored_moments_follow_optax():
    """``scale_by_adam_stored`` / ``trace_stored``: optax's formula and state; in float32
    equal to optax's, in bf16 (both moments, which optax's ``mu_dtype`` does not give)
    within bf16's precision and still bf16 after every update."""
    params = {"w": jnp.linspace(-1.0, 1.0, 37), "b": jnp.ones((3, 5))}
    # gradients of one sign: bf16 moments would lose a sum that cancels to a few ulps
    grads = [jax.tree.map(lambda p, k=k: 1.0 + 0.5 * jnp.sin(p * 7.0 + k), params) for k in range(5)]
    cases = [
        (train.scale_by_adam_stored(0.9, 0.95, 1e-8, "float32"), optax.scale_by_adam(0.9, 0.95, 1e-8), 1e-6),
        (
            train.scale_by_adam_stored(0.9, 0.95, 1e-8, "bfloat16"),
            optax.scale_by_adam(0.9, 0.95, 1e-8),
            2**-6,
        ),
        (train.trace_stored(0.9, "float32"), optax.trace(0.9), 1e-6),
        (train.trace_stored(0.9, "bfloat16"), optax.trace(0.9), 2**-6),
    ]
    for ours, theirs, rtol in cases:
        s_ours, s_theirs = ours.init(params), theirs.init(params)
        assert jax.tree.structure(s_ours) == jax.tree.structure(s_theirs)
        with jax.numpy_dtype_promotion("standard"):  # as the train step runs optax
            for g in grads:
                u_ours, s_ours = ours.update(g, s_ours, params)
                u_theirs, s_theirs = theirs.update(g, s_theirs, params)
        stored = {x.dtype for x in jax.tree.leaves(s_ours) if x.ndim}
        assert stored == {jnp.dtype(jnp.bfloat16 if rtol > 1e-6 else jnp.float32)}
        for a, b in zip(jax.tree.leaves(s_ours), jax.tree.leaves(s_theirs), strict=True):
            np.testing.assert_allclose(a.astype(jnp.float32), b, rtol=rtol, atol=1e-7)
        for a, b in zip(jax.tree.leaves(u_ours), jax.tree.leaves(u_theirs), strict=True):
            # mu's cancellations in bf16 cost a few ulps of the largest update
            np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * float(jnp.abs(b).max()))


def test_bfloat16_state_updates_in_place():
    """The update of bf16 moments needs no temporary buffer (optax's ``mu_dtype`` steps from
    the unrounded moments: XLA:CPU keeps the new ones aside, half the params' bytes each)."""
    params = {"w": jax.ShapeDtypeStruct((7, 129, 131), jnp.float32)}

    def temp(tx) -> int:
        state = jax.eval_shape(tx.init, params)

        def step(p, s, g):
            with jax.numpy_dtype_promotion("standard"):
                u, s = tx.update(g, s, p)
                return optax.apply_updates(p, u), s

        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, params).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    moment = 7 * 129 * 131 * 2  # one bf16 moment
    for name in ("adamw", "sgd"):
        assert temp(train.OptimizerConfig(name=name, moments_dtype="bfloat16").transformation()) < 1024
    assert temp(optax.adamw(1e-3, mu_dtype=jnp.bfloat16)) >= moment


def test_float16_params_keep_float32_moments():
    model = nn.Transformer(CFG.replace(param_dtype="float16"), rngs=nnx.Rngs(0))
    optimizer = train.OptimizerConfig().build(model)
    assert {x.dtype for x in jax.tree.leaves(nnx.state(optimizer.opt_state)) if x.ndim} == {
        jnp.dtype(jnp.float32)
    }


def test_checkpoints_restore_each_optimizer(tmp_path):
    def states(seed):
        return nnx.State(
            {
                name: train.Trainer(
                    nn.Transformer(CFG, rngs=nnx.Rngs(seed)),
                    optimizer=train.OptimizerConfig(name=name, moments_dtype="bfloat16"),
                    remat=REMAT,
                ).state
                for name in train.OPTIMIZERS
            }
        )

    saved = jax.tree.map(lambda x: x + jnp.ones_like(x), states(0))  # not the initial values
    train.save_checkpoint(tmp_path, 3, saved)
    step, restored = train.restore_checkpoint(tmp_path, states(1))
    assert step == 3
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(restored), strict=True):
        assert a.dtype == b.dtype and bool(jnp.array_equal(a, b))


def test_offloaded_state_lives_in_host_memory_and_trains_alike():
    def run(offload):
        config = train.OptimizerConfig(offload=offload, **FAST)
        trainer = train.Trainer(nn.Transformer(CFG, rngs=nnx.Rngs(0)), optimizer=config, remat=REMAT)
        losses = [float(trainer.step(_batch())) for _ in range(3)]
        return trainer, losses

    trainer, losses = run(True)
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(trainer.state[1]["opt_state"])}
    assert kinds == {"pinned_host"}
    params = jax.tree.leaves(nnx.state(trainer.model, nnx.Param))
    assert {x.sharding.memory_kind for x in params} == {"device"}
    np.testing.assert_allclose(losses, run(False)[1], rtol=1e-5)


def test_offload_refuses_a_device_without_host_memory(monkeypatch):
    monkeypatch.setattr(_offload, "has_pinned_host", lambda device=None: False)
    with pytest.raises(ValueError, match="offload=True needs a 'pinned_host' memory space"):
        train.Trainer(
            nn.Transformer(CFG, rngs=nnx.Rngs(0)), optimizer=train.OptimizerConfig(offload=True), remat=REMAT
        )


def test_stream_to_host_updates_leaf_by_leaf_like_the_whole_tree():
    params = {"a": jnp.ones((3, 5)), "b": {"c": jnp.arange(7.0)}}
    grads = jax.tree.map(lambda x: jnp.cos(x) + 0.5, params)
    for inner in (optax.adamw(0.1), optax.adafactor(0.1, min_dim_size_to_factor=3), optax.sgd(0.1, 0.9)):
        tx = train.stream_to_host(inner)
        state = tx.init(params)
        assert jax.tree.structure(state) == jax.tree.structure(inner.init(params))
        with jax.numpy_dtype_promotion("standard"):
            ours = jax.jit(tx.update)(grads, state, params)
            theirs = jax.jit(inner.update)(grads, inner.init(params), params)
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(name="lamb"), "name='lamb' is not one of adamw, adafactor, sgd"),
        (dict(moments_dtype="float16"), "moments_dtype='float16' is not one of float32, bfloat16"),
        (dict(momentum=1.5), "momentum=1.5 must be in [0, 1)"),
        (dict(loss_scale="huge"), "loss_scale='huge' must be one of auto, dynamic, none"),
        (dict(loss_scale=-2.0), "loss_scale=-2.0 must be"),
        (dict(loss_scale_period=0), "loss_scale_period=0 must be a positive int"),
    ],
)
def test_bad_optimizer_settings_name_the_field(fields, message):
    with pytest.raises(ValueError) as err:
        train.OptimizerConfig(**fields)
    assert message in str(err.value)


def test_config_round_trips_and_numbers_are_static_scales():
    config = train.OptimizerConfig(name="sgd", momentum=0.5, offload=True, loss_scale="1024")
    assert config.loss_scale == 1024.0
    assert train.OptimizerConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    with pytest.raises(ValueError, match=r"OptimizerConfig: unknown field\(s\) \['lr'\]"):
        train.OptimizerConfig.from_dict({"lr": 1.0})


@pytest.mark.slow
def test_cli_trains_with_sgd_bf16_moments_offloaded(capsys):
    argv = ["train", "--layers", "1", "--batch", "2", "--seq", "16", "--steps", "2"]
    argv += ["--optimizer", "sgd", "--moments-dtype", "bfloat16", "--offload-optimizer", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    optimizer = result["optimizer"]
    assert (optimizer["name"], optimizer["moments_dtype"], optimizer["offload"]) == ("sgd", "bfloat16", True)
    assert optimizer["offload_saves_memory"] is False  # CPU: host memory is the same RAM
    assert result["skipped_steps"] == 0 and result["loss_scale"] is None


def test_cli_names_the_optimizer_flag(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--loss-scale", "-1", "--steps", "1", "--seq", "8"])
    assert (
        "--loss-scale '-1' must be one of auto, dynamic, none or a positive number" in capsys.readouterr().err
    )


def test_cli_says_offload_saves_nothing_on_cpu():
    from jaxckpt.cli._train import optimizer_lines

    result = {"optimizer": {"name": "adamw", "offload": True, "offload_saves_memory": False}}
    lines = optimizer_lines({**result, "loss_scale": None, "skipped_steps": 0})
    assert lines == [
        "optimizer state (adamw) offloaded to pinned_host memory "
        "(on CPU the same RAM as the device's: nothing saved)"
    ]


@pytest.mark.slow
def test_cli_remat_auto_plans_the_optimizer_it_trains(capsys):
    """``jaxckpt train --remat auto`` compiles the step it then runs: SGD with bf16 momentum
    here, not the default AdamW (the plan's measured peak is the run's)."""
    argv = ["train", "--model", "tiny", "--layers", "1", "--batch", "2", "--seq", "16", "--steps", "1"]
    argv += [
        "--remat",
        "auto",
        "--budget",
        "1GiB",
        "--optimizer",
        "sgd",
        "--moments-dtype",
        "bfloat16",
        "--json",
    ]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["plan"]["measured_bytes"] == result["memory"]["peak"]
