"""One decoder layer as a graph of values and ops, derived from shapes alone.

Each value carries its bytes and the ``remat.Tag`` it is saved under; each op its
forward FLOPs. Two questions are answered from the graph, for a set of saved tags:

* ``stored_bytes``: what one layer keeps from its forward pass for the backward pass;
* ``recompute_flops``: which ops the backward pass must run again, and their FLOPs.

The residuals the backward pass reads (``LayerGraph.reads``) are those of JAX's own
autodiff rules for the ops in ``jaxckpt.nn``: a matmul's weight gradient reads its
input, a norm reads its input, SwiGLU reads gate and up, the flash backward reads
q, k, v (after RoPE), the output and the log-sum-exp.
"""

import dataclasses
import functools

from jaxckpt.attention import BlockSizes, implementations
from jaxckpt.nn import TransformerConfig
from jaxckpt.plan._workload import Workload
from jaxckpt.remat import Tag


def materializes_scores(attention: str | None) -> bool:
    """Whether the ``flash_attention`` implementation ``attention`` builds the T x S scores
    (its registration's ``materializes_scores``; None, the automatic choice, is blockwise
    or cuDNN, which do not).

    Raises:
        ValueError: for a name no implementation is registered under.

    Example:
        >>> materializes_scores("xla"), materializes_scores("blockwise"), materializes_scores(None)
        (True, False, False)
    """
    if attention is None:
        return False
    registered = implementations()
    if attention not in registered:
        raise ValueError(f"config.attention={attention!r} is not registered; known: {sorted(registered)}")
    return registered[attention].materializes_scores


@dataclasses.dataclass(frozen=True)
class Value:
    """One tensor of the layer: ``nbytes`` per layer, saved under ``tag`` (or untagged)."""

    name: str
    tag: Tag | None
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Op:
    """An op computing ``outputs`` from ``inputs`` with ``flops`` forward FLOPs."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    flops: int


@dataclasses.dataclass(frozen=True)
class LayerGraph:
    """The values and ops of one layer, plus what the backward pass reads.

    Attributes:
        values: name -> ``Value``.
        ops: in forward order.
        reads: the values the backward pass reads (its residuals).
        unkept_reads: reads that autodiff without remat does not keep, because their op
            keeps what it needs in ``internals`` (LayerNorm keeps ``x - mean``, not ``x``).
        recompute_internals: the internals held while a recomputed layer runs its
            backward pass: XLA fuses plain elementwise chains (GELU, LayerNorm) into
            the gradient, but keeps the outputs of ``jax.nn.silu`` (a jitted function)
            and each norm's normalised input.
        internals: bytes of the autodiff residuals that live inside ops (the
            normalised input of a norm, the sigmoid of SwiGLU, the probabilities of a
            materialised softmax...): kept without remat, recomputed under remat.
        attention_tile: bytes of attention scores in flight in the backward pass: one
            tile when blockwise, the T x S scores and probabilities when materialised.

    Example:
        >>> from jaxckpt import nn, plan
        >>> g = plan.layer_graph(plan.Workload(nn.TransformerConfig.preset("tiny"), batch=2, seq=64))
        >>> "x" in g.reads, g.residual_bytes() > g.stored_bytes(set())
        (True, True)
    """

    values: dict[str, Value]
    ops: tuple[Op, ...]
    reads: frozenset[str]
    internals: int
    attention_tile: int
    unkept_reads: frozenset[str] = frozenset()
    recompute_internals: int = 0

    def tagged(self, tags) -> frozenset[str]:
        """Names of the values carrying any of ``tags``."""
        return frozenset(v.name for v in self.values.values() if v.tag in tags)

    def producer(self, name: str) -> Op:
        return next(op for op in self.ops if name in op.outputs)

    def recompute(self, available: frozenset[str]) -> tuple[Op, ...]:
        """The ops the backward pass runs again when only ``available`` values are kept."""
        needed: dict[str, Op] = {}

        def require(name: str) -> None:
            if name in available:
                return
            op = self.producer(name)
            if op.name not in needed:
                needed[op.name] = op
                for dep in op.inputs:
                    require(dep)

        for name in sorted(self.reads):
            require(name)
        return tuple(op for op in self.ops if op.name in needed)

    def kept(self, tags) -> frozenset[str]:
        """The saved values the backward pass uses: read directly or by a recomputed op.

        A saved tag nothing reads back (``mlp_down``) is dropped by JAX, not stored.
        """
        available = self.tagged(tags) | {"x"}
        used = set(self.reads)
        for op in self.recompute(available):
            used.update(op.inputs)
        return frozenset((available & used) | {"x"})

    def stored_bytes(self, tags) -> int:
        """Bytes one layer keeps for the backward pass when ``tags`` are saved (plus its input)."""
        return sum(self.values[name].nbytes for name in self.kept(tags))

    def recompute_flops(self, tags) -> int:
        """Forward FLOPs the backward pass repeats when ``tags`` are saved."""
        available = self.tagged(tags) | {"x"}
        return sum(op.flops for op in self.recompute(available))

    def working_residual_bytes(self) -> int:
        """Bytes of residuals held while a recomputed layer runs its backward pass."""
        return sum(self.values[name].nbytes for name in self.reads) + self.recompute_internals

    def forward_flops(self) -> int:
        """FLOPs of one layer's forward pass."""
        return sum(op.flops for op in self.ops)

    def residual_bytes(self) -> int:
        """Bytes autodiff keeps for one layer without remat (every read, plus internals)."""
        kept = self.reads - self.unkept_reads
        return sum(self.values[name].nbytes for name in kept) + self.internals


