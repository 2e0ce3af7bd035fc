"""One decoder layer as a graph of values and ops, derived from shapes alone.

Each value carries its bytes and the ``remat.Tag`` it is saved under; each op its
forward FLOPs. Two questions are answered from the graph, for a set of saved tags:

* ``stored_bytes``: what one layer keeps from its forward pass for the backward pass;
* ``recompute_flops``: which ops the backward pass must run again, and their FLOPs.

The residuals the backward pass reads (``LayerGraph.reads``) are those of JAX's own
autodiff rules for the ops in ``jaxckpt.nn``: a matmul's weight gradient reads its
input, a norm reads its input (or keeps its own fp32 copy of it), a gated MLP reads
gate and up, the flash backward reads q, k, v (after q/k norm and RoPE), the output
and the log-sum-exp. The config's choices (``nn.Norm``, ``nn.Activation``,
``nn.Positions``) select rows of the tables in ``_layer_costs``, never strings.

Layers that differ (``config.layer_pattern``: sliding windows, NoPE layers) share one
graph: its bytes are those of the largest kind (a RoPE layer keeps its rotated q and k
and the tables; a window changes no residual of the blockwise kernel), its FLOPs the
mean over the stack's layers, so ``n_layers x`` a graph's FLOPs is the stack's sum.
``layer_graph(workload, kind)`` gives one kind's own graph.

The graph is XLA:CPU's, or XLA:GPU's for a GPU target (``layer_graph(target=)``): there
attention is cuDNN where it takes the layer, else the Pallas kernel
(``attention_implementation``; the blockwise kernel's residuals, tagged alike, and no score
tile: a deviceless compile leaves cuDNN's workspace at ``u8[0]``), and a recomputed
backward holds fewer internals, as XLA:GPU fuses elementwise chains into their consumers:
a norm's row statistics, not its fp32 normalised input, and ``ActivationCost.held_gpu`` of
a gated activation.
"""

import dataclasses
import functools

from jaxckpt.attention import BlockSizes
from jaxckpt.nn import GATED, LayerKind, Positions, TransformerConfig
from jaxckpt.plan._graph import LayerGraph, Op, Value
from jaxckpt.plan._layer_costs import (
    ACTIVATION_COSTS,
    MLP_TARGETS,
    NORM_FLOPS,
    NORM_RESIDUALS,
    attention_flops,
    attention_implementation,
    lane_padded,
    materializes_scores,
    mlp_rows,
)
from jaxckpt.plan._targets import Target, compile_target
from jaxckpt.plan._workload import Workload
from jaxckpt.remat import Tag


def layer_graph(
    workload: Workload, kind: LayerKind | None = None, *, target: "str | Target | None" = None
) -> LayerGraph:
    """The graph of one layer of ``workload.config`` on one device: ``[B / D, T]``.

    Only the model, the local batch and the sequence length matter (one micro-batch).

    Args:
        workload: the step.
        kind: one layer kind's own graph; None: the stack's (the bytes of its largest
            kind, the FLOPs of its mean layer; see the module).
        target: the compiler: None for XLA:CPU, a GPU target (``plan.TARGETS``) for
            XLA:GPU (its attention implementation and fusions; see the module).

    Example:
        >>> from jaxckpt import nn, plan
        >>> from jaxckpt.remat import Tag
        >>> g = plan.layer_graph(plan.Workload(nn.TransformerConfig.preset("tiny"), 2, 256))
        >>> g.stored_bytes(set()) == g.values["x"].nbytes  # full remat keeps the layer input
        True
        >>> g.recompute_flops({Tag.MLP_ACT}) < g.recompute_flops(set())
        True
    """
    kinds = workload.config.layer_kinds if kind is None else (kind,)
    target = None if target is None else compile_target(target)
    config, batch, seq = workload.config, workload.local_batch, workload.local_seq
    split = (workload.seq_shards, workload.context_parallel)
    return _layer_graph(config, batch, seq, kinds, target, workload.attention, split)


