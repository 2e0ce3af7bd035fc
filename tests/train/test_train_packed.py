"""The loss and gradients of a packed batch equal the token-weighted loss and gradients of
its documents run one by one (fp32, 1e-5): attention stays inside each document, positions
restart in each, and no target crosses a boundary or sits on padding (RoPE and learned
positions here; every position scheme and windows at the logits, in test_nn_packed_and_cache)."""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxckpt import nn, remat, train


class Packed(NamedTuple):
    inputs: np.ndarray
    targets: np.ndarray
    weights: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray


CASES = {  # windows, NoPE and the other position schemes: tests/nn/test_nn_packed_and_cache.py
    "llama": ("tiny", dict(n_layers=1)),
    "gpt2": ("gpt2", dict(n_layers=1, n_kv_heads=3)),  # learned positions
}
ATTENTION = None  # auto: the blockwise kernel on CPU, as training runs
SIZES = dict(d_model=24, n_heads=3, n_kv_heads=1, head_dim=10, ffn_dim=40, vocab_size=61, max_len=32)


def _split(case):
    preset, overrides = CASES[case]
    cfg = nn.TransformerConfig.preset(preset, **{**SIZES, **overrides, "dtype": "float32"})
    model = nn.Transformer(cfg.replace(param_dtype="float32"), rngs=nnx.Rngs(5), attention=ATTENTION)
    return nnx.split(model, nnx.Param, ...)


def _pack(docs, masks, seq):
    """Docs (id arrays) packed greedily, one micro-batch per row list; each doc fits a row."""
    rows, row = [], []
    for doc, mask in zip(docs, masks, strict=True):
        if sum(len(d) - 1 for d, _ in row) + len(doc) - 1 > seq:
            rows.append(row)
            row = []
        row.append((doc, mask))
    rows.append(row)
    fields = {
        name: np.zeros((len(rows), seq), dtype) for name, dtype in zip(Packed._fields, "iifii", strict=True)
    }
    for r, row in enumerate(rows):
        at = 0
        for s, (doc, mask) in enumerate(row):
            n = len(doc) - 1
            fields["inputs"][r, at : at + n] = doc[:-1]
            fields["targets"][r, at : at + n] = doc[1:]
            fields["weights"][r, at : at + n] = mask[1:]
            fields["segment_ids"][r, at : at + n] = s + 1
            fields["positions"][r, at : at + n] = np.arange(n)
            at += n
    return Packed(**{k: v[None] for k, v in fields.items()})


def _one_by_one(graphdef, params, rest, docs, masks):
    """sum_d sum_t w * CE, and its gradient, each document alone; divided by the weight."""
    docs, masks = tuple(map(jnp.asarray, docs)), tuple(map(jnp.asarray, masks))
    return _one_by_one_jit(graphdef, params, rest, docs, masks)


@functools.partial(jax.jit, static_argnums=0)
def _one_by_one_jit(graphdef, params, rest, docs, masks):
    """The documents are arguments, not constants baked into the program: the tests whose
    documents have the same lengths share one compiled reference."""

    def loss(params):
        model = nnx.merge(graphdef, params, rest)
        total = 0.0
        for doc, mask in zip(docs, masks, strict=True):
            logits = model(doc[None, :-1])
            logp = jax.nn.log_softmax(logits.astype(jnp.float32))[0]
            ce = -jnp.take_along_axis(logp, doc[1:, None], axis=-1)[:, 0]
            total = total + jnp.sum(ce * mask[1:])
        return total / sum(m[1:].sum() for m in masks)

    return jax.value_and_grad(loss)(params)


def _packed(graphdef, params, rest, batch, spec):
    return jax.jit(lambda p, b: train.loss_and_grads(graphdef, p, rest, b, spec))(params, batch)


