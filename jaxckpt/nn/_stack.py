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
from jaxckpt.remat import Layered, RematSpec, Tag

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


def _grad_window(a: jax.Array, start: int, stop: int) -> jax.Array:
    """Zeros shaped as ``a[start:stop]`` whose cotangent is ``a``'s, padded to its shape: a
    group of a ``Layered`` stack reads its parameters as ``stop_gradient(stack)[i] + window[i]``,
    so the forward pass slices nothing out of the stack (no copy) and the backward pass
    writes the group's gradients as its own scan's stacked output, as a uniform stack does,
    instead of accumulating them in a zero-initialised copy of the whole stack per group
    (what differentiating a scan over a closed-over stack does; measured on XLA:CPU:
    one more copy of the stack's gradients live through the backward pass)."""

    @jax.custom_vjp
    def window(a):
        return jnp.zeros((stop - start, *a.shape[1:]), a.dtype)

    def fwd(a):
        return window(a), None

    def bwd(_, ct):
        full = jnp.zeros(a.shape, ct.dtype)
        return (jax.lax.dynamic_update_slice_in_dim(full, ct, start, axis=0),)

    window.defvjp(fwd, bwd)
    return window(a)


def _sliced_segment(spec: RematSpec, kinds: tuple[LayerKind, ...], k: int, graphdef) -> Segment:
    """One remat segment of ``k`` layers that reads its layers out of the whole stack:
    ``(x, (stack, index, window), per_layer, context) -> x``: layers ``index:index + k`` of
    ``stack`` (the parameters, every layer, gradient stopped), their cotangent passed to
    ``window``, the segment's zero slice that carries the gradient (``_grad_window``). The
    reading happens inside the segment's ``jax.checkpoint``, so the checkpoint keeps the
    whole stack, an input of the scan that runs it (hoisted out of the loop, no copy),
    never a slice of it."""

    def slice_of(a, index):
        if k == 1:
            return jax.lax.dynamic_index_in_dim(a, index, keepdims=False)
        return jax.lax.dynamic_slice_in_dim(a, index, k)

    @jax.custom_vjp
    def read(a, window, index):
        """``a``'s layers at ``index``, exactly (no arithmetic); their cotangent is the window's."""
        return slice_of(a, index)

    def read_fwd(a, window, index):
        return slice_of(a, index), None

    def read_bwd(_, ct):
        return None, ct, None

    read.defvjp(read_fwd, read_bwd)

    def take(stack, index, window):
        return jax.tree.map(lambda a, w: read(a, w, index), stack, window)

    if k == 1:
        inner = _layer(kinds)
    else:
        layer = nnx.remat(_layer(kinds, tag_input=False), policy=spec.policy(), prevent_cse=False)
        inner = _tag_input(_scan(layer))

    def run(x, source, per_layer, context):
        return inner(x, nnx.merge(graphdef, take(*source)), per_layer, context)

    return jax.checkpoint(run, policy=spec.policy(), prevent_cse=False)


def _run_sliced(
    blocks: Block,
    x,
    spec: RematSpec,
    distinct,
    start: int,
    stop: int,
    k: int,
    per_layer,
    context,
    scanned: bool,
):
    """Layers ``start:stop`` under ``spec`` in segments of ``k`` (a scan over them when
    ``scanned``, else one segment of ``stop - start``), each reading its layers out of the
    whole stack inside its checkpoint (``_sliced_segment``): no copy of the parameters, and
    the gradients written as the scan's output."""
    graphdef, state = nnx.split(blocks)
    stack = jax.lax.stop_gradient(state)
    window = jax.tree.map(lambda a: _grad_window(a, start, stop), state)
    if not scanned:
        segment = _sliced_segment(spec, distinct, stop - start, graphdef)
        window = window if stop - start > 1 else jax.tree.map(lambda w: w[0], window)
        return segment(x, (stack, jnp.asarray(start, jnp.int32), window), per_layer, context)
    segment = _sliced_segment(spec, distinct, k, graphdef)
    n = (stop - start) // k
    if k > 1:
        window = jax.tree.map(lambda w: w.reshape(n, k, *w.shape[1:]), window)

    def step(x, scanned_in):
        index, window, layer_in = scanned_in
        return segment(x, (stack, index, window), layer_in, context), None

    index = start + k * jnp.arange(n, dtype=jnp.int32)
    x, _ = jax.lax.scan(step, x, (index, window, per_layer))
    return x


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
    """The pieces ``run_blocks`` applies under a uniform spec, in order: ``(start, stop,
    group)``: layers ``start:stop`` as a scan over segments of ``group`` layers (None: of one
    layer), or a single segment when ``start`` is past the scanned ones (the shorter last
    segment).

    Example:
        >>> from jaxckpt import remat
        >>> stack_segments(remat.get("ratio_0.5"), 5), stack_segments(remat.get("full"), 3)
        ([(0, 4, 2), (4, 5, None)], [(0, 3, None)])
    """
    return [(start, stop, group) for start, stop, group, _, _ in stack_pieces(spec, n_layers)]