@dataclasses.dataclass
class _Parts:
    """A layer graph under construction (for XLA:GPU's and XLA:TPU's fusions when ``gpu``,
    XLA:TPU's tiled layouts when ``tpu``)."""

    gpu: bool = False
    tpu: bool = False
    values: list[Value] = dataclasses.field(default_factory=list)
    ops: list[Op] = dataclasses.field(default_factory=list)
    reads: set[str] = dataclasses.field(default_factory=set)
    unkept: set[str] = dataclasses.field(default_factory=set)
    internals: int = 0
    held: int = 0
    weights: int = 0
    frozen_flops: int = 0
    adapted: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    adapter_buffers: list[int] = dataclasses.field(default_factory=list)
    """Bytes of each LoRA adapter's ``[rows, d_out]`` output the recomputed backward holds beside
    its base projection's (``_projection``). XLA:CPU holds them all. XLA:GPU and XLA:TPU hold one
    at a time: the backward runs the adapted projections one after another and reuses the
    buffer, so the layer holds the largest (``adapter_held``), the maximum over the backward's
    phases, not their sum. Measured on XLA:GPU (h100-80g), ``llama3.1-8b`` QLoRA r=32 on every
    linear layer, 2 layers, B=1, T=32768, ``full``: 10.73 GB; with the sum 12.53 GB predicted
    (+16.8%: seven adapters' outputs, two of them ``[T, F]``), with the largest 10.65 (-0.7%).
    The long-context rows (``bench_long_context.py``), 13.9-17.9% over with the sum, are within
    5.3% with it, compiled again at the lengths XLA:GPU confirms."""

    def adapter_held(self) -> int:
        """Bytes of adapter outputs a recomputed backward holds at once (``adapter_buffers``)."""
        if self.gpu:
            return max(self.adapter_buffers, default=0)
        return sum(self.adapter_buffers)


