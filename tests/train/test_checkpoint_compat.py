"""Checkpoints of other settings and of older versions load: a trained checkpoint with its
own optimizer (SGD state into generate/eval/init-from), and one saved before the
optimizer carried a loss scaler."""

import jax
import numpy as np
from flax import nnx

from jaxckpt import nn, train
from jaxckpt.train._checkpoint import ADDED_STATE

CFG = nn.TransformerConfig.preset("tiny", n_layers=1, d_model=24, n_heads=2, ffn_dim=40)


def test_a_checkpoint_loads_with_the_optimizer_it_was_trained_with(tmp_path):
    run = train.train(
        CFG,
        steps=1,
        batch=2,
        seq=8,
        checkpoint_dir=tmp_path,
        progress=False,
        optimizer=train.OptimizerConfig(name="sgd", momentum=0.5),
    )
    model = train.initial_model(CFG, 0, tmp_path)  # the default (AdamW) would not fit its state
    assert np.isfinite(run.steps[-1]["loss"])
    assert model.embed.embedding.shape == (CFG.vocab_size, CFG.d_model)


def test_a_checkpoint_without_the_loss_scaler_restores(tmp_path):
    trainer = train.Trainer(nn.Transformer(CFG, rngs=nnx.Rngs(0)))
    full = nnx.to_pure_dict(trainer.state)
    older = {k: {n: v for n, v in part.items() if n not in ADDED_STATE} for k, part in full.items()}
    assert older != full  # the scaler was there, and is gone from what is saved
    train.save_checkpoint(tmp_path, 3, older)
    step, state = train.restore_checkpoint(tmp_path, trainer.state)
    assert step == 3
    for a, b in zip(jax.tree.leaves(nnx.to_pure_dict(state)), jax.tree.leaves(full), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
