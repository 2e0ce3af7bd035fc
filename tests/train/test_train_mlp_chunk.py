"""``train.train`` with ``RunConfig.mlp_chunk`` trains the tiled model (that tiling keeps the
numbers is ``tests/nn/test_tiled_mlp.py``'s)."""

import math

from jaxckpt import nn, train

CONFIG = nn.TransformerConfig.preset("tiny", n_layers=1, d_model=24, n_heads=2, ffn_dim=40, vocab_size=259)


def test_train_runs_the_model_with_the_runs_mlp_chunk():
    result = train.train(CONFIG, train.RunConfig(steps=1, batch=2, seq=13, progress=False, mlp_chunk=5))
    assert result.trainer.model.config.mlp_chunk == 5
    assert math.isfinite(result.steps[0]["loss"])