def _projection(
    parts: _Parts,
    cfg: TransformerConfig,
    name: str,
    src: str,
    dst: str,
    tag: Tag,
    rows: int,
    widths: tuple[int, int],
    bias: bool,
    target: str,
    held_rows: int | None = None,
    features: int | None = None,
) -> None:
    """``dst = src @ W (+ b)``; its input gradient reads ``W``, its weight gradient ``src``.
    A recomputed backward holds an adapter's output over ``held_rows`` (default ``rows``).
    ``features``: the last axis ``dst`` is tagged with (default ``d_out``; the attention's
    q, k and v are tagged per head, ``[B, T, heads, head_dim]``).

    Under LoRA (``cfg.lora``) the base ``W`` is frozen: no weight gradient, so ``src`` is
    read only when ``target`` carries an adapter, ``dst += scale * (src @ a) @ b``, whose
    gradients read ``src`` and the rank-r ``src @ a`` (untagged: recomputed under remat).
    """
    d_in, d_out = widths
    e = cfg.compute_dtype.itemsize
    parts.weights += d_in * d_out * e
    features = d_out if features is None else features
    parts.values.append(Value(dst, tag, rows * d_out * e, rows * d_out // features, features))
    flops = 2 * rows * d_in * d_out + (rows * d_out if bias else 0)
    if cfg.lora is None:
        parts.ops.append(Op(name, (src,), (dst,), flops))
        parts.reads.add(src)
        return
    parts.frozen_flops += flops
    if target not in cfg.lora.targets:
        parts.ops.append(Op(name, (src,), (dst,), flops))
        return
    rank = cfg.lora.rank
    parts.values.append(Value(f"{dst}_lora", None, rows * rank * e))
    parts.ops.append(Op(f"{name}_lora", (src,), (f"{dst}_lora",), 2 * rows * d_in * rank))
    parts.ops.append(Op(name, (src, f"{dst}_lora"), (dst,), flops + 2 * rows * rank * d_out + rows * d_out))
    parts.reads.update((src, f"{dst}_lora"))
    # the adapter's own output and cotangent, beside the base's (``_Parts.adapter_buffers``)
    parts.adapter_buffers.append((rows if held_rows is None else held_rows) * d_out * e)
    parts.adapted.append(widths)


def _norm(
    parts: _Parts,
    cfg: TransformerConfig,
    name: str,
    src: str,
    dst: str,
    rows: int,
    width: int,
    tag: Tag | None = None,
) -> None:
    """``dst = norm(src)`` over ``width`` features of ``rows`` rows (a d_model norm, or a
    q/k norm over head_dim per head)."""
    itemsize = cfg.compute_dtype.itemsize
    parts.values.append(Value(dst, tag, rows * width * itemsize, rows, width))
    parts.ops.append(Op(name, (src,), (dst,), NORM_FLOPS * rows * width))
    kept, keeps_input = NORM_RESIDUALS[cfg.norm](itemsize, rows, width)
    parts.internals += kept
    # a recomputed backward holds the row statistics and, on XLA:CPU, the fp32 normalised
    # input (XLA:GPU recomputes it inside the fusions that read it); XLA:TPU keeps one
    # statistic a row, f32[rows, 1] laid out over a whole 128-lane tile
    stats = rows * 4 * lane_padded(1) if parts.tpu else 2 * rows * 4
    parts.held += stats + (0 if parts.gpu else rows * width * 4)
    parts.reads.add(src)
    if not keeps_input:
        parts.unkept.add(src)


def _attention(
    parts: _Parts,
    cfg: TransformerConfig,
    batch: int,
    seq: int,
    kinds: tuple[LayerKind, ...],
    attention: str,
    split: tuple[int, str] = (1, "all_gather"),
) -> None:
    """q, k, v from ``n1``; q/k norm; RoPE (on the rotary dims); attention; ``p`` the output projection.

    ``split``: ``(shards, strategy)`` of a sequence split over a ``seq`` axis, ``seq`` being one
    device's share: each device's queries attend over the whole sequence (``shards`` times the
    pairs of its share, zigzag-balanced), and a recomputed backward holds, beside its share,
    the gathered K/V and their fp32 gradients (``"all_gather"``) or two K/V blocks in flight
    and their fp32 gradient accumulators (``"ring"``)."""
    n, e, h = batch * seq, cfg.compute_dtype.itemsize, cfg.head_dim
    nh, kh = cfg.n_heads * h, cfg.n_kv_heads * h
    for name, tag, width in (("q", Tag.Q_PROJ, nh), ("k", Tag.K_PROJ, kh), ("v", Tag.V_PROJ, kh)):
        widths = (cfg.d_model, width)
        _projection(
            parts, cfg, f"{name}_proj", "n1", name, tag, n, widths, cfg.attention_bias, name, features=h
        )
    q, k = "q", "k"
    if cfg.qk_norm:
        _norm(parts, cfg, "q_norm", "q", "qn", n * cfg.n_heads, h)
        _norm(parts, cfg, "k_norm", "k", "kn", n * cfg.n_kv_heads, h)
        q, k = "qn", "kn"
    roped = [kind.rope and cfg.positions == Positions.ROPE for kind in kinds]
    if any(roped):  # NoPE layers skip it: the mean over the stack's layers
        parts.values += [Value("qr", None, n * nh * e), Value("kr", None, n * kh * e)]
        flops = 3 * n * (cfg.n_heads + cfg.n_kv_heads) * cfg.rotary_dim
        parts.ops.append(Op("rope", (q, k), ("qr", "kr"), round(flops * sum(roped) / len(roped))))
        parts.internals += 4 * seq * cfg.rotary_dim * 4  # the broadcast cos / sin tables, fp32
        q, k = "qr", "kr"
    if parts.tpu and h % 128:  # the kernel's per-head operands, head_dim minor: lane-padded
        pad = lane_padded(h)
        parts.values = [
            dataclasses.replace(v, nbytes=v.nbytes * pad // h) if v.name in (q, k) else v
            for v in parts.values
        ]
    flash = not materializes_scores(attention)
    outputs = ("o", "lse") if flash else ("o",)
    o_bytes = n * nh * e * (lane_padded(h) if parts.tpu else h) // h
    parts.values.append(Value("o", Tag.ATTN_OUT if flash else None, o_bytes, n * cfg.n_heads, h))
    if flash:
        parts.values.append(Value("lse", Tag.ATTN_LSE, n * cfg.n_heads * 4))
    shards, strategy = split
    flops = shards * sum(attention_flops(cfg, batch, seq, kind) for kind in kinds) / len(kinds)
    if shards > 1:
        kv = 2 * n * kh  # K and V of one device's share, elements
        parts.held += kv * (shards - 1) * (e + 4) if strategy == "all_gather" else kv * (2 * e + 4)
    parts.ops.append(Op("attention", (q, k, "v"), outputs, round(flops)))
    parts.reads.update((q, k, "v", *outputs))
    widths = (nh, cfg.d_model)
    _projection(parts, cfg, "out_proj", "o", "p", Tag.OUT_PROJ, n, widths, cfg.attention_out_bias, "o")


def _score_tile(cfg: TransformerConfig, batch: int, seq: int, attention: str) -> int:
    """Bytes of attention scores in flight in the backward pass (see ``LayerGraph.attention_tile``).

    A logit soft cap adds no blockwise tile (XLA fuses the tanh into the tile's exponent:
    Gemma 2 shapes at T=1536 in 512-key tiles measured the same peak with and without it).
    cuDNN's and the Pallas kernel's tiles live in the kernel (registers and shared memory;
    cuDNN's workspace is ``u8[0]`` in a deviceless compile).
    """
    if attention in ("cudnn", "pallas", "splash"):
        return 0
    if materializes_scores(attention):  # autodiff keeps scores and probabilities (and the tanh), fp32
        capped = cfg.attention_softcap is not None
        return (2 + capped) * batch * cfg.n_heads * seq * seq * 4
    blocks = BlockSizes.auto(batch * cfg.n_heads).clamp(seq, seq)
    return batch * cfg.n_heads * blocks.block_q * blocks.block_k * 4


def _mlp(parts: _Parts, cfg: TransformerConfig, n: int, held_rows: int) -> None:
    """up (and gate) from ``n2``, the activation ``a``, ``down``; a recomputed backward holds
    the activation's internals over ``held_rows`` rows (one chunk's under tiling: ``mlp_rows``).

    Tiled (``held_rows < n``), the backward reads one chunk's gate, up and activation: values
    ``g_chunk``, ``u_chunk``, ``a_chunk`` of ``held_rows`` rows, cut (at no cost) from the whole
    ones, which a spec that saves their tags still keeps whole (stacked over the chunks) and
    one that does not recomputes. The MLP recomputes its chunks even without remat, so autodiff
    keeps none of its values then (``unkept``), only its input ``n2``.
    """
    d, f, e, first = cfg.d_model, cfg.ffn_dim, cfg.compute_dtype.itemsize, len(parts.values)
    tiled = held_rows < n
    act_in = ("u",)
    if cfg.activation in GATED:
        _projection(parts, cfg, "gate", "n2", "g", Tag.MLP_GATE, n, (d, f), cfg.mlp_bias, "gate", held_rows)
        act_in = ("g", "u")
    _projection(parts, cfg, "up", "n2", "u", Tag.MLP_UP, n, (d, f), cfg.mlp_bias, "up", held_rows)
    cost = ACTIVATION_COSTS[cfg.activation]
    parts.values.append(Value("a", Tag.MLP_ACT, n * f * e, n, f))
    parts.ops.append(Op("act", act_in, ("a",), cost.flops * n * f))
    read = {name: name for name in (*act_in, "a")}
    if tiled:
        read = {name: f"{name}_chunk" for name in read}
        parts.values += [Value(chunk, None, held_rows * f * e) for chunk in read.values()]
        parts.ops.append(Op("chunk", tuple(read), tuple(read.values()), 0))
    parts.reads.update(read[name] for name in act_in)
    internals, held = cost.internals, cost.held_gpu if parts.gpu else cost.held
    if cfg.lora is not None and not set(cfg.lora.targets) & set(MLP_TARGETS):
        # a frozen MLP: no weight gradient waits on the activation's cotangents
        internals, held = internals - min(internals, 1), held - min(held, 2)
    parts.internals += 0 if tiled else internals * n * f * e
    parts.held += held * held_rows * f * e
    down = ("down", read["a"], "down", Tag.MLP_DOWN, n, (f, d), cfg.mlp_bias, "down", held_rows)
    _projection(parts, cfg, *down)
    if tiled:
        parts.unkept.update(v.name for v in parts.values[first:] if v.name != "down")  # its output stays


@functools.lru_cache(maxsize=256)
def _layer_graph(
    cfg: TransformerConfig,
    batch: int,
    seq: int,
    kinds: tuple[LayerKind, ...],
    target: Target | None = None,
    attention: "str | None" = None,
    split: tuple[int, str] = (1, "all_gather"),
) -> LayerGraph:
    """``layer_graph`` at ``[batch, seq]`` (one device's batch), over the layers of ``kinds``,
    compiled for ``target`` (None: XLA:CPU), attending with ``attention`` (None: automatic)."""
    n, d = batch * seq, cfg.d_model
    attention = attention_implementation(cfg, target, attention)
    x = Value("x", Tag.LAYER_INPUT, n * d * cfg.compute_dtype.itemsize, n, d)
    tpu = target is not None and target.platform == "tpu"
    parts = _Parts(gpu=target is not None, tpu=tpu, values=[x])
    _norm(parts, cfg, "norm1", "x", "n1", n, d, Tag.NORM_OUT)
    _attention(parts, cfg, batch, seq, kinds, attention, split)
    out = "p"
    if cfg.post_norms:  # Gemma: x + post(attn(pre(x))), and the same around the MLP
        _norm(parts, cfg, "post_norm1", "p", "pn", n, d)
        out = "pn"
    parts.values.append(Value("x1", None, n * d * cfg.compute_dtype.itemsize))
    parts.ops.append(Op("residual", ("x", out), ("x1",), n * d))
    _norm(parts, cfg, "norm2", "x1", "n2", n, d, Tag.NORM_OUT)
    _mlp(parts, cfg, n, mlp_rows(cfg, batch, seq))
    if cfg.post_norms:
        _norm(parts, cfg, "post_norm2", "down", "dn", n, d)
    tile = _score_tile(cfg, batch, seq, attention)
    return LayerGraph(
        values={v.name: v for v in parts.values},
        ops=tuple(parts.ops),
        reads=frozenset(parts.reads),
        internals=parts.internals + (tile if materializes_scores(attention) else 0),
        attention_tile=tile,
        unkept_reads=frozenset(parts.unkept),
        recompute_internals=parts.held + parts.adapter_held(),
        weights=parts.weights,
        frozen_flops=parts.frozen_flops,
        adapted=tuple(parts.adapted),
        dtype=cfg.compute_dtype.name,
    )
