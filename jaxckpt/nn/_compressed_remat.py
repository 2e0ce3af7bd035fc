"""The compressed remat: a remat segment whose kept activations are stored int8 / fp8.

A ``jax.checkpoint`` policy saves the very value the forward pass used, so it cannot
store a compressed copy while the forward runs at full precision. A segment under a
spec with ``compress`` is therefore a ``jax.custom_vjp`` of its own:

- forward: the segment runs exactly (the loss is bit-identical to the uncompressed
  spec's), while ``jaxckpt._tags.recording`` collects the kept tags it places; the
  residuals are the segment's input and those values, each quantized where the spec
  compresses it (``remat.quantize``) and moved to ``pinned_host`` memory where the spec
  offloads it, and the parameters;
- backward: the stored values are brought back and dequantized, and ``jax.vjp`` of the
  segment at the dequantized input runs under ``jaxckpt._tags.substituting``: each kept
  tag's value is the stored one, its tangent the recomputed expression's (whose value
  XLA then drops: under ``save_attn`` the attention forward kernel does not run again).
  Everything not kept is recomputed, as under ``jax.checkpoint``.

A segment of several layers (``layers_per_checkpoint > 1``) keeps only its input here;
its layers inside are the usual ``nnx.remat`` of the spec's policy.
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxckpt._tags import Tag, recording, substituting
from jaxckpt.remat import RematSpec, dequantize, quantize
from jaxckpt.remat._spec import require_pinned_host

Segment = Callable[[jax.Array, nnx.Module, "jax.Array | tuple", "dict | None"], jax.Array]


def _store(spec: RematSpec, name: str, value: jax.Array):
    """``value`` as the backward pass finds it: compressed and/or in host memory.

    fp8 values are kept as their bytes (``uint8``): XLA:CPU wrote each layer's fp8 slice into
    the scan's stack of all layers through float32 and converted the whole stack again, so the
    step grew with the square of the depth (1.49x the uncompressed step at 24 layers); the
    bytes update in place, as int8's do."""
    fmt = spec.compress.get(name)
    stored = value if fmt is None else quantize(value, fmt, spec.compress_group, check_finite=False)
    if fmt == "fp8":
        stored = dataclasses.replace(stored, values=jax.lax.bitcast_convert_type(stored.values, jnp.uint8))
    if name in spec.offload:
        stored = jax.device_put(stored, jax.memory.Space.Host)
    return stored


def _load(spec: RematSpec, name: str, stored) -> jax.Array:
    """The value ``_store`` stored, back in device memory and at its dtype."""
    if name in spec.offload:
        stored = jax.device_put(stored, jax.memory.Space.Device)
    fmt = spec.compress.get(name)
    if fmt == "fp8":
        values = jax.lax.bitcast_convert_type(stored.values, jnp.float8_e4m3fn)
        stored = dataclasses.replace(stored, values=values)
    return stored if fmt is None else dequantize(stored)


def compressed_remat(segment: Segment, spec: RematSpec, boundary_only: bool = False) -> Segment:
    """``segment`` (``(x, module, per_layer, context) -> x``) as a compressed remat under
    ``spec`` (whose ``compress`` is not empty): the input is stored as ``spec`` keeps
    ``Tag.LAYER_INPUT``, and, unless ``boundary_only`` (a segment of several layers), the
    other tags the spec keeps as it keeps them.

    Raises:
        ValueError: at trace time, when a kept tag is placed inside a loop or a
            ``shard_map`` of the segment (``TransformerConfig.mlp_chunk``, layers of
            several attention windows, context parallelism): its value cannot leave it.
    """
    if spec.offload:
        require_pinned_host()
    kept = () if boundary_only else tuple(sorted(str(t) for t in spec.kept_tags - {Tag.LAYER_INPUT}))
    boundary = str(Tag.LAYER_INPUT)

    def run(graphdef, x, state, per_layer, context):
        return segment(x, nnx.merge(graphdef, state), per_layer, context)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def call(graphdef, x, state, per_layer, context):
        return run(graphdef, x, state, per_layer, context)

    def fwd(graphdef, x, state, per_layer, context):
        with recording(kept) as values:
            y = run(graphdef, x, state, per_layer, context)
        stored = {name: [_store(spec, name, v) for v in values[name]] for name in kept}
        return y, (_store(spec, boundary, x), stored, state, per_layer, context)

    def bwd(graphdef, residuals, dy):
        x, stored, state, per_layer, context = residuals
        x = _load(spec, boundary, x)
        saved = {name: [_load(spec, name, v) for v in values] for name, values in stored.items()}
        with substituting(saved):
            _, pullback = jax.vjp(lambda x, state: run(graphdef, x, state, per_layer, context), x, state)
        dx, dstate = pullback(dy)
        no_cotangent = functools.partial(jax.tree.map, lambda _: None)  # integer inputs
        return dx, dstate, no_cotangent(per_layer), no_cotangent(context)

    call.defvjp(fwd, bwd)

    def compressed(x, module, per_layer, context):
        graphdef, state = nnx.split(module)
        return call(graphdef, x, state, per_layer, context)

    return compressed
