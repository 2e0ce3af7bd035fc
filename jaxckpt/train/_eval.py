"""Held-out evaluation: the mean loss (and perplexity) of a model over packed batches."""

import math
import os
from collections.abc import Iterable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxckpt.data import tokenizer_for, tokenizer_name
from jaxckpt.train._distributed import put_global
from jaxckpt.train._init import initial_model, source_config
from jaxckpt.train._loss import PACKED_FIELDS, weighted_loss_sum
from jaxckpt.train._master import compute_copies
from jaxckpt.train._offload import HOST
from jaxckpt.train._run_config import DataConfig
from jaxckpt.train._run_data import run_data
from jaxckpt.train._sharding import batch_sharding
from jaxckpt.train._step import check_seq


class Evaluator:
    """Mean next-token loss over packed batches (``jaxckpt.data.PackedBatch``), each
    target counted by its weight; one jitted function per batch shape, reused across
    evaluations of the same model.

    Args:
        model: a ``jaxckpt.nn.Transformer`` (its structure; the values come with each call).
        mesh: the training mesh, when the model's state is sharded over one.

    Example:
        >>> import numpy as np
        >>> from flax import nnx
        >>> from jaxckpt import nn
        >>> from jaxckpt.data import Example, pack_documents
        >>> model = nn.Transformer(nn.TransformerConfig.preset("tiny", n_layers=1), rngs=nnx.Rngs(0))
        >>> docs = [Example(np.arange(n, dtype=np.int32), np.ones(n, bool)) for n in (5, 7)]
        >>> result = Evaluator(model)(model, pack_documents(docs, batch=2, seq=8))
        >>> result["tokens"], round(result["perplexity"], 1) > 1
        (10, True)
    """

    def __init__(self, model: nnx.Module, mesh=None):
        self.graphdef = nnx.graphdef(model)
        self.mesh = mesh
        self.compute_dtype = model.config.compute_dtype
        self._sums = jax.jit(self._batch_sums, static_argnums=2)

    def _batch_sums(self, state, batch, on_host: bool):
        if on_host:  # host master weights (offload_master): compute with their device copies
            params, rest = nnx.split_state(state, nnx.Param, ...)
            state = nnx.merge_state(compute_copies(params, self.compute_dtype), rest)
        model = nnx.merge(self.graphdef, state)

        def one(carry, micro):
            return (
                carry[0] + weighted_loss_sum(model, micro, "none"),
                carry[1] + jnp.sum(micro.weights),
            ), None

        zeros = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
        return jax.lax.scan(one, zeros, batch)[0]

    def __call__(self, model: nnx.Module, batches: Iterable) -> dict:
        """``{"loss", "perplexity", "tokens"}`` of ``model`` over ``batches`` (each ``[M, B, T]``).

        Raises:
            ValueError: when the batches hold no weighted target.
        """
        state = nnx.state(model)
        on_host = any(
            getattr(getattr(leaf, "sharding", None), "memory_kind", None) == HOST
            for leaf in jax.tree.leaves(state)
        )
        total, count = 0.0, 0.0
        sharding = None if self.mesh is None else batch_sharding(self.mesh)
        for batch in batches:
            batch = type(batch)(*(jnp.asarray(getattr(batch, name)) for name in PACKED_FIELDS))
            if sharding is not None:
                batch = put_global(batch, type(batch)(*[sharding] * len(PACKED_FIELDS)))
            loss, weight = self._sums(state, batch, on_host)
            total, count = total + float(loss), count + float(weight)
        if not count:
            raise ValueError("evaluate: the held-out data has no target to score")
        loss = total / count
        return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": int(count)}


def evaluate(
    model_dir: "str | os.PathLike",
    data: "str | os.PathLike",
    *,
    tokenizer: "str | os.PathLike | None" = None,
    batch: int = 8,
    seq: int = 256,
    text_per_line: bool = False,
) -> dict:
    """The mean loss and perplexity of the model at ``model_dir`` (Hugging Face, converted,
    or a trained checkpoint's latest step) over one pass of ``data``.

    The data is read, tokenized and packed as ``train`` reads it (byte-level text into
    consecutive windows of ``seq``), every record once, in file order.

    Args:
        model_dir: the model directory.
        data: a ``.txt``, ``.jsonl``, ``.json`` or ``.parquet`` file (or a directory of them).
        tokenizer: overrides the model's own (``"bytes"``, or a tokenizer directory or file).
        batch, seq: rows per batch and tokens per row (``seq <= config.max_len``).
        text_per_line: ``.txt`` data holds one document per line.

    Returns:
        ``{"loss", "perplexity", "tokens"}`` and the data's counts under ``"data"``.

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from jaxckpt import nn, train
        >>> d = tempfile.mkdtemp()
        >>> cfg = nn.TransformerConfig.preset("tiny", n_layers=1, d_model=32, n_heads=2, ffn_dim=48)
        >>> run = train.RunConfig(steps=1, batch=2, seq=16, checkpoint={"dir": d}, progress=False)
        >>> _ = train.train(cfg, run)
        >>> text = Path(d) / "held_out.txt"
        >>> _ = text.write_text("To be, or not to be: that is the question.")
        >>> result = train.evaluate(d, text, batch=2, seq=8)
        >>> result["tokens"], result["perplexity"] > 1
        (40, True)
    """
    config = source_config(model_dir, name="model_dir")
    check_seq(config, seq)
    tok = tokenizer_for(model_dir, tokenizer)
    model = initial_model(config, 0, model_dir)
    options = DataConfig(path=data, text_per_line=text_per_line, eval_path=data)  # the whole file is held out
    feed = run_data(options, tok, batch=batch, seq=seq, micro_batches=1, seed=0)
    result = Evaluator(model)(model, feed.eval_batches())
    stats = feed.eval_stats
    return {**result, "data": {"kind": feed.kind, "tokenizer": tokenizer_name(tok), **stats}}
