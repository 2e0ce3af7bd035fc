"""What compressing a kept residual costs and saves (``RematSpec.compress``, int8 / fp8).

A compressed value is stored in one byte per element and one float32 scale per group of
``compress_group`` features (``remat.compressed_bytes``): a bf16 tensor of width 128 in
``(1 + 4/128) / 2`` of its bytes, so compressing saves ``1 - (1 + 4/group) / itemsize`` of them.
The compressed remat (``jaxckpt.nn``'s ``compressed_remat``, a ``custom_vjp`` per layer)
quantizes it in the forward pass and dequantizes it in the backward pass:

* **bytes**: the stored values (on the device, or on the host when also offloaded) at their
  compressed size, in ``stored_bytes`` and ``host_residual_bytes``;
* **working set**: the layer running its backward pass holds each of its compressed values
  dequantized, at full size, as a layer holds an offloaded value brought back (``predict``
  does not take a compressed value off the working set, as it does a kept one on XLA:CPU), and
  the dequantization's own temporary (``dequantize_bytes``);
* **time**: ``COMPRESS_FLOPS`` per element and the bytes read and written by the quantization
  and the dequantization (``compress_cost``), which ``choice`` adds to a step's time.

The compressed remat records every tag the spec keeps; a tag placed inside a nested
transformation of the layer cannot be kept by it, compressed or not (``conflicting_tags``).
"""

from collections.abc import Collection

from jaxckpt.nn import TransformerConfig, segment_sizes
from jaxckpt.plan._compilers import compiled_by
from jaxckpt.plan._graph import LayerGraph
from jaxckpt.plan._layer_graph import layer_graph
from jaxckpt.plan._specs import saved_tags
from jaxckpt.plan._targets import Target
from jaxckpt.plan._workload import Workload
from jaxckpt.remat import RematSpec, Tag, compressed
from jaxckpt.remat._spec import UNCOMPRESSIBLE

COMPRESS_FLOPS = 4
"""FLOPs per element of a compressed residual, per step: its group's absmax, the division by
the scale and the rounding (``remat.quantize``, forward), the product by the scale
(``remat.dequantize``, backward)."""

MLP_TAGS = frozenset({Tag.MLP_GATE, Tag.MLP_UP, Tag.MLP_ACT, Tag.MLP_DOWN})
"""The tags the MLP places (inside the tiled MLP's ``lax.map`` when it is tiled)."""


def conflicting_tags(workload: Workload) -> frozenset[Tag]:
    """Tags placed inside a nested transformation of the layer for this workload, which a
    spec that compresses anything per layer cannot keep (the compressed remat refuses them at
    trace time): the MLP's under tiling (``mlp_chunk`` below the sequence), the attention
    output under layers of several attention windows (a ``lax.switch``) or context
    parallelism (a ``shard_map``).

    Example:
        >>> from jaxckpt import nn, plan
        >>> cfg = nn.TransformerConfig.preset("tiny")
        >>> conflicting_tags(plan.Workload(cfg, 1, 64))
        frozenset()
        >>> sorted(map(str, conflicting_tags(plan.Workload(cfg.replace(mlp_chunk=16), 1, 64))))
        ['mlp_act', 'mlp_down', 'mlp_gate', 'mlp_up']
    """
    config = workload.config
    tags = set()
    if config.mlp_chunk is not None and workload.local_seq > config.mlp_chunk:
        tags |= MLP_TAGS
    windows = {kind.sliding and config.sliding_window is not None for kind in config.layer_kinds}
    if len(windows) > 1 or workload.seq_shards > 1:
        tags |= {Tag.ATTN_OUT, Tag.ATTN_LSE}
    return frozenset(tags)


def compressible_tags(workload: Workload) -> frozenset[Tag]:
    """The tags a spec may store compressed for this workload: every tag but the log-sum-exp
    (``remat``'s ``UNCOMPRESSIBLE``) and those ``conflicting_tags`` names.

    Example:
        >>> from jaxckpt import nn, plan, remat
        >>> tags = compressible_tags(plan.Workload(nn.TransformerConfig.preset("tiny"), 1, 64))
        >>> remat.Tag.LAYER_INPUT in tags, remat.Tag.ATTN_LSE in tags
        (True, False)
    """
    return frozenset(Tag) - UNCOMPRESSIBLE.keys() - conflicting_tags(workload)


def compressed_values(graph: LayerGraph, spec: RematSpec) -> dict[str, str]:
    """Value name -> format of one layer's values ``spec`` stores compressed: the kept values
    (``LayerGraph.kept``) of its compressed tags, the layer input among them. Under
    ``layers_per_checkpoint > 1`` only the segment's input is compressed: ``{"x": fmt}``.

    Example:
        >>> from jaxckpt import nn, plan, remat
        >>> g = plan.layer_graph(plan.Workload(nn.TransformerConfig.preset("tiny"), 1, 64))
        >>> compressed_values(g, remat.compressed("save_attn", "int8"))
        {'o': 'int8', 'x': 'int8'}
    """
    if not spec.enabled or not spec.compress:
        return {}
    kept = graph.kept(saved_tags(spec)) | {"x"}
    formats = spec.compress
    return {
        name: formats[graph.values[name].tag] for name in sorted(kept) if graph.values[name].tag in formats
    }


def boundary_format(spec: RematSpec) -> str | None:
    """The format the layer (or segment) inputs are stored in, or None (at their dtype)."""
    return spec.compress.get(Tag.LAYER_INPUT) if spec.enabled else None


