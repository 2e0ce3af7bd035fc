"""float16 training with dynamic loss scaling: an overflow skips the step (params and
optimizer state bit-identical) and halves the scale, good steps grow it, the loss falls,
the scale is checkpointed, and the skip also guards a run without loss scaling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxckpt import nn, remat, train
from jaxckpt.cli import main

CFG = nn.TransformerConfig.preset(
    "tiny",
    d_model=30,
    n_layers=1,
    n_heads=5,
    n_kv_heads=1,
    head_dim=6,
    ffn_dim=22,
    dtype="float16",
)
REMAT = "none"  # the step these tests compile (a run setting: RunConfig.remat, Trainer(remat=))
SHAPE = (1, 3, 17)
FAST = dict(learning_rate=1e-2, warmup_steps=0)


def _batch(seed=1):
    return jax.random.randint(jax.random.key(seed), SHAPE, 0, CFG.vocab_size)


def _snapshot(trainer) -> list:
    """Copies of every trained value: params, optimizer state and step count."""
    kept = (nnx.state(trainer.model, nnx.Param), trainer.state[1]["opt_state"], trainer.state[1]["step"])
    return [np.asarray(x).copy() for x in jax.tree.leaves(kept)]


@pytest.mark.slow
@pytest.mark.parametrize("offload", [False, True])
def test_overflow_skips_the_step_and_halves_the_scale_then_good_steps_grow_it(offload):
    config = train.OptimizerConfig(loss_scale_init=2.0**40, loss_scale_period=4, offload=offload, **FAST)
    trainer = train.Trainer(nn.Transformer(CFG, rngs=nnx.Rngs(0)), optimizer=config, remat=REMAT)
    before = _snapshot(trainer)
    loss = float(trainer.step(_batch()))
    assert np.isfinite(loss)  # the loss is unscaled; its float16 gradients overflowed
    assert trainer.loss_scale() == {"mode": "dynamic", "scale": 2.0**39, "skipped_steps": 1}
    assert trainer.step_count == 0
    for a, b in zip(before, _snapshot(trainer), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)  # bit-identical
    # jmp's rule, step by step: halve on a skip; double after `period` good steps in a row.
    scale, good, losses, grew = 2.0**39, 0, [], 0
    for _ in range(40):
        skipped = trainer.loss_scale()["skipped_steps"]
        losses.append(float(trainer.step(_batch())))
        state = trainer.loss_scale()
        if state["skipped_steps"] > skipped:
            scale, good = scale / 2, 0
        else:
            good += 1
            if good == config.loss_scale_period:
                scale, good, grew = scale * 2, 0, grew + 1
        assert state["scale"] == scale
    assert grew >= 2
    assert trainer.step_count == 41 - trainer.loss_scale()["skipped_steps"]
    assert losses[-1] < losses[0] - 0.5, losses


def test_scaler_adjusts_as_jmp():
    scaler = train.LossScaler("dynamic", 4.0, period=3)
    for expected in (4.0, 4.0, 8.0, 8.0):
        scaler.adjust(jnp.bool_(True))
        assert float(scaler.scale[...]) == expected
    scaler.adjust(jnp.bool_(False))
    assert (float(scaler.scale[...]), int(scaler.good_steps[...]), int(scaler.skipped[...])) == (4.0, 0, 1)
    static = train.LossScaler("static", 128.0)
    static.adjust(jnp.bool_(False))
    assert (float(static.scale[...]), int(static.skipped[...])) == (128.0, 0)  # never skips by itself


def test_loss_falls_in_float16_and_the_run_reports_skips():
    run = train.RunConfig(
        steps=12, batch=3, seq=16, progress=False, optimizer=train.OptimizerConfig(**FAST), remat=REMAT
    )
    run = train.train(CFG, run)
    result = run.to_dict()
    losses = [s["loss"] for s in result["steps"]]
    assert all(np.isfinite(losses)) and np.mean(losses[-3:]) < losses[0] - 0.5, losses
    assert result["optimizer"]["loss_scale_mode"] == "dynamic"
    assert result["skipped_steps"] == sum(s["skipped"] for s in result["steps"])
    assert result["loss_scale"] == result["steps"][-1]["loss_scale"] > 1


def test_resume_continues_the_scale_and_the_skip_count(tmp_path):
    optimizer = train.OptimizerConfig(loss_scale_init=2.0**40, **FAST)
    run = train.RunConfig(
        steps=3,
        batch=3,
        seq=16,
        progress=False,
        optimizer=optimizer,
        checkpoint={"dir": tmp_path},
        remat=REMAT,
    )
    first = train.train(CFG, run)
    assert (first.skipped_steps, first.loss_scale) == (3, 2.0**37)
    resumed = train.train(CFG, run.replace(steps=5, checkpoint={"resume": True}))
    assert [s["step"] for s in resumed.steps] == [3, 4]
    assert (resumed.skipped_steps, resumed.loss_scale) == (5, 2.0**35)  # not 2**38: the scale was restored


@pytest.mark.slow  # 2 s or more with the compile cache warm
def test_float16_params_train_with_float32_moments():
    cfg = CFG.replace(param_dtype="float16")
    trainer = train.Trainer(
        nn.Transformer(cfg, rngs=nnx.Rngs(0)), optimizer=train.OptimizerConfig(**FAST), remat=REMAT
    )
    losses = [float(trainer.step(_batch())) for _ in range(10)]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.3, losses
    assert {p.dtype for p in jax.tree.leaves(nnx.state(trainer.model, nnx.Param))} == {jnp.dtype(jnp.float16)}
    moments = [x for x in jax.tree.leaves(trainer.state[1]["opt_state"]) if x.ndim]
    assert {x.dtype for x in moments} == {jnp.dtype(jnp.float32)}


@pytest.mark.parametrize(
    "fields, loss_scale, mode",
    [
        (dict(dtype="float32"), "auto", "none"),
        (dict(dtype="bfloat16"), "auto", "none"),
        (dict(dtype="float16"), "auto", "dynamic"),
        (dict(dtype="float32", param_dtype="float16"), "auto", "dynamic"),
        (dict(dtype="float16"), "none", "none"),
        (dict(dtype="float32"), "dynamic", "dynamic"),
        (dict(dtype="float32"), 256, "static"),
    ],
)
def test_loss_scaling_is_on_for_float16_models_by_default(fields, loss_scale, mode):
    config = train.OptimizerConfig(loss_scale=loss_scale)
    built = nnx.eval_shape(lambda: config.build(nn.Transformer(CFG.replace(**fields), rngs=nnx.Rngs(0))))
    assert built.loss_scaler.mode == mode


@pytest.mark.slow  # two compiles; the overflow test above trains through the same unscaling
def test_scaled_gradients_equal_unscaled_ones_over_micro_batches():
    cfg = CFG.replace(dtype="float32")
    graphdef, params, rest = nnx.split(nn.Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    batch = jax.random.randint(jax.random.key(2), (3, 2, 11), 0, cfg.vocab_size)
    grads = jax.jit(train.loss_and_grads, static_argnums=(0, 4))
    plain = grads(graphdef, params, rest, batch, remat.get("none"))
    scaled = grads(graphdef, params, rest, batch, remat.get("none"), None, jnp.float32(2.0**12))
    np.testing.assert_allclose(scaled[0], plain[0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(scaled[1]), jax.tree.leaves(plain[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_skip_guards_a_run_without_loss_scaling():
    """``skip_nonfinite=True`` without loss scaling (float32): a non-finite loss (a poisoned
    parameter) skips the step, and nothing but the skip count changes."""
    model = nn.Transformer(CFG.replace(dtype="float32"), rngs=nnx.Rngs(0))
    model.embed.embedding[...] = model.embed.embedding[...].at[0, 0].set(jnp.inf)
    config = train.OptimizerConfig(skip_nonfinite=True, **FAST)
    trainer = train.Trainer(model, optimizer=config, remat=REMAT)
    before = [np.asarray(x).copy() for x in jax.tree.leaves(trainer.state)]
    loss = float(trainer.step(jnp.zeros(SHAPE, jnp.int32)))
    assert not np.isfinite(loss)
    assert trainer.loss_scale() == {"mode": "none", "scale": None, "skipped_steps": 1}
    after = [np.asarray(x) for x in jax.tree.leaves(trainer.state)]
    changed = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if not np.array_equal(a, b)]
    assert len(changed) == 1  # the skip count alone


def test_cli_line_of_the_skipped_steps():
    from jaxckpt.cli._train import optimizer_lines

    result = {"optimizer": {"offload": False}, "loss_scale": 4096.0, "skipped_steps": 3}
    assert optimizer_lines(result) == ["skipped steps (non-finite gradients): 3, loss scale 4096"]


@pytest.mark.slow  # a compile; test_train_optimizers runs the optimizer flags through the CLI
def test_cli_prints_the_skipped_steps(capsys):
    argv = ["train", "--layers", "1", "--batch", "2", "--seq", "16", "--steps", "2", "--dtype", "float16"]
    assert main([*argv, "--loss-scale", "dynamic"]) == 0
    assert "skipped steps (non-finite gradients): " in capsys.readouterr().out
