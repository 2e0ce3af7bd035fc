"""``Transformer``: embeddings, a scanned stack of remat'd blocks, final norm, head."""

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxckpt.nn._activation_sharding import constrain
from jaxckpt.nn._block import ACTIVATION, Block
from jaxckpt.nn._choices import Positions
from jaxckpt.nn._config import TransformerConfig
from jaxckpt.nn._kv_cache import KVCache
from jaxckpt.nn._layers import Embedding, make_dense, make_norm
from jaxckpt.nn._stack import distinct_segments, run_blocks, run_blocks_cached
from jaxckpt.remat import RematSpec
from jaxckpt.remat import get as get_remat

DEFAULT_REMAT = "full"
"""The remat spec of a call that names none: every layer's input saved, the rest recomputed."""


def _stacked_blocks(cfg: TransformerConfig, rngs: nnx.Rngs, attention: "str | None") -> Block:
    """``n_layers`` blocks whose parameters are stacked on a leading layer axis."""

    @nnx.split_rngs(splits=cfg.n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=cfg.n_layers)
    def create(rngs: nnx.Rngs) -> Block:
        return Block(cfg, rngs=rngs, attention=attention)

    return create(rngs)


class Transformer(nnx.Module):
    """A decoder-only transformer (every family of ``FAMILY_DEFAULTS``) with remat'd scanned blocks.

    Args:
        config: sizes and choices.
        rngs: parameter initialisation keys.
        attention: the ``flash_attention`` implementation of every layer (None: automatic);
            ``set_attention`` changes it. The remat spec is the call's (``remat=``, ``"full"``
            by default): both are run settings (``train.RunConfig``), not the model's.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from jaxckpt.nn import Transformer, TransformerConfig
        >>> cfg = TransformerConfig.preset("tiny", n_layers=2, d_model=16, n_heads=2, ffn_dim=24)
        >>> model = Transformer(cfg, rngs=nnx.Rngs(0))
        >>> model(jnp.zeros((3, 5), jnp.int32)).shape
        (3, 5, 256)
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs, attention: "str | None" = None):
        cfg = config
        self.config = cfg
        dtypes = dict(dtype=cfg.compute_dtype, param_dtype=cfg.storage_dtype)
        self.embed = Embedding(cfg.vocab_size, cfg.d_model, **dtypes, rngs=rngs)
        self.pos_embed = (
            Embedding(cfg.max_len, cfg.d_model, **dtypes, rngs=rngs, axes=("positions", "embed"))
            if cfg.positions == Positions.LEARNED
            else None
        )
        self.blocks = _stacked_blocks(cfg, rngs, attention)
        self.final_norm = make_norm(cfg)
        self.head = (
            None
            if cfg.tie_embeddings
            else make_dense(cfg, cfg.d_model, cfg.vocab_size, bias=False, rngs=rngs, axes=("embed", "vocab"))
        )

    def set_attention(self, implementation: "str | None") -> None:
        """Every layer attends with ``implementation`` (a ``flash_attention`` one; None:
        automatic) from now on: for a model built elsewhere, e.g. read from a checkpoint.

        Example:
            >>> from flax import nnx
            >>> from jaxckpt.nn import Transformer, TransformerConfig
            >>> model = Transformer(TransformerConfig.preset("tiny", n_layers=1), rngs=nnx.Rngs(0))
            >>> model.set_attention("xla")
            >>> model.blocks.attn.implementation
            'xla'
        """
        self.blocks.attn.implementation = implementation

    def remat_segments(
        self, batch: int, seq: int, remat: "str | RematSpec"
    ) -> list[tuple[Callable, tuple, int]]:
        """The remat segments of the block stack, for ``jaxckpt.remat.describe``.

        Returns:
            ``[(fn, (x, params), count)]``: ``fn(x, params)`` runs one segment (a
            ``jax.checkpoint`` under ``remat``) on abstract ``x [batch, seq, D]`` and that
            segment's parameters; ``count`` is how many such segments the stack has.
        """
        cfg = self.config
        x = jax.ShapeDtypeStruct((batch, seq, cfg.d_model), cfg.compute_dtype)
        graphdef, state = nnx.split(self.blocks)
        out = []
        for segment, size, indices, count in distinct_segments(get_remat(remat), cfg.layer_kinds):
            lead = () if size == 1 else (size,)
            params = jax.tree.map(
                lambda a, lead=lead: jax.ShapeDtypeStruct(lead + a.shape[1:], a.dtype), state
            )

            def fn(x, params, segment=segment, indices=indices):
                return segment(x, nnx.merge(graphdef, params), jnp.asarray(indices), None)

            out.append((fn, (x, params), count))
        return out

    def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        """An empty ``KVCache`` for ``batch`` sequences of up to ``max_len`` tokens
        (``<= config.max_len``), in the compute dtype unless ``dtype`` is given.

        Example:
            >>> import jax.numpy as jnp
            >>> from flax import nnx
            >>> from jaxckpt.nn import Transformer, TransformerConfig
            >>> model = Transformer(TransformerConfig.preset("tiny", n_layers=2), rngs=nnx.Rngs(0))
            >>> cache = model.init_cache(1, 9)
            >>> logits, cache = model(jnp.zeros((1, 4), jnp.int32), cache=cache)  # prefill
            >>> logits, cache = model(jnp.zeros((1, 1), jnp.int32), cache=cache)  # one decode step
            >>> logits.shape, int(cache.start)
            ((1, 1, 256), 5)
        """
        cfg = self.config
        if max_len > cfg.max_len:
            raise ValueError(
                f"init_cache: max_len={max_len} exceeds config.max_len={cfg.max_len}; "
                "the prompt plus the new tokens must fit the model's context"
            )
        return KVCache.empty(
            n_layers=cfg.n_layers,
            batch=batch,
            max_len=max_len,
            kv_heads=cfg.n_kv_heads,
            head_dim=cfg.head_dim,
            dtype=cfg.compute_dtype if dtype is None else dtype,
        )

    def _check(self, tokens: jax.Array, positions, segment_ids) -> None:
        cfg = self.config
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"tokens must be an integer array [B, T], got {tokens.shape=} {tokens.dtype=}")
        t = tokens.shape[1]
        if t > cfg.max_len:
            raise ValueError(
                f"sequence length T={t} exceeds config.max_len={cfg.max_len}: feed at most max_len "
                "tokens per sequence, or build the model with a larger max_len"
            )
        for name, arr in (("positions", positions), ("segment_ids", segment_ids)):
            if arr is not None and (arr.shape != tokens.shape or not jnp.issubdtype(arr.dtype, jnp.integer)):
                raise ValueError(
                    f"{name} must be an integer array shaped like tokens {tokens.shape}, "
                    f"got {arr.shape=} {arr.dtype=}"
                )

    def _embed(self, tokens: jax.Array, positions) -> jax.Array:
        cfg = self.config
        x = self.embed(tokens)
        if cfg.embed_scale:  # Gemma: sqrt(d_model) rounded to the activations' dtype first
            x = x * jnp.asarray(math.sqrt(cfg.d_model), x.dtype)
        if self.pos_embed is not None:
            x = x + self.pos_embed(jnp.arange(tokens.shape[1])[None] if positions is None else positions)
        return constrain(x, *ACTIVATION)

    def features(
        self,
        tokens: jax.Array,
        *,
        positions: "jax.Array | None" = None,
        segment_ids: "jax.Array | None" = None,
        remat: "str | RematSpec | None" = None,
        dropout_key: "jax.Array | None" = None,
    ) -> jax.Array:
        """The final-normed hidden states ``[B, T, D]`` that ``logits`` maps to the
        vocabulary (``__call__`` is ``logits(features(...))``); see ``__call__`` for the arguments."""
        cfg = self.config
        self._check(tokens, positions, segment_ids)
        spec = get_remat(DEFAULT_REMAT if remat is None else remat)
        context = {"positions": positions, "segment_ids": segment_ids}
        if positions is None and segment_ids is None:
            context = None
        x = run_blocks(
            self.blocks,
            self._embed(tokens, positions),
            spec,
            cfg.n_layers,
            cfg.layer_kinds,
            context,
            dropout_key,
        )
        return self.final_norm(x)

    def logits(self, x: jax.Array) -> jax.Array:
        """The head (or the tied embedding) and the logit soft cap on hidden states ``[..., D]``."""
        cfg = self.config
        logits = self.embed.attend(x) if self.head is None else self.head(x)
        if cfg.logits_softcap is not None:
            cap = jnp.asarray(cfg.logits_softcap, logits.dtype)
            logits = cap * jnp.tanh(logits / cap)
        return logits

    def __call__(
        self,
        tokens: jax.Array,
        *,
        positions: "jax.Array | None" = None,
        segment_ids: "jax.Array | None" = None,
        cache: "KVCache | None" = None,
        remat: "str | RematSpec | None" = None,
        dropout_key: "jax.Array | None" = None,
    ):
        """Logits ``[B, T, V]`` (compute dtype) for ``tokens [B, T]``.

        Args:
            tokens: integer token ids ``[B, T]`` with ``T <= config.max_len``.
            positions: ``[B, T]`` integer positions (RoPE or learned); default ``0..T-1``.
                Packed rows restart them at 0 in every document.
            segment_ids: ``[B, T]`` integer document ids: attention stays inside each
                document (packed rows; padding may be its own segment, e.g. 0).
            cache: a ``KVCache`` (``init_cache``): the tokens continue the cached ones
                (positions from ``cache.start``), and the call returns ``(logits, cache)``.
            remat: the remat spec of this call (a preset name or ``RematSpec``; None:
                ``"full"``; no remat with a cache).
            dropout_key: turns on the LoRA adapters' dropout (``config.lora.dropout``) for
                this call, one key per layer split from it (training); None: no dropout.

        Raises:
            ValueError: for a wrong rank, a non-integer dtype, ``T > max_len``, or
                positions / segment ids not shaped like ``tokens``.
        """
        if cache is None:
            x = self.features(
                tokens, positions=positions, segment_ids=segment_ids, remat=remat, dropout_key=dropout_key
            )
            return constrain(self.logits(x), "batch", "seq", "vocab")
        self._check(tokens, positions, segment_ids)
        if segment_ids is not None or positions is not None:
            raise ValueError("with a cache, positions follow cache.start and segment_ids are not taken")
        if positions is None and self.pos_embed is not None:
            positions = cache.start + jnp.arange(tokens.shape[1])[None]
        x, cache = run_blocks_cached(
            self.blocks, self._embed(tokens, positions), self.config.layer_kinds, cache
        )
        return self.logits(self.final_norm(x)), cache