def attention_flops(cfg: TransformerConfig, batch: int, seq: int) -> int:
    """Forward FLOPs of causal attention: QK^T and PV over the visible half of T x T."""
    visible = seq * (seq + 1) // 2
    return 4 * batch * cfg.n_heads * visible * cfg.head_dim


def layer_graph(workload: Workload) -> LayerGraph:
    """The graph of one layer of ``workload.config`` on one device: ``[B / D, T]``.

    Only the model, the local batch and the sequence length matter (one micro-batch).

    Example:
        >>> from jaxckpt import nn, plan
        >>> from jaxckpt.remat import Tag
        >>> g = plan.layer_graph(plan.Workload(nn.TransformerConfig.preset("tiny"), 2, 256))
        >>> g.stored_bytes(set()) == g.values["x"].nbytes  # full remat keeps the layer input
        True
        >>> g.recompute_flops({Tag.MLP_ACT}) < g.recompute_flops(set())
        True
    """
    return _layer_graph(workload.config, workload.local_batch, workload.seq)


@functools.lru_cache(maxsize=256)
def _layer_graph(cfg: TransformerConfig, batch: int, seq: int) -> LayerGraph:
    """``layer_graph`` at ``[batch, seq]`` (one device's batch)."""
    n = batch * seq
    e = cfg.compute_dtype.itemsize
    flash = not materializes_scores(cfg.attention)
    d, f = cfg.d_model, cfg.ffn_dim
    nh, kh = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    values = [
        Value("x", Tag.LAYER_INPUT, n * d * e),
        Value("n1", Tag.NORM_OUT, n * d * e),
        Value("q", Tag.Q_PROJ, n * nh * e),
        Value("k", Tag.K_PROJ, n * kh * e),
        Value("v", Tag.V_PROJ, n * kh * e),
        Value("o", Tag.ATTN_OUT if flash else None, n * nh * e),
        Value("p", Tag.OUT_PROJ, n * d * e),
        Value("x1", None, n * d * e),
        Value("n2", Tag.NORM_OUT, n * d * e),
        Value("u", Tag.MLP_UP, n * f * e),
        Value("a", Tag.MLP_ACT, n * f * e),
        Value("down", Tag.MLP_DOWN, n * d * e),
    ]
    bias = 2 * n if cfg.attention_bias else 0
    norm = 5 * n * d
    ops = [
        Op("norm1", ("x",), ("n1",), norm),
        Op("q_proj", ("n1",), ("q",), 2 * n * d * nh + bias * nh // 2),
        Op("k_proj", ("n1",), ("k",), 2 * n * d * kh + bias * kh // 2),
        Op("v_proj", ("n1",), ("v",), 2 * n * d * kh + bias * kh // 2),
    ]
    attn_in = ("q", "k")
    # the internals of the activation's autodiff: silu keeps three [n, F] tensors, the tanh
    # GELU four (x^3 term, tanh, 1 - tanh^2 and a product), the exact GELU two
    mlp_internals = {"swiglu": 3, "gelu_tanh": 4}.get(cfg.activation, 2) * n * f * e
    if cfg.norm == "layer":  # each LayerNorm keeps x - mean, its square and the normalised x (fp32)
        internals = 2 * (3 * n * d * 4 + 2 * n * 4)
        unkept = frozenset({"x", "x1"})
    else:  # each RMSNorm keeps its input in fp32 (when it is not) and the normalised input
        internals = 2 * (n * d * (e + (4 if e != 4 else 0)) + 2 * n * 4)
        unkept = frozenset()
    if cfg.positions == "rope":
        values += [Value("qr", None, n * nh * e), Value("kr", None, n * kh * e)]
        ops.append(Op("rope", ("q", "k"), ("qr", "kr"), 3 * n * (nh + kh)))
        attn_in = ("qr", "kr")
        internals += 4 * seq * cfg.head_dim * 4  # the broadcast cos / sin tables
    attn_out = ("o", "lse") if flash else ("o",)
    if flash:
        values.append(Value("lse", Tag.ATTN_LSE, n * cfg.n_heads * 4))
    ops += [
        Op("attention", (*attn_in, "v"), attn_out, attention_flops(cfg, batch, seq)),
        Op("out_proj", ("o",), ("p",), 2 * n * nh * d + bias * d // 2),
        Op("residual", ("x", "p"), ("x1",), n * d),
        Op("norm2", ("x1",), ("n2",), norm),
    ]
    mlp_bias = 2 * n if cfg.mlp_bias else 0
    if cfg.activation == "swiglu":
        values.append(Value("g", Tag.MLP_GATE, n * f * e))
        ops += [
            Op("gate", ("n2",), ("g",), 2 * n * d * f + mlp_bias * f // 2),
            Op("up", ("n2",), ("u",), 2 * n * d * f + mlp_bias * f // 2),
            Op("act", ("g", "u"), ("a",), 6 * n * f),
        ]
        mlp_reads = {"g", "u", "a"}
    else:
        ops += [
            Op("up", ("n2",), ("u",), 2 * n * d * f + mlp_bias * f // 2),
            Op("act", ("u",), ("a",), 8 * n * f),
        ]
        mlp_reads = {"u", "a"}
    ops.append(Op("down", ("a",), ("down",), 2 * n * f * d + mlp_bias * d // 2))
    reads = {"x", "n1", *attn_in, "v", *attn_out, "x1", "n2", *mlp_reads}
    if flash:
        blocks = BlockSizes.auto(batch * cfg.n_heads).clamp(seq, seq)
        tile = batch * cfg.n_heads * blocks.block_q * blocks.block_k * 4
    else:  # autodiff of the materialised softmax keeps scores and probabilities, fp32
        tile = 2 * batch * cfg.n_heads * seq * seq * 4
        internals += tile
    return LayerGraph(
        values={v.name: v for v in values},
        ops=tuple(ops),
        reads=frozenset(reads),
        internals=internals + mlp_internals,
        attention_tile=tile,
        unkept_reads=unkept,
        recompute_internals=2 * (n * d * 4 + 2 * n * 4)
        + (mlp_internals if cfg.activation == "swiglu" else 0),
    )
