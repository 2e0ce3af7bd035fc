"""The scanned block stack under a remat spec, with layers that differ in a repeating pattern.

The stack's parameters are stacked on one leading layer axis. Its layers may differ in
static ways (``LayerKind``: a sliding window, RoPE or not) that repeat with a period p
(``period``): 1 for a uniform stack, 2 for Gemma 2, 6 for Gemma 3. The stack is then one
``nnx.scan`` over *units* of p layers, each layer of a unit applied with its own static
kind, so compile time and memory do not grow with depth. The ``n_layers % p`` layers
left after the last whole unit run one by one.
"""

import math
from collections.abc import Callable

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxckpt.nn._attention import FULL
from jaxckpt.nn._block import Block
from jaxckpt.nn._choices import LayerKind, period
from jaxckpt.remat import RematSpec, Tag

Segment = Callable[[jax.Array, Block], jax.Array]


def _layer(kind: LayerKind) -> Segment:
    def apply(x: jax.Array, block: Block) -> jax.Array:
        return block(x, kind)

    return apply


def _scan(segment: Segment) -> Segment:
    """``segment`` scanned over the leading (unit or segment) axis of the blocks, x the carry."""
    return nnx.scan(segment, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)


def _layers(blocks: Block, start: int, stop: int, lead: tuple[int, ...]) -> Block:
    """Layers ``start:stop`` of the stack, their leading axis reshaped to ``lead``
    (``()`` for a single block)."""
    graphdef, state = nnx.split(blocks)
    sliced = jax.tree.map(lambda a: a[start:stop].reshape(lead + a.shape[1:]), state)
    return nnx.merge(graphdef, sliced)


def _layer_of_unit(kind: LayerKind, j: int) -> Segment:
    """Layer ``j`` of a unit's stacked blocks. The slice is taken inside the layer's
    remat, so the checkpoint keeps the unit's blocks (the scan's own input, not a copy)."""

    def apply(x: jax.Array, blocks: Block) -> jax.Array:
        return _layers(blocks, j, j + 1, ())(x, kind)

    return apply


def _unit(spec: RematSpec, kinds: tuple[LayerKind, ...]) -> Segment:
    """One unit of ``len(kinds)`` layers, each its own ``nnx.remat`` (unless the spec is
    disabled); a unit of one layer takes a single block, a longer one blocks stacked
    ``[len(kinds), ...]``. Inside a unit, each layer's input is tagged ``Tag.LAYER_INPUT``
    where it enters the layer's remat, as the scan's carry is."""
    single = len(kinds) == 1
    fns = [_layer(kind) if single else _layer_of_unit(kind, j) for j, kind in enumerate(kinds)]
    if spec.enabled:
        fns = [nnx.remat(fn, policy=spec.policy(), prevent_cse=False) for fn in fns]
    if len(fns) == 1:
        return fns[0]

    def unit(x: jax.Array, blocks: Block) -> jax.Array:
        for j, fn in enumerate(fns):
            x = fn(x if j == 0 else checkpoint_name(x, Tag.LAYER_INPUT), blocks)
        return x

    return unit


def remat_segment(spec: RematSpec, kinds: tuple[LayerKind, ...], k: int) -> Segment:
    """One remat segment of ``k`` units of ``kinds``: ``(x, blocks) -> x``.

    For ``k == 1`` the segment is one unit; otherwise its units are stacked on a leading
    axis of size k and scanned, the whole an ``nnx.remat`` around each layer's own. A
    disabled spec gives the plain (un-remat'd) layers.
    """
    unit = _unit(spec, kinds)
    if k == 1:
        return unit
    if not spec.enabled:
        return _scan(unit)
    return nnx.remat(_scan(unit), policy=spec.policy(), prevent_cse=False)


