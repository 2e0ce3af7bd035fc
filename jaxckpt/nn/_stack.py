"""The scanned block stack under a remat spec, its layers possibly of different kinds.

The stack's parameters are stacked on one leading layer axis and the stack is one
``nnx.scan`` over layers (or over remat segments of layers), so compile time and memory
do not grow with depth. Layers may differ in static ways (``LayerKind``: a sliding
window, RoPE or not, the local RoPE base). The scan then carries each layer's index into
the stack's distinct kinds as one more scanned array, and the layer picks its RoPE tables
by that index and its attention by a ``lax.switch`` over the distinct windows: one
compiled layer serves every kind, and only the attention kernel is compiled once per
window. Measured on XLA:CPU (B=2, T=1024, d=256, 12 layers, ``full``), the temp memory of
Gemma 3's pattern of 6 is the uniform stack's (128 vs 133 MiB). Two alternatives cost
more: a scan over units of the pattern, whose layers' recomputations XLA scheduled
together (456 MiB), and a switch over whole layers (157 MiB).
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxckpt._tags import tag
from jaxckpt.nn._attention import FULL
from jaxckpt.nn._block import Block
from jaxckpt.nn._choices import LayerKind
from jaxckpt.nn._compressed_remat import compressed_remat
from jaxckpt.nn._kv_cache import KVCache, LayerCache
from jaxckpt.remat import RematSpec, Tag

Segment = Callable[[jax.Array, Block, "jax.Array | tuple", "dict | None"], jax.Array]
"""``(x, blocks, per_layer, context) -> x``. ``per_layer`` is scanned with the blocks: each
layer's index into the stack's distinct kinds, or ``(kind_index, dropout_key)`` when the
LoRA adapters' dropout is on; ``context`` holds the arrays every layer reads alike
(``positions``, ``segment_ids``), or is None."""


def distinct_kinds(kinds: "tuple[LayerKind, ...]") -> tuple[tuple[LayerKind, ...], np.ndarray]:
    """The distinct kinds of a stack in order of appearance, and each layer's index into them.

    Example:
        >>> from jaxckpt.nn import LAYER_KINDS
        >>> full, local = LAYER_KINDS["full"], LAYER_KINDS["sliding"]
        >>> distinct, index = distinct_kinds((local, local, full, local))
        >>> distinct == (local, full), index.tolist()
        (True, [0, 0, 1, 0])
    """
    distinct = tuple(dict.fromkeys(kinds))
    return distinct, np.asarray([distinct.index(kind) for kind in kinds], np.int32)


def _layer(kinds: tuple[LayerKind, ...], tag_input: bool = True) -> Segment:
    """One layer: ``(x, block, per_layer, context) -> x``; the kind index picks among
    ``kinds`` when there are several (``Block.__call__``, which tags its input
    ``Tag.LAYER_INPUT`` when ``tag_input``)."""
    kind = kinds[0] if len(kinds) == 1 else kinds

    def layer(x, block, per_layer, context):
        index, key = per_layer if isinstance(per_layer, tuple) else (per_layer, None)
        extra = {} if key is None else {"dropout_key": key}
        return block(x, kind, index, **(context or {}), **extra, tag_input=tag_input)

    return layer


def _tag_input(segment: Segment) -> Segment:
    """``segment`` with its input tagged ``Tag.LAYER_INPUT``: a segment of several layers is
    one remat unit, and its input its boundary, so the tag names that input once (its
    layers' own inputs are recomputed with the segment). A policy that offloads the tag
    then offloads one input per segment, and XLA:GPU's host offloader is not asked to
    move values out of the nested scan over a segment's layers (which failed to compile:
    ``Expected instruction to have shape equal to ...``, with a layer input tagged in it)."""

    def segment_input(x, blocks, per_layer, context):
        return segment(tag(x, Tag.LAYER_INPUT), blocks, per_layer, context)

    return segment_input


def _scan(segment: Segment) -> Segment:
    """``segment`` scanned over the leading (layer or segment) axis of the blocks and kind
    indices, x the carry, the context the same for every step."""
    return nnx.scan(segment, in_axes=(nnx.Carry, 0, 0, None), out_axes=nnx.Carry)


def _take_layers(blocks: Block, start: int, stop: int, lead: tuple[int, ...]) -> Block:
    """Layers ``start:stop`` of the stack, their leading axis reshaped to ``lead``: ``()``
    for a single block, ``(-1,)`` stacked, ``(-1, k)`` in segments of k."""
    graphdef, state = nnx.split(blocks)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[start:stop].reshape(lead + a.shape[1:]), state))


def remat_segment(spec: RematSpec, kinds: tuple[LayerKind, ...], k: int) -> Segment:
    """One remat segment of ``k`` layers: ``(x, blocks, kind_indices, context) -> x``.

    For ``k == 1`` ``blocks`` is a single block; otherwise its parameters are stacked
    on a leading axis of size k and scanned, each layer its own ``nnx.remat`` nested in
    the segment's, and ``Tag.LAYER_INPUT`` tags the segment's input, not each layer's
    (``_tag_input``). A disabled spec gives the plain (un-remat'd) layer or scan. A spec
    that compresses tags makes the layer (or the segment, keeping its input alone) a
    ``compressed_remat`` instead of an ``nnx.remat``.
    ``kinds`` are the stack's distinct kinds, which the indices pick from.
    """
    if not spec.enabled:
        return _layer(kinds) if k == 1 else _scan(_layer(kinds))
    if spec.compress and k == 1:
        return compressed_remat(_layer(kinds), spec)
    policy = spec.policy()
    layer = nnx.remat(_layer(kinds, tag_input=k == 1), policy=policy, prevent_cse=False)
    if k == 1:
        return layer
    if spec.compress:
        return compressed_remat(_tag_input(_scan(layer)), spec, boundary_only=True)
    return nnx.remat(_tag_input(_scan(layer)), policy=policy, prevent_cse=False)


def segment_sizes(spec: RematSpec, n_layers: int) -> tuple[int, int]:
    """``(k, n_full)``: the segment length and the number of full segments (a shorter
    last segment of ``n_layers - k * n_full`` layers follows when k does not divide).

    Example:
        >>> from jaxckpt import remat
        >>> segment_sizes(remat.get("ratio_0.5"), 5), segment_sizes(remat.get("full"), 5)
        ((2, 2), (1, 5))
    """
    k = min(spec.layers_per_checkpoint, n_layers) if spec.enabled else 1
    return k, n_layers // k


def stack_segments(spec: RematSpec, n_layers: int) -> list[tuple[int, int, int | None]]:
    """The pieces ``run_blocks`` applies, in order: ``(start, stop, group)``: layers
    ``start:stop`` as a scan over segments of ``group`` layers (None: of one layer), or a
    single segment when ``start`` is past the scanned ones (the shorter last segment).

    Example:
        >>> from jaxckpt import remat
        >>> stack_segments(remat.get("ratio_0.5"), 5), stack_segments(remat.get("full"), 3)
        ([(0, 4, 2), (4, 5, None)], [(0, 3, None)])
    """
    k, n_full = segment_sizes(spec, n_layers)
    pieces = [(0, k * n_full, None if k == 1 else k)]
    if k * n_full < n_layers:
        pieces.append((k * n_full, n_layers, None))
    return pieces


def distinct_segments(
    spec: RematSpec, kinds: "tuple[LayerKind, ...]"
) -> list[tuple[Segment, int, np.ndarray, int]]:
    """``(fn, size, kind_indices, count)`` for each distinct remat segment of the stack,
    for ``remat.describe``: ``fn(x, blocks, kind_indices, None)`` runs one segment of ``size``
    layers, and ``count`` segments are like it. A single-layer segment counts once per
    kind (each analysed alone); a longer one mixes kinds, and the first stands for all.
    """
    distinct, index = distinct_kinds(kinds)
    out = []
    for start, stop, group in stack_segments(spec, len(kinds)):
        size = group or (1 if start == 0 else stop - start)
        if size == 1:
            for i, kind in enumerate(distinct):
                count = int(np.sum(index[start:stop] == i))
                out.append((remat_segment(spec, (kind,), 1), 1, np.zeros((), np.int32), count))
        else:
            out.append(
                (
                    remat_segment(spec, distinct, size),
                    size,
                    index[start : start + size],
                    (stop - start) // size,
                )
            )
    return out


def run_blocks(
    blocks: Block,
    x: jax.Array,
    spec: RematSpec,
    n_layers: int,
    kinds: "tuple[LayerKind, ...] | None" = None,
    context: "dict | None" = None,
    dropout_key: "jax.Array | None" = None,
) -> jax.Array:
    """Applies the stacked blocks to ``x`` under ``spec``.

    Each layer is an ``nnx.remat`` with the spec's policy, scanned with ``nnx.scan``.
    With ``spec.layers_per_checkpoint = k > 1`` the stack is a nested scan: an outer
    scan over segments of k layers, each segment itself an ``nnx.remat``, and an inner
    scan over its layers. The forward pass keeps only segment inputs; the backward pass
    recomputes one segment (keeping its k layer inputs) and then each layer, so the
    activations held are about ``n_layers / k + k`` layer inputs plus one layer's
    internals (the sqrt(n_layers) schedule of Chen et al. 2016 at k = sqrt(n_layers)).
    When k does not divide ``n_layers`` the last segment is shorter.

    Args:
        kinds: one ``LayerKind`` per layer (``config.layer_kinds``); default: all full.
        context: keyword arguments every layer gets alike: ``positions`` and
            ``segment_ids`` (``Attention.__call__``); None: none.
        dropout_key: split into one key per layer for the LoRA adapters' dropout; None: no dropout.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from jaxckpt import nn, remat
        >>> model = nn.Transformer(nn.TransformerConfig.preset("tiny", n_layers=3), rngs=nnx.Rngs(0))
        >>> x = jnp.ones((1, 4, model.config.d_model))
        >>> nn.run_blocks(model.blocks, x, remat.get("ratio_0.5"), n_layers=3).shape  # segments 2 + 1
        (1, 4, 128)
    """
    kinds = (FULL,) * n_layers if kinds is None else tuple(kinds)
    if len(kinds) != n_layers:
        raise ValueError(f"run_blocks: {len(kinds)} layer kinds for n_layers={n_layers}")
    distinct, index = distinct_kinds(kinds)
    keys = None if dropout_key is None else jax.random.split(dropout_key, n_layers)
    for start, stop, group in stack_segments(spec, n_layers):
        if start == 0:  # the scanned segments (a scan even of one layer)
            lead = (-1,) if group is None else (-1, group)
            segment = _scan(remat_segment(spec, distinct, group or 1))
        else:  # the shorter last segment
            lead = () if stop - start == 1 else (-1,)
            segment = remat_segment(spec, distinct, stop - start)
        per_layer = jnp.asarray(index[start:stop].reshape(lead))
        if keys is not None:
            per_layer = (per_layer, keys[start:stop].reshape(lead + keys.shape[1:]))
        x = segment(x, _take_layers(blocks, start, stop, lead), per_layer, context)
    return x


def run_blocks_cached(blocks: Block, x: jax.Array, kinds: "tuple[LayerKind, ...]", cache: KVCache):
    """The stack without remat over ``x [B, T, D]`` with a ``KVCache``: one scan over the
    layers and their cache slices; returns ``(x, new_cache)`` (``start`` advanced by T)."""
    distinct, index = distinct_kinds(tuple(kinds))
    layer = _layer(distinct)

    def step(x, block, kind_index, key, value):
        x, new = layer(x, block, kind_index, {"cache": LayerCache(key, value, cache.start)})
        return x, (new.key, new.value)

    scan = nnx.scan(step, in_axes=(nnx.Carry, 0, 0, 0, 0), out_axes=(nnx.Carry, 0))
    x, (key, value) = scan(x, blocks, jnp.asarray(index), cache.key, cache.value)
    return x, KVCache(key, value, cache.start + x.shape[1])
