"""The data of a layer graph: ``Value``, ``Op`` and ``LayerGraph``, and the questions the
planner asks of it (what one layer stores for a set of saved tags, what it recomputes).
``_layer_graph`` builds the graph of a config from shapes alone.
"""

import dataclasses
from collections.abc import Mapping

from jaxckpt.remat import DEFAULT_GROUP, Tag, compressed_bytes


@dataclasses.dataclass(frozen=True)
class Value:
    """One tensor of the layer: ``nbytes`` per layer, saved under ``tag`` (or untagged).

    ``tag`` is a ``remat.Tag`` in the graphs of jaxckpt's own layers (``layer_graph``), and
    any ``checkpoint_name`` (or a primitive's name, ``"dot_general:3"``) in one read off a
    program (``program_graph``).

    ``rows`` x ``features``: its shape as the compressed remat sees it, the last axis (the
    one ``remat.quantize`` cuts into groups) and the product of the others; 0 where the value
    is never compressed (untagged, or the float32 log-sum-exp).
    """

    name: str
    tag: Tag | str | None
    nbytes: int
    rows: int = 0
    features: int = 0


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
            tile when blockwise, the T x S scores and probabilities (and, with a logit
            soft cap, their tanh) when materialised.
        weights: bytes of the layer's matrices in the compute dtype. Without remat a
            layer keeps them (the matmuls' input gradients read them) unless they are
            the scan's own input: ``predict`` counts them when the compute dtype is not
            the storage dtype.
        frozen_flops: forward FLOPs of the projections whose weights are frozen (LoRA's
            base): their backward pass computes the input gradient only.
        adapted: ``(d_in, d_out)`` of each projection that carries a LoRA adapter.

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
    weights: int = 0
    frozen_flops: int = 0
    adapted: tuple[tuple[int, int], ...] = ()
    dtype: str = "float32"
    """The compute dtype: the tagged values' own."""

    def stored_value_bytes(self, name: str, fmt: str | None = None, group: int = DEFAULT_GROUP) -> int:
        """Bytes of the value ``name`` as a remat spec stores it: its own, or in ``fmt``
        (``"int8"``, ``"fp8"``) its values and their scales (``remat.compressed_bytes``)."""
        value = self.values[name]
        if fmt is None:
            return value.nbytes
        return compressed_bytes((value.rows, value.features), self.dtype, fmt, group)

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

    def stored_bytes(
        self, tags, formats: "Mapping[Tag, str] | None" = None, group: int = DEFAULT_GROUP
    ) -> int:
        """Bytes one layer keeps for the backward pass when ``tags`` are saved (plus its input),
        each value of a tag in ``formats`` (``RematSpec.compress``) at its compressed size."""
        formats = formats or {}
        return sum(
            self.stored_value_bytes(name, formats.get(self.values[name].tag), group)
            for name in self.kept(tags)
        )

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