def segment_sizes(spec: RematSpec, n_units: int, unit: int = 1) -> tuple[int, int]:
    """``(k, n_full)``: units per segment and the number of full segments (a shorter last
    segment of ``n_units - k * n_full`` units follows when k does not divide).

    A segment holds ``spec.layers_per_checkpoint`` layers rounded up to whole units of
    ``unit`` layers.

    Example:
        >>> from jaxckpt import remat
        >>> segment_sizes(remat.get("ratio_0.5"), 5), segment_sizes(remat.get("ratio_0.25"), 3, unit=2)
        ((2, 2), (2, 1))
    """
    if not spec.enabled:
        return 1, n_units
    k = min(math.ceil(spec.layers_per_checkpoint / unit), n_units)
    return k, n_units // k


def stack_segments(
    spec: RematSpec, kinds: tuple[LayerKind, ...]
) -> list[tuple[Segment, int, int, tuple, int]]:
    """The pieces ``run_blocks`` applies, in order: ``(fn, start, stop, shape, count)``.

    ``fn(x, blocks)`` runs one remat segment on blocks whose leading shape is ``shape``
    (``()`` for a single block); the piece covers layers ``start:stop`` as ``count`` such
    segments, scanned over when ``count > 1``.
    """
    p = period(kinds)
    n_units, _ = divmod(len(kinds), p)
    inner = () if p == 1 else (p,)
    k, n_full = segment_sizes(spec, n_units, p)
    stop = k * n_full * p
    pieces = [(remat_segment(spec, kinds[:p], k), 0, stop, inner if k == 1 else (k, *inner), n_full)]
    rest = n_units - k * n_full
    if rest:
        shape = inner if rest == 1 else (rest, *inner)
        pieces.append((remat_segment(spec, kinds[:p], rest), stop, stop + rest * p, shape, 1))
    for i in range(n_units * p, len(kinds)):
        pieces.append((remat_segment(spec, (kinds[i],), 1), i, i + 1, (), 1))
    return pieces


def run_blocks(
    blocks: Block, x: jax.Array, spec: RematSpec, n_layers: int, kinds: "tuple[LayerKind, ...] | None" = None
) -> jax.Array:
    """Applies the stacked blocks to ``x`` under ``spec``.

        Each layer is an ``nnx.remat`` with the spec's policy, scanned with ``nnx.scan``
        (over units of the layer pattern's period when ``kinds`` differ; see the module).
        With ``spec.layers_per_checkpoint = k > 1`` the stack is a nested scan: an outer
        scan over segments of k layers, each segment itself an ``nnx.remat``, and an inner
        scan over its layers. The forward pass keeps only segment inputs; the backward pass
        recomputes one segment (keeping its k layer inputs) and then each layer, so the
        activations held are about ``n_layers / k + k`` layer inputs plus one layer's
        internals (the sqrt(n_layers) schedule of Chen et al. 2016 at k = sqrt(n_layers)).
        When k does not divide ``n_layers`` the last segment is shorter.

        Args:
            kinds: one ``LayerKind`` per layer (``config.layer_kinds``); default: all full.

        Example:
            >>> import jax.numpy as jnp
            >>> from flax import nnx
    from jax.ad_checkpoint import checkpoint_name
            >>> from jaxckpt import nn, remat
            >>> model = nn.Transformer(nn.TransformerConfig.preset("tiny", n_layers=3), rngs=nnx.Rngs(0))
            >>> x = jnp.ones((1, 4, model.config.d_model))
            >>> nn.run_blocks(model.blocks, x, remat.get("ratio_0.5"), n_layers=3).shape  # segments 2 + 1
            (1, 4, 128)
    """
    kinds = (FULL,) * n_layers if kinds is None else tuple(kinds)
    if len(kinds) != n_layers:
        raise ValueError(f"run_blocks: {len(kinds)} layer kinds for n_layers={n_layers}")
    for fn, start, stop, shape, count in stack_segments(spec, kinds):
        if count > 1 or start == 0:  # the first piece is always a scan (today's HLO for k = 1)
            x = _scan(fn)(x, _layers(blocks, start, stop, (-1, *shape)))
        else:
            x = fn(x, _layers(blocks, start, stop, shape))
    return x
