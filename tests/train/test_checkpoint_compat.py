"""Checkpoints of other settings and of older versions load: a trained checkpoint with its
own optimizer (SGD state into generate/eval/init-from), one saved before the optimizer
carried a loss scaler, and configs saved before remat/attention/budget moved to
``train.RunConfig``."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from jaxckpt import nn, remat, train
from jaxckpt.train._checkpoint import ADDED_STATE

CFG = nn.TransformerConfig.preset("tiny", n_layers=1, d_model=24, n_heads=2, ffn_dim=40)
LEGACY = {"remat": "save_attn", "attention": "xla", "budget": 2**30}
"""Run settings that model configs held before they moved to ``train.RunConfig``."""


@pytest.mark.slow
def test_a_checkpoint_loads_with_the_optimizer_it_was_trained_with(tmp_path):
    sgd = train.OptimizerConfig(name="sgd", momentum=0.5)
    run = train.RunConfig(
        steps=1, batch=2, seq=8, checkpoint={"dir": tmp_path}, progress=False, optimizer=sgd
    )
    result = train.train(CFG, run)
    model = train.initial_model(CFG, 0, tmp_path)  # the default (AdamW) would not fit its state
    assert np.isfinite(result.steps[-1]["loss"])
    assert model.embed.embedding.shape == (CFG.vocab_size, CFG.d_model)
    # As an older version wrote it: the config holds the run settings; it loads and resumes.
    meta = json.loads((tmp_path / "jaxckpt.json").read_text())
    (tmp_path / "jaxckpt.json").write_text(json.dumps({**meta, "config": {**meta["config"], **LEGACY}}))
    assert train.source_config(tmp_path) == CFG
    resumed = train.train(CFG, run.replace(steps=2, checkpoint={"resume": True}))
    assert [s["step"] for s in resumed.steps] == [1]


def test_a_config_written_before_the_run_settings_moved_loads():
    """``from_dict`` drops ``remat``, ``attention`` and ``budget`` (they never changed the
    numbers), a custom spec's repr too; any other unknown field is still refused."""
    assert nn.TransformerConfig.from_dict({**CFG.to_dict(), **LEGACY}) == CFG
    spec = repr(remat.RematSpec(layers_per_checkpoint=2))
    assert nn.TransformerConfig.from_dict({**CFG.to_dict(), "remat": spec, "attention": None}) == CFG
    with pytest.raises(ValueError, match=r"TransformerConfig: unknown field\(s\) \['foo'\]"):
        nn.TransformerConfig.from_dict({**CFG.to_dict(), **LEGACY, "foo": 1})


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
