"""``Transformer``: embeddings, a scanned stack of remat'd blocks, final norm, head."""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxckpt.nn._activation_sharding import constrain
from jaxckpt.nn._block import ACTIVATION, Block
from jaxckpt.nn._config import TransformerConfig
from jaxckpt.nn._layers import Embedding, make_dense, make_norm
from jaxckpt.remat import RematSpec
from jaxckpt.remat import get as get_remat


def _stacked_blocks(cfg: TransformerConfig, rngs: nnx.Rngs) -> Block:
    """``n_layers`` blocks whose parameters are stacked on a leading layer axis."""

    @nnx.split_rngs(splits=cfg.n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=cfg.n_layers)
    def create(rngs: nnx.Rngs) -> Block:
        return Block(cfg, rngs=rngs)

    return create(rngs)


def _layer(x: jax.Array, block: Block) -> jax.Array:
    return block(x)


def _scan(segment: Callable[[jax.Array, Block], jax.Array]) -> Callable[[jax.Array, Block], jax.Array]:
    """``segment`` scanned over the leading (layer or segment) axis of the blocks, x the carry."""
    return nnx.scan(segment, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)


def _take_layers(blocks: Block, start: int, stop: int, group: int | None = None) -> Block:
    """Layers ``start:stop`` of the stack: a single block when ``stop - start == 1``,
    else stacked ``[stop - start, ...]``, or ``[(stop - start) / group, group, ...]``."""
    graphdef, state = nnx.split(blocks)
    if stop - start == 1:
        lead = ()
    elif group is None:
        lead = (-1,)
    else:
        lead = (-1, group)
    sliced = jax.tree.map(lambda a: a[start:stop].reshape(lead + a.shape[1:]), state)
    return nnx.merge(graphdef, sliced)


def remat_segment(spec: RematSpec, k: int) -> Callable[[jax.Array, Block], jax.Array]:
    """One remat segment of ``k`` layers: ``(x, blocks) -> x``.

    For ``k == 1`` ``blocks`` is a single block; otherwise its parameters are stacked
    on a leading axis of size k and scanned, each layer its own ``nnx.remat`` nested in
    the segment's. A disabled spec gives the plain (un-remat'd) layer or scan.
    """
    if not spec.enabled:
        return _layer if k == 1 else _scan(_layer)
    policy = spec.policy()
    layer = nnx.remat(_layer, policy=policy, prevent_cse=False)
    if k == 1:
        return layer
    return nnx.remat(_scan(layer), policy=policy, prevent_cse=False)


def segment_sizes(spec: RematSpec, n_layers: int) -> tuple[int, int]:
    """``(k, n_full)``: the segment length and the number of full segments (a shorter
    last segment of ``n_layers - k * n_full`` layers follows when k does not divide)."""
    k = min(spec.layers_per_checkpoint, n_layers) if spec.enabled else 1
    return k, n_layers // k


def run_blocks(blocks: Block, x: jax.Array, spec: RematSpec, n_layers: int) -> jax.Array:
    """Applies the stacked blocks to ``x`` under ``spec``.

    Each layer is an ``nnx.remat`` with the spec's policy, scanned with ``nnx.scan``.
    With ``spec.layers_per_checkpoint = k > 1`` the stack is a nested scan: an outer
    scan over segments of k layers, each segment itself an ``nnx.remat``, and an inner
    scan over its layers. The forward pass keeps only segment inputs; the backward pass
    recomputes one segment (keeping its k layer inputs) and then each layer, so the
    activations held are about ``n_layers / k + k`` layer inputs plus one layer's
    internals (the sqrt(n_layers) schedule of Chen et al. 2016 at k = sqrt(n_layers)).
    When k does not divide ``n_layers`` the last segment is shorter.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from jaxckpt import nn, remat
        >>> model = nn.Transformer(nn.TransformerConfig.preset("tiny", n_layers=3), rngs=nnx.Rngs(0))
        >>> x = jnp.ones((1, 4, model.config.d_model))
        >>> nn.run_blocks(model.blocks, x, remat.get("ratio_0.5"), n_layers=3).shape  # segments 2 + 1
        (1, 4, 128)
    """
    k, n_full = segment_sizes(spec, n_layers)
    scan_segments = _scan(remat_segment(spec, k))
    if k == 1:
        return scan_segments(x, blocks)
    x = scan_segments(x, _take_layers(blocks, 0, k * n_full, k))
    if k * n_full < n_layers:
        x = remat_segment(spec, n_layers - k * n_full)(x, _take_layers(blocks, k * n_full, n_layers))
    return x