def _prompted_docs():
    """Three documents of lengths 6, 9, 4; the second has a 5-token prompt (no loss on it)."""
    rng = np.random.default_rng(0)
    lengths = (6, 9, 4)
    docs = [rng.integers(0, SIZES["vocab_size"], n).astype(np.int32) for n in lengths]
    masks = [np.ones(n, np.float32) for n in lengths]
    masks[1][:5] = 0  # a prompt: no loss on it
    return docs, masks


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_packed_loss_and_grads_equal_the_documents_one_by_one(case):
    graphdef, params, rest = _split(case)
    docs, masks = _prompted_docs()
    batch = _pack(docs, masks, seq=12)
    assert batch.inputs.shape[1] > 1  # several rows, some padding
    want_loss, want_grads = _one_by_one(graphdef, params, rest, docs, masks)
    got_loss, got_grads = _packed(graphdef, params, rest, batch, remat.get("full"))  # remat: same numbers
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    for got, want in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_packed_micro_batches_weigh_every_target_alike():
    """Two micro-batches with unequal target counts: the step's loss is the mean over all
    targets (not the mean of the two micro-batch means)."""
    graphdef, params, rest = _split("llama")
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, SIZES["vocab_size"], n).astype(np.int32) for n in (12, 3)]
    masks = [np.ones(len(d), np.float32) for d in docs]
    one = _pack(docs, masks, seq=12)
    assert one.inputs.shape[1] == 2  # one document per row
    two = Packed(*(a.reshape(2, 1, -1) for a in one))
    want_loss, want_grads = _one_by_one(graphdef, params, rest, docs, masks)
    got_loss, got_grads = _packed(graphdef, params, rest, two, remat.get("none"))
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # 2 s or more with the compile cache warm
def test_trainer_steps_on_packed_batches():
    graphdef, params, rest = _split("llama")
    trainer = train.Trainer(nnx.merge(graphdef, params, rest))
    rng = np.random.default_rng(2)
    docs = [rng.integers(0, SIZES["vocab_size"], n).astype(np.int32) for n in (7, 5, 9)]
    batch = _pack(docs, [np.ones(len(d), np.float32) for d in docs], seq=12)
    losses = [float(trainer.step(batch)) for _ in range(3)]
    assert losses[-1] < losses[0]
    assert len(trainer._compiled) == 1
    with pytest.raises(ValueError, match=r"a packed batch's fields must all be \[micro_batches, B, T\]"):
        trainer.step(batch._replace(weights=batch.weights[:, :, :-1]))


@pytest.mark.slow
def test_packed_batches_shard_over_a_mesh_with_the_same_losses():
    graphdef, params, rest = _split("llama")
    rng = np.random.default_rng(4)
    lengths = (7, 5, 9, 6, 8, 4, 10, 11, 12, 13, 9)
    docs = [rng.integers(0, SIZES["vocab_size"], n).astype(np.int32) for n in lengths]
    batch = _pack(docs, [np.ones(len(d), np.float32) for d in docs], seq=12)
    assert batch.inputs.shape[1] == 8  # one row per device
    single = train.Trainer(nnx.merge(graphdef, params, rest))
    sharded = train.Trainer(nnx.merge(graphdef, params, rest), mesh=train.make_mesh("data=2,fsdp=4"))
    for _ in range(2):
        np.testing.assert_allclose(float(sharded.step(batch)), float(single.step(batch)), rtol=1e-5)


@pytest.mark.slow  # 2 s or more with the compile cache warm
def test_chunked_logits_give_the_same_loss_and_grads(monkeypatch):
    """Over ``CHUNK_LOGITS_BYTES`` the packed loss runs the head a chunk of positions at a
    time, each chunk's gradient taken in the forward pass: the same loss and gradients."""
    from jaxckpt.train import _loss

    graphdef, params, rest = _split("llama")
    docs, masks = _prompted_docs()  # the one-by-one reference compiled by the llama case
    batch = _pack(docs, masks, seq=12)
    want_loss, want_grads = _one_by_one(graphdef, params, rest, docs, masks)
    monkeypatch.setattr(_loss, "CHUNK_LOGITS_BYTES", 2 * 12 * SIZES["vocab_size"])  # 4+ chunks per row
    assert _loss.chunk_count(*batch.inputs.shape[1:], SIZES["vocab_size"]) > 1
    got_loss, got_grads = _packed(graphdef, params, rest, batch, remat.get("full"))
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    for got, want in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_the_plain_loss_chunks_its_logits_too(monkeypatch):
    """Token windows (no packing) take the same chunked head over ``CHUNK_LOGITS_BYTES``:
    the same mean loss and gradients as the whole logits, and no ``[B, T, V]`` buffer."""
    from jaxckpt.train import _loss

    graphdef, params, rest = _split("llama")
    tokens = jax.random.randint(jax.random.key(3), (3, 14), 0, SIZES["vocab_size"])
    spec = remat.get("full")

    def loss_and_grads():  # a new function each time: the limit is read when it is traced
        return jax.jit(lambda p: train.loss_and_grads(graphdef, p, rest, tokens[None], spec))

    want_loss, want_grads = loss_and_grads()(params)
    monkeypatch.setattr(_loss, "CHUNK_LOGITS_BYTES", 3 * 4 * 4 * SIZES["vocab_size"])  # 4 positions a chunk
    assert _loss.chunk_count(3, 13, SIZES["vocab_size"]) > 1
    chunked = loss_and_grads()
    got_loss, got_grads = chunked(params)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    for got, want in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    hlo = chunked.lower(params).as_text()  # the program that ran (its trace is reused)
    assert f"3x13x{SIZES['vocab_size']}x" not in hlo  # the whole logits never exist
