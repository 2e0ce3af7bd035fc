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
  does not take a compressed value off the working set, as it does a kept one on XLA:CPU),
  and what the (de)quantization adds to it, by compiler (``dequantize_bytes``);
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
    """What (de)quantizing adds to the working set of a layer's backward pass, beside the
    values it reads (which the working set counts):

    * XLA:CPU: the float32 groups ``remat.quantize`` and ``remat.dequantize`` form of each of
      the layer's compressed values, the last group of a row padded to a whole one
      (``rows x ceil(features / group) x group x 4`` bytes; a head of 24 features takes a
      whole group of 128), all counted: XLA:CPU materialises them, and how many are live at
      its peak depends on its schedule. Measured (fp32, ``tiny`` shapes): ``full`` + int8
      boundaries peaked that many bytes above the stored boundaries' saving, to the byte
      (d_model 200 and 72); ``minimal`` with every kept tag in int8 (d_model 72, head_dim
      24, 3 and 12 layers) held 6.6 MB over the model without the groups, within 1% with
      all of them; at d_model 200 (head_dim 40) none but the boundary's showed, so the
      count is an upper bound there (``minimal`` + int8 predicted 12% over).
    * XLA:GPU (and XLA:TPU, not measured) fuses the groups into one kernel, but the compressed
      remat's backward dequantizes every stored value of the layer before it runs the layer's
      VJP, so they are live together at full size, beside a working set that holds them one
      at a time: the layer's compressed values but its input. Measured (bf16, d_model 96, B=2,
      T=512, 3 layers): one compressed tag alone (the attention output, the output
      projection, the boundary) matched the stored saving to within 0.1%, but ``minimal``
      with every kept tag in int8 saved 0.48 MB for 2.43 MB stored less, and q, k, v, gate
      and up together 0.58 MB for 1.61 MB; with the copies counted every spec measured is
      within 8%.

    Example:
        >>> from jaxckpt import nn, plan, remat
        >>> g = plan.layer_graph(plan.Workload(nn.TransformerConfig.preset("tiny", d_model=200), 1, 64))
        >>> dequantize_bytes(g, remat.compressed("full", "int8")) == 64 * 256 * 4
        True
        >>> int8 = remat.compressed("save_attn", "int8")  # on XLA:GPU: the attention output's copy
        >>> on_gpu = dequantize_bytes(g, int8, "h100-80g")
        >>> dequantize_bytes(g, remat.get("full")), on_gpu == g.values["o"].nbytes
        (0, True)
    """
    values = compressed_values(graph, spec)
    if compiled_by(target) is not None:
        return sum(graph.values[name].nbytes for name in values if name != "x")
    return sum(padded_groups_bytes(graph, name, spec.compress_group) for name in values)


def padded_groups_bytes(graph: LayerGraph, name: str, group: int) -> int:
    """Bytes of the float32 groups ``remat.dequantize`` forms for the value ``name``, its last
    group padded to ``group`` features."""
    value = graph.values[name]
    return value.rows * -(-value.features // group) * group * 4


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
