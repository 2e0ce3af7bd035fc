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


def test_the_head_gradient_is_cast_before_the_layers_backward_reads_the_hidden_states():
    # chunked_loss_sum's backward hands the hidden states' gradient on through one optimization
    # barrier with the head's gradient in its own dtype, so the fp32 sums the forward kept die
    # before the layers' backward. Left free, XLA:TPU's scheduler kept gpt2's f32[50257,768]
    # through every layer's backward under save_attn (docs/guides/tpu-targets.md). XLA:CPU
    # drops barriers once it has scheduled, so the lowered program is where it shows.
    config = CONFIG.replace(dtype="bfloat16", param_dtype="bfloat16")
    graphdef, params, rest = nnx.split(
        nnx.eval_shape(lambda: nn.Transformer(config, rngs=nnx.Rngs(0))), nnx.Param, ...
    )

    def step(params, rest, tokens):
        return train.loss_and_grads(graphdef, params, rest, tokens, remat.get("full"))

    tokens = jax.ShapeDtypeStruct((1, B, T + 1), jnp.int32)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_loss, "CHUNK_LOGITS_BYTES", SMALL_LIMIT)
        text = jax.jit(step).lower(params, rest, tokens).as_text()
    barriers = [line for line in text.splitlines() if "stablehlo.optimization_barrier" in line]
    head, hidden = f"tensor<{config.d_model}x{V}xbf16>", f"tensor<{B}x{T}x{config.d_model}xbf16>"
    assert any(head in line and hidden in line for line in barriers), barriers