def dequantize_bytes(graph: LayerGraph, spec: RematSpec, target: "str | Target | None" = None) -> int:
    """The temporary a dequantization adds to the working set of a layer's backward pass, for
    the largest compressed value: XLA:CPU materialises ``remat.dequantize``'s float32 groups,
    the last one padded to a whole group (``rows x ceil(features / group) x group x 4``
    bytes) before it cuts and casts them; XLA:GPU fuses the dequantization into one kernel
    that writes the value at its dtype, which the working set already counts.

    Example:
        >>> from jaxckpt import nn, plan, remat
        >>> g = plan.layer_graph(plan.Workload(nn.TransformerConfig.preset("tiny", d_model=200), 1, 64))
        >>> dequantize_bytes(g, remat.compressed("full", "int8")) == 64 * 256 * 4
        True
        >>> int8 = remat.compressed("full", "int8")
        >>> dequantize_bytes(g, remat.get("full")), dequantize_bytes(g, int8, "h100-80g")
        (0, 0)
    """
    if compiled_by(target) is not None:
        return 0
    group = spec.compress_group
    sizes = [
        graph.values[name].rows * -(-graph.values[name].features // group) * group * 4
        for name in compressed_values(graph, spec)
    ]
    return max(sizes, default=0)


def compress_cost(graph: LayerGraph, spec: RematSpec, config: TransformerConfig) -> tuple[int, int]:
    """``(FLOPs, bytes)`` the quantization and the dequantization of one micro-batch's
    compressed residuals cost: ``COMPRESS_FLOPS`` per element, and each value read at its
    dtype and written compressed (forward), then read compressed and written at its dtype
    (backward). Every layer's compressed values, or under ``layers_per_checkpoint > 1`` every
    segment's input.

    Example:
        >>> from jaxckpt import nn, plan, remat
        >>> w = plan.Workload(nn.TransformerConfig.preset("tiny", n_layers=2), 1, 64)
        >>> g = plan.layer_graph(w)
        >>> flops, moved = compress_cost(g, remat.compressed("full", "int8"), w.config)
        >>> flops == 2 * 4 * 64 * w.config.d_model, compress_cost(g, remat.get("full"), w.config)
        (True, (0, 0))
    """
    values = compressed_values(graph, spec)
    if not values:
        return 0, 0
    k, n_full = segment_sizes(spec, config.n_layers)
    count = config.n_layers if k == 1 else n_full + (config.n_layers > k * n_full)
    flops = moved = 0
    for name, fmt in values.items():
        value = graph.values[name]
        stored = graph.stored_value_bytes(name, fmt, spec.compress_group)
        flops += COMPRESS_FLOPS * value.rows * value.features
        moved += 2 * (value.nbytes + stored)
    return count * flops, count * moved


def compress_spec(spec: RematSpec, fmt: str, tags: "Collection[Tag] | None" = None) -> RematSpec:
    """``spec`` with what it keeps compressed in ``fmt``, as ``jaxckpt train --compress`` does
    (``remat.compressed``), for the planner's rows and candidates: ``tags`` narrows it to those
    of them that ``spec`` keeps and can compress (the others are left alone, not refused),
    and a spec that keeps nothing (``none``) comes back unchanged.

    Example:
        >>> from jaxckpt import remat
        >>> compress_spec(remat.get("save_attn"), "int8", {remat.Tag.ATTN_OUT, remat.Tag.MLP_UP}).compress
        {'attn_out': 'int8'}
        >>> compress_spec(remat.get("none"), "int8") == remat.get("none")
        True
    """
    if not spec.enabled:
        return spec
    if tags is None:
        return compressed(spec, fmt)
    keepable = compressed(spec, fmt).compress.keys()
    narrowed = frozenset(tags) & keepable
    return compressed(spec, fmt, narrowed) if narrowed else spec


def compressed_tag_bytes(
    workload: Workload, spec: RematSpec, *, target: "str | Target | None" = None
) -> dict[Tag, tuple[int, int]]:
    """Tag -> ``(stored, uncompressed)`` bytes of each tag ``spec`` compresses, over the whole
    stack for one micro-batch (on the device or in host memory, where the spec keeps it): the
    layer inputs once per remat segment, the other tags once per layer.

    Example:
        >>> from jaxckpt import nn, plan, remat
        >>> w = plan.Workload(nn.TransformerConfig.preset("tiny", n_layers=2, dtype="bfloat16"), 1, 256)
        >>> stored, full = compressed_tag_bytes(w, remat.compressed("full", "int8"))[remat.Tag.LAYER_INPUT]
        >>> full == 2 * 256 * w.config.d_model * 2, round(stored / full, 3)  # half, and a scale per 128
        (True, 0.516)
    """
    graph = layer_graph(workload, target=target)
    config = workload.config
    k, n_full = segment_sizes(spec, config.n_layers)
    per_layer = compressed_values(graph, spec)
    out: dict[Tag, tuple[int, int]] = {}
    for name, fmt in per_layer.items():
        tag = graph.values[name].tag
        count = config.n_layers if k == 1 else n_full + (config.n_layers > k * n_full)
        stored = count * graph.stored_value_bytes(name, fmt, spec.compress_group)
        full = count * graph.values[name].nbytes
        before = out.get(tag, (0, 0))
        out[tag] = (before[0] + stored, before[1] + full)
    return out