def stack_pieces(
    spec: "RematSpec | Layered", n_layers: int
) -> list[tuple[int, int, int | None, RematSpec, bool]]:
    """``(start, stop, group, spec, scanned)`` for each piece ``run_blocks`` applies, in order:
    layers ``start:stop`` under ``spec``, a scan over segments of ``group`` layers (None: of
    one layer) when ``scanned``, else one segment of them (a group's shorter last segment).
    A ``Layered`` spec's groups are cut in turn, each as its own spec cuts a stack of its
    count (``segment_sizes``).

    Raises:
        ValueError: when a ``Layered`` spec's counts do not add up to ``n_layers``.

    Example:
        >>> from jaxckpt import remat
        >>> [p[:3] for p in stack_pieces(remat.Layered(((3, "ratio_0.5"), (2, "full"))), 5)]
        [(0, 2, 2), (2, 3, None), (3, 5, None)]
    """
    if isinstance(spec, Layered):
        if spec.n_layers != n_layers:
            raise ValueError(
                f"remat Layered spec {spec.describe()!r} covers {spec.n_layers} layers; the stack has "
                f"n_layers={n_layers}"
            )
        groups = spec.groups
    else:
        groups = ((n_layers, spec),)
    pieces, offset = [], 0
    for count, group_spec in groups:
        k, n_full = segment_sizes(group_spec, count)
        pieces.append((offset, offset + k * n_full, None if k == 1 else k, group_spec, True))
        if k * n_full < count:
            pieces.append((offset + k * n_full, offset + count, None, group_spec, False))
        offset += count
    return pieces


def distinct_segments(
    spec: "RematSpec | Layered", kinds: "tuple[LayerKind, ...]"
) -> list[tuple[Segment, int, np.ndarray, int]]:
    """``(fn, size, kind_indices, count)`` for each distinct remat segment of the stack,
    for ``remat.describe``: ``fn(x, blocks, kind_indices, None)`` runs one segment of ``size``
    layers, and ``count`` segments are like it. A single-layer segment counts once per
    kind (each analysed alone); a longer one mixes kinds, and the first stands for all.
    A ``Layered`` spec's groups come in stack order, each its own segments.
    """
    distinct, index = distinct_kinds(kinds)
    out = []
    for start, stop, group, piece_spec, scanned in stack_pieces(spec, len(kinds)):
        size = group or (1 if scanned else stop - start)
        if size == 1:
            for i, kind in enumerate(distinct):
                count = int(np.sum(index[start:stop] == i))
                if count:
                    out.append((remat_segment(piece_spec, (kind,), 1), 1, np.zeros((), np.int32), count))
        else:
            out.append(
                (
                    remat_segment(piece_spec, distinct, size),
                    size,
                    index[start : start + size],
                    (stop - start) // size,
                )
            )
    return out


def run_blocks(
    blocks: Block,
    x: jax.Array,
    spec: "RematSpec | Layered",
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

    A ``remat.Layered`` spec runs its groups in turn, each a scan of its own over its
    layers (``stack_pieces``) under its own spec.

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
    layered = isinstance(spec, Layered)
    for start, stop, group, piece_spec, scanned in stack_pieces(spec, n_layers):
        if layered and piece_spec.enabled and not piece_spec.compress:
            lead = (-1,) if group is None else (-1, group)
            lead = lead if scanned else (() if stop - start == 1 else (-1,))
            per_layer = jnp.asarray(index[start:stop].reshape(lead))
            if keys is not None:
                per_layer = (per_layer, keys[start:stop].reshape(lead + keys.shape[1:]))
            x = _run_sliced(
                blocks, x, piece_spec, distinct, start, stop, group or 1, per_layer, context, scanned
            )
            continue
        if scanned:  # the scanned segments (a scan even of one layer)
            lead = (-1,) if group is None else (-1, group)
            segment = _scan(remat_segment(piece_spec, distinct, group or 1))
        else:  # the shorter last segment
            lead = () if stop - start == 1 else (-1,)
            segment = remat_segment(piece_spec, distinct, stop - start)
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