class Transformer(nnx.Module):
    """A decoder-only transformer (LLaMA or GPT-2 family) with remat'd scanned blocks.

    Args:
        config: sizes and choices; ``config.remat`` is the default remat spec.
        rngs: parameter initialisation keys.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from jaxckpt.nn import Transformer, TransformerConfig
        >>> cfg = TransformerConfig.preset("tiny", n_layers=2, d_model=16, n_heads=2, ffn_dim=24)
        >>> model = Transformer(cfg, rngs=nnx.Rngs(0))
        >>> model(jnp.zeros((3, 5), jnp.int32)).shape
        (3, 5, 256)
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        cfg = config
        self.config = cfg
        dtypes = dict(dtype=cfg.compute_dtype, param_dtype=cfg.storage_dtype)
        self.embed = Embedding(cfg.vocab_size, cfg.d_model, **dtypes, rngs=rngs)
        self.pos_embed = (
            Embedding(cfg.max_len, cfg.d_model, **dtypes, rngs=rngs, axes=("positions", "embed"))
            if cfg.positions == "learned"
            else None
        )
        self.blocks = _stacked_blocks(cfg, rngs)
        self.final_norm = make_norm(cfg)
        self.head = (
            None
            if cfg.tie_embeddings
            else make_dense(cfg, cfg.d_model, cfg.vocab_size, bias=False, rngs=rngs, axes=("embed", "vocab"))
        )

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
        spec = get_remat(remat)
        k, n_full = segment_sizes(spec, cfg.n_layers)
        x = jax.ShapeDtypeStruct((batch, seq, cfg.d_model), cfg.compute_dtype)
        out = []
        for size, count in ((k, n_full), (cfg.n_layers - k * n_full, 1)):
            if size == 0 or count == 0:
                continue
            graphdef, state = nnx.split(self.blocks)
            lead = () if size == 1 else (size,)
            params = jax.tree.map(
                lambda a, lead=lead: jax.ShapeDtypeStruct(lead + a.shape[1:], a.dtype), state
            )

            def fn(x, params, graphdef=graphdef, size=size):
                return remat_segment(spec, size)(x, nnx.merge(graphdef, params))

            out.append((fn, (x, params), count))
        return out

    def __call__(self, tokens: jax.Array, *, remat: "str | RematSpec | None" = None) -> jax.Array:
        """Logits ``[B, T, V]`` (compute dtype) for ``tokens [B, T]``.

        Args:
            tokens: integer token ids ``[B, T]`` with ``T <= config.max_len``.
            remat: overrides ``config.remat`` for this call.

        Raises:
            ValueError: for a wrong rank, a non-integer dtype or ``T > max_len``.
        """
        cfg = self.config
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"tokens must be an integer array [B, T], got {tokens.shape=} {tokens.dtype=}")
        t = tokens.shape[1]
        if t > cfg.max_len:
            raise ValueError(
                f"sequence length T={t} exceeds config.max_len={cfg.max_len}: feed at most max_len "
                "tokens per sequence, or build the model with a larger max_len"
            )
        spec = get_remat(cfg.remat if remat is None else remat)
        x = self.embed(tokens)
        if self.pos_embed is not None:
            x = x + self.pos_embed(jnp.arange(t))[None]
        x = run_blocks(self.blocks, constrain(x, *ACTIVATION), spec, cfg.n_layers)
        x = self.final_norm(x)
        logits = self.embed.attend(x) if self.head is None else self.head(x)
        return constrain(logits, "batch", "seq", "vocab")
