"""``jaxckpt.train``: the step, micro-batches, mixed precision, checkpoints and ``train``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxckpt import nn, remat, train

SMALL = nn.TransformerConfig.preset(
    "tiny", d_model=30, n_layers=3, n_heads=5, n_kv_heads=1, head_dim=6, ffn_dim=22
)


def _tokens(shape, seed=1):
    return jax.random.randint(jax.random.key(seed), shape, 0, SMALL.vocab_size)


@nnx.jit
def _logits(model, tokens):
    """``model(tokens)``, jitted: eagerly every op compiles its own small program."""
    return model(tokens)


@nnx.jit
def _loss(model, batch):
    """``train.next_token_loss``, jitted for the same reason."""
    return train.next_token_loss(model, batch)


@pytest.mark.slow
def test_loss_falls_over_50_steps_on_the_built_in_corpus():
    cfg = nn.TransformerConfig.preset("tiny", n_layers=2)
    run = train.train(cfg, train.RunConfig(steps=50, batch=4, seq=32, progress=False))
    losses = [s["loss"] for s in run.steps]
    assert len(losses) == 50 and all(np.isfinite(losses))
    assert losses[0] > 5.0  # about ln(256) at init
    assert np.mean(losses[-5:]) < losses[0] - 1.5, losses


@pytest.mark.slow
def test_micro_batches_average_the_gradients():
    model = nn.Transformer(SMALL, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    toks = _tokens((6, 12))
    grads = jax.jit(train.loss_and_grads, static_argnums=(0, 4))
    whole = grads(graphdef, params, rest, toks[None], remat.get("full"))
    split = grads(graphdef, params, rest, toks.reshape(3, 2, 12), remat.get("full"))
    assert float(whole[0]) == pytest.approx(float(split[0]), abs=1e-6)
    for a, b in zip(jax.tree.leaves(whole[1]), jax.tree.leaves(split[1]), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.slow
def test_mixed_precision_keeps_fp32_params():
    cfg = SMALL.replace(dtype="bfloat16", param_dtype="float32")
    trainer = train.Trainer(nn.Transformer(cfg, rngs=nnx.Rngs(0)))
    loss = trainer.step(_tokens((1, 3, 9)))
    assert loss.dtype == jnp.float32 and np.isfinite(float(loss))
    assert {p.dtype for p in jax.tree.leaves(nnx.state(trainer.model, nnx.Param))} == {jnp.dtype(jnp.float32)}
    assert _logits(trainer.model, _tokens((2, 5))).dtype == jnp.bfloat16


def test_step_donates_the_state():
    trainer = train.Trainer(nn.Transformer(SMALL, rngs=nnx.Rngs(0)))
    old = jax.tree.leaves(trainer.state)[0]
    trainer.step(_tokens((1, 3, 9)))
    assert old.is_deleted()
    memory = train.memory_report(trainer.compile((1, 3, 9)))
    assert memory.alias > 0 and memory.peak == memory.argument + memory.output + memory.temp - memory.alias


def test_trainers_share_a_step_only_when_everything_it_depends_on_is_equal():
    """Trainers of one model structure and options share one jitted step (its trace and
    compiled program); any option the step depends on gives a step of its own."""

    def make(config=SMALL, init_seed=0, **options):
        return train.Trainer(nn.Transformer(config, rngs=nnx.Rngs(init_seed)), **options)

    one = make()
    assert make(init_seed=1)._step is one._step  # the parameters' values are the state's
    others = {
        "remat": make(remat="none"),
        "optimizer": make(optimizer=train.OptimizerConfig(learning_rate=0.5, warmup_steps=0)),
        "seed": make(seed=3),
        "context_parallel": make(context_parallel="ring"),
        "mesh": make(mesh=train.make_mesh({"fsdp": 2}, devices=jax.devices()[:2])),
        "model": make(SMALL.replace(ffn_dim=24)),
        "dtype": make(SMALL.replace(dtype="bfloat16", param_dtype="float32")),
    }
    for option, trainer in others.items():
        assert trainer._step is not one._step, option
    # What a wrongly shared step would hide: another learning rate's second step differs.
    batch = _tokens((1, 3, 9))
    fast = others["optimizer"]
    losses = [(float(one.step(batch)), float(fast.step(batch))) for _ in range(2)]
    assert losses[0][0] == losses[0][1] and losses[1][0] != losses[1][1], losses


def test_bad_batch_is_rejected():
    trainer = train.Trainer(nn.Transformer(SMALL, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="micro_batches, B, T"):
        trainer.step(_tokens((3, 9)))
    with pytest.raises(ValueError, match="max_len"):
        trainer.step(_tokens((1, 1, SMALL.max_len + 2)))


@pytest.mark.slow
def test_resume_gives_the_same_next_step_loss(tmp_path):
    # batch=2, seq=7 as the other train tests: the same step program (XLA's compile cache)
    run = train.RunConfig(steps=4, batch=2, seq=7, seed=5, progress=False)
    straight = train.train(SMALL, run)
    ckpt = tmp_path / "ckpt"
    first = train.train(SMALL, run.replace(steps=2, checkpoint={"dir": ckpt}))
    assert train.latest_step(ckpt) == 2
    resumed = train.train(SMALL, run.replace(checkpoint={"dir": ckpt, "resume": True}))
    assert [s["step"] for s in resumed.steps] == [2, 3]
    losses = [s["loss"] for s in first.steps + resumed.steps]
    assert losses == [s["loss"] for s in straight.steps]
    assert train.latest_step(ckpt) == 4


@pytest.mark.slow
def test_checkpoints_are_not_overwritten_without_force(tmp_path):
    run = train.RunConfig(steps=1, batch=2, seq=7, progress=False, checkpoint={"dir": tmp_path / "c"})
    forced = run.replace(checkpoint={"force": True})
    resuming = run.replace(steps=2, checkpoint={"resume": True})
    train.train(SMALL, run)
    with pytest.raises(FileExistsError, match="force=True"):
        train.train(SMALL, run)
    train.train(SMALL, forced)
    # Bad input fails before --force deletes anything.
    with pytest.raises(ValueError, match="max_len"):
        train.train(SMALL, forced.replace(seq=SMALL.max_len + 1))
    with pytest.raises(FileNotFoundError, match=r"missing\.txt"):
        train.train(SMALL, forced.replace(data={"path": tmp_path / "missing.txt"}))
    assert train.latest_step(tmp_path / "c") == 1
    # resume= without a dir is refused when the run is built: test_run_config.py
    with pytest.raises(ValueError, match=r"config\.n_layers: 3 -> 2"):
        train.train(SMALL.replace(n_layers=2), resuming)
    with pytest.raises(ValueError, match="seq: 7 -> 9"):
        train.train(SMALL, resuming.replace(seq=9))
    resumed = train.train(SMALL, resuming.replace(remat="save_attn"))
    assert [s["step"] for s in resumed.steps] == [1]  # remat may change: it does not change the numbers


@pytest.mark.slow
def test_init_from_takes_the_parameters(tmp_path):
    run = train.RunConfig(steps=1, batch=2, seq=7, progress=False)
    first = train.train(SMALL, run.replace(steps=2, checkpoint={"dir": tmp_path / "c"}))
    second = train.train(SMALL, run.replace(seed=9, init_from=tmp_path / "c"))
    batch = train.ByteBatches(train.load_tokens(None), 2, 7, seed=9).batch_at(0)[0]
    expected = float(_loss(first.trainer.model, batch))
    assert second.steps[0]["loss"] == pytest.approx(expected, abs=1e-6)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="Hugging Face"):
        train.train(SMALL, run.replace(init_from=tmp_path / "hf"))


@pytest.mark.parametrize(
    "fields, error, match",
    [
        (dict(seq=SMALL.max_len + 1), ValueError, "max_len"),
        (dict(data={"path": "no/such/file.txt"}), FileNotFoundError, "no/such/file.txt"),
    ],
)
def test_train_rejects_bad_input(fields, error, match):
    """What the run alone cannot know (the model's max_len, the files); steps=0 and the
    other checks of the run itself fail when it is built: test_run_config.py."""
    run = train.RunConfig(**{**dict(steps=1, batch=2, seq=7, progress=False), **fields})
    with pytest.raises(error, match=match):
        train.train(SMALL, run)


def test_optimizer_config_validates():
    with pytest.raises(ValueError, match="learning_rate"):
        train.OptimizerConfig(learning_rate=0.0)
    assert train.OptimizerConfig(decay_steps=5).transformation() is not None
