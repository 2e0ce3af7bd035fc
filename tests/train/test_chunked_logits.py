"""No loss path holds the whole ``[B, T, V]`` logits when they exceed ``CHUNK_LOGITS_BYTES``:
the train step on plain windows and on packed rows (``loss_and_grads``, which ``Trainer`` and
``jaxckpt compare`` run) and the held-out evaluation (``Evaluator``), read off XLA:CPU's
compiled memory analysis.

The chunk limit is lowered to 128 KiB so that a small model's logits (B=2, T=127, V=2003:
2,035,048 bytes in fp32) exceed it; each path is compiled once under that limit and once
under the default 64 MiB (logits whole), which shows the shapes would hold them.
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxckpt import nn, remat, train
from jaxckpt.data import PackedBatch
from jaxckpt.train import _loss

B, T, V = 2, 127, 2003
LOGITS_BYTES = B * T * V * 4
SMALL_LIMIT = 128 * 2**10
CONFIG = nn.TransformerConfig.preset("tiny", n_layers=1, d_model=16, n_heads=2, ffn_dim=24, vocab_size=V)


def _packed() -> PackedBatch:
    """The shapes and dtypes of one packed micro-batch ``[1, B, T]``."""
    ids, weights = jax.ShapeDtypeStruct((1, B, T), jnp.int32), jax.ShapeDtypeStruct((1, B, T), jnp.float32)
    return PackedBatch(inputs=ids, targets=ids, weights=weights, segment_ids=ids, positions=ids)


def _compiled(limit: int) -> dict:
    """Each loss path compiled with ``CHUNK_LOGITS_BYTES = limit``, from abstract values
    (``nnx.eval_shape``: no parameter is drawn, nothing runs)."""
    model = nnx.eval_shape(lambda: nn.Transformer(CONFIG, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    spec = remat.get("full")
    tokens = jax.ShapeDtypeStruct((1, B, T + 1), jnp.int32)
    packed = _packed()

    def step(params, rest, batch):
        return train.loss_and_grads(graphdef, params, rest, batch, spec)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_loss, "CHUNK_LOGITS_BYTES", limit)
        return {
            "plain": jax.jit(step).lower(params, rest, tokens).compile(),
            "packed": jax.jit(step).lower(params, rest, packed).compile(),
            "eval": train.Evaluator(model)._sums.lower(nnx.state(model), packed, False).compile(),
        }


@pytest.fixture(scope="module")
def programs() -> dict:
    return {"chunked": _compiled(SMALL_LIMIT), "whole": _compiled(_loss.CHUNK_LOGITS_BYTES)}


def _temp(compiled) -> int:
    return compiled.memory_analysis().temp_size_in_bytes


def test_the_shapes_make_the_logits_exceed_the_lowered_limit():
    assert _loss.chunk_count(B, T, V, SMALL_LIMIT) == 16  # 127 is prime: 16 chunks of 8, one padded
    assert _loss.chunk_count(B, T, V) == 1


@pytest.mark.slow
@pytest.mark.parametrize("path", ["plain", "packed", "eval"])
def test_no_loss_path_holds_the_whole_logits(programs, path):
    """Chunked, the compiled temp stays below one ``[B, T, V]`` fp32 buffer; whole, the same
    program holds more than one (the logits, and under a gradient their cotangent)."""
    chunked, whole = _temp(programs["chunked"][path]), _temp(programs["whole"][path])
    assert chunked < LOGITS_BYTES < whole, (path, chunked, LOGITS_BYTES, whole)
