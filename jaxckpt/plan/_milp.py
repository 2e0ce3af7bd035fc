"""``solve``: the cheapest per-layer remat spec whose predicted peak fits a budget.

The choice per tag is save, offload or recompute, and with ``allow_compress`` also save
compressed or offload compressed (``RematSpec.compress``: int8 or fp8 values and a float32
scale per group of features). The cost is the recompute FLOPs plus the offload traffic
(priced at the device's host bandwidth) plus the (de)quantization of what is compressed
(its FLOPs and its traffic at the device's HBM bandwidth); the constraint is the analytic
peak (``predict``) within the budget. Both are linear in the choices once the recomputed
ops are variables too, so the problem is a small mixed-integer program, solved exactly
with ``scipy.optimize.milp``:

* ``keep_t + off_t + ckeep_t + coff_t <= 1`` for each tag t (saved, offloaded, saved
  compressed, offloaded compressed; all 0: recomputed);
* ``run_o >= 1 - saved(v)`` for each value v the backward pass reads, o its producer, where
  ``saved`` is the sum of v's tag's four choices;
* ``run_p >= run_o - saved(i)`` for each input i of each op o, p the producer of i;
* every branch of the ``max`` in the activation model below the budget.

The layer input (the remat boundary) is always kept; with ``offload`` one more variable,
``off_x``, moves every layer's boundary to host memory (``offload_full``): ``n x`` bytes
off every budget row, two crossings of the host link a layer in the cost. With
``allow_compress`` two more, ``cx`` and ``cox``, store it compressed on the device or on
the host (``off_x + cx + cox <= 1``).

A compressed value is counted at its compressed size (``LayerGraph.stored_value_bytes``),
saving ``1 - (1 + 4 / group) / itemsize`` of its bytes; on XLA:CPU it does not shrink the
working set as a kept one does (the backward holds it dequantized), and the layer's row
holds what the (de)quantization adds (``dequantize_bytes``): on XLA:CPU each compressed
value's float32 groups, on XLA:GPU each one's dequantized copy.
``Tag.ATTN_LSE`` is never compressed, and where a tag is placed inside a nested
transformation of the layer (``conflicting_tags``) no spec that compresses anything keeps it.
"""

from collections.abc import Collection, Sequence

import numpy as np

from jaxckpt.plan._analytic import predict
from jaxckpt.plan._compilers import compiled_by, live_temp, on_tpu, vmem_scratch
from jaxckpt.plan._compression import (
    COMPRESS_FLOPS,
    compressible_tags,
    conflicting_tags,
    padded_groups_bytes,
)
from jaxckpt.plan._devices import DEVICES, DevicePreset
from jaxckpt.plan._layer_graph import LayerGraph, layer_graph
from jaxckpt.plan._state import update_workspace
from jaxckpt.plan._targets import Target
from jaxckpt.plan._working_set import compiler_extras, head_branch, layer_working_set
from jaxckpt.plan._workload import Workload
from jaxckpt.remat import DEFAULT_GROUP, FORMATS, RematSpec, Tag


def _tunable(graph: LayerGraph) -> list[Tag]:
    """The tags worth deciding: carried by a value the backward pass or a recompute can read
    (not the layer input, which is always kept; not ``mlp_down``, which nothing reads)."""
    readable = graph.reads | {name for op in graph.ops for name in op.inputs}
    return sorted({graph.values[name].tag for name in readable} - {None, Tag.LAYER_INPUT})


def solve(
    workload: Workload,
    budget: int,
    *,
    device: DevicePreset = DEVICES["cpu"],
    offload: bool = False,
    tags: "Sequence[Tag] | None" = None,
    exclude: "Sequence[RematSpec]" = (),
    target: "str | Target | None" = None,
    allow_compress: bool = False,
    compress_format: str = "int8",
    compressed_tags: "Collection[Tag] | None" = None,
) -> RematSpec | None:
    """The per-layer spec of least cost whose predicted peak is within ``budget`` (exact MILP).

    Args:
        workload: the step; over ``workload.devices`` ``budget`` is per device.
        budget: bytes (per device).
        device: prices recompute (its matmul rate), offload (its host link) and compression
            (its HBM bandwidth).
        offload: allow offloading tags to host memory, and the layer inputs themselves
            (the remat boundaries, ``Tag.LAYER_INPUT``: ``offload_full``).
        tags: restrict the decision to these tags (the others are recomputed; the layer
            inputs are kept on the device unless ``Tag.LAYER_INPUT`` is among them).
        exclude: specs not to return (each a no-good cut on the choice variables).
        target: the compiler the peak is predicted for (``predict(target=)``): None for
            XLA:CPU, a GPU target name for XLA:GPU.
        allow_compress: allow storing kept tags (and the layer inputs) compressed in
            ``compress_format``, on the device or, with ``offload``, on the host. Off by
            default: compression changes the gradients slightly. Never ``Tag.ATTN_LSE``.
        compress_format: ``"int8"`` or ``"fp8"``: the format of what is compressed.
        compressed_tags: tags that, when kept, must be kept compressed (what ``jaxckpt
            train --compress`` does to a spec; ``Tag.LAYER_INPUT`` for the boundaries):
            compression without ``allow_compress``, for these tags only.

    Returns:
        The spec, or None when no spec's prediction fits.

    Raises:
        ValueError: for an unknown ``compress_format``.

    Example:
        >>> from jaxckpt import nn, plan
        >>> w = plan.Workload(nn.TransformerConfig.preset("tiny"), batch=2, seq=64)
        >>> spec = plan.solve(w, plan.predict(w, "save_attn").total)
        >>> plan.predict(w, spec).total <= plan.predict(w, "save_attn").total
        True
        >>> tight = plan.predict(w, "full").total - 1  # below full remat: only compression fits
        >>> squeezed = plan.solve(w, tight, allow_compress=True)
        >>> plan.solve(w, tight) is None, squeezed.compress["layer_input"]
        (True, 'int8')
    """
    if compress_format not in FORMATS:
        raise ValueError(f"solve: compress_format={compress_format!r} must be one of {', '.join(FORMATS)}")
    graph = layer_graph(workload, target=target)
    boundary = offload and (tags is None or Tag.LAYER_INPUT in tags)  # off_x: offload_full's choice
    decided = tags
    tags = [t for t in (tags if tags is not None else _tunable(graph)) if t != Tag.LAYER_INPUT]
    forced = frozenset(compressed_tags or ())
    compressible = compressible_tags(workload) & (frozenset(Tag) if allow_compress else forced)
    if decided is not None and Tag.LAYER_INPUT not in decided:
        compressible -= {Tag.LAYER_INPUT}
    program = _Program(graph, tags, compress_format, held_dequantized=compiled_by(target) is None)
    program.add_recompute_rules(offload, boundary)
    program.add_compression(compressible, forced, conflicting_tags(workload))
    program.add_exclusions(exclude)
    if not program.add_budget(workload, budget, target):
        return None
    return program.solve(device)


class _Program:
    """The MILP's variables and rows: ``keep_t``, ``off_t``, ``ckeep_t``, ``coff_t`` per tag (a
    ``remat.Tag``, or any name of a graph read off a program: ``plan_fn``),
    then ``run_o`` per op, then ``off_x``, ``cx``, ``cox`` (the layer inputs in host memory,
    compressed on the device, compressed in host memory)."""

    def __init__(
        self, graph: LayerGraph, tags: list[Tag], fmt: str, group: int = DEFAULT_GROUP, held_dequantized=True
    ):
        self.graph, self.tags, self.ops, self.fmt = graph, tags, list(graph.ops), fmt
        nt = len(tags)
        self.size = 4 * nt + len(self.ops) + 3
        self.keep = {t: i for i, t in enumerate(tags)}
        self.off = {t: nt + i for i, t in enumerate(tags)}
        self.ckeep = {t: 2 * nt + i for i, t in enumerate(tags)}
        self.coff = {t: 3 * nt + i for i, t in enumerate(tags)}
        self.run = {op.name: 4 * nt + i for i, op in enumerate(self.ops)}
        self.off_x, self.cx, self.cox = range(self.size - 3, self.size)
        self.rows, self.lo, self.hi = [], [], []
        self.upper = np.ones(self.size)
        self.upper[[self.cx, self.cox]] = 0  # until add_compression allows them
        for t in tags:
            self.upper[[self.ckeep[t], self.coff[t]]] = 0

        def values(t):
            return [name for name, v in graph.values.items() if v.tag == t]

        # bytes: a tag's values, counted once per layer, and compressed
        self.tag_bytes = {t: sum(graph.values[name].nbytes for name in values(t)) for t in tags}
        self.small_bytes = {t: sum(graph.stored_value_bytes(n, fmt, group) for n in values(t)) for t in tags}
        self.elements = {
            t: sum(graph.values[n].rows * graph.values[n].features for n in values(t)) for t in tags
        }
        x = graph.values["x"]
        self.x, self.small_x = x.nbytes, graph.stored_value_bytes("x", fmt, group)
        self.elements_x = x.rows * x.features
        # what a compressed tag adds to the layer's working set (``dequantize_bytes``): on XLA:CPU
        # its float32 groups, on XLA:GPU its dequantized copy (the layer input's: nothing)
        if held_dequantized:
            self.temp = {t: sum(padded_groups_bytes(graph, n, group) for n in values(t)) for t in tags}
            self.temp_x = padded_groups_bytes(graph, "x", group)
        else:
            self.temp, self.temp_x = dict(self.tag_bytes), 0

    def constraint(self, coefs: dict[int, float], low: float, high: float) -> None:
        """``low <= sum(c * var) <= high``."""
        row = np.zeros(self.size)
        for index, c in coefs.items():
            row[index] += c
        self.rows.append(row)
        self.lo.append(low)
        self.hi.append(high)

    def choices(self, t: Tag) -> list[int]:
        """The four ways of keeping ``t``: saved, offloaded, saved compressed, offloaded compressed."""
        return [self.keep[t], self.off[t], self.ckeep[t], self.coff[t]]

    def saved(self, value: str) -> dict[int, float]:
        """The sum of the choices of the tag ``value`` carries (the layer input is not a
        decision: kept)."""
        tag = self.graph.values[value].tag
        return dict.fromkeys(self.choices(tag), 1.0) if tag in self.keep else {}

    def add_recompute_rules(self, offload: bool, boundary: bool) -> None:
        """A tag is kept at most once; what the backward pass reads is saved or rerun;
        the layer inputs go to host memory only when ``boundary``."""
        graph, run = self.graph, self.run
        if not boundary:
            self.upper[[self.off_x, self.cox]] = 0
        self.constraint({self.off_x: 1, self.cx: 1, self.cox: 1}, -np.inf, 1)
        for t in self.tags:
            self.constraint(dict.fromkeys(self.choices(t), 1.0), -np.inf, 1)
            if not offload:
                self.constraint({self.off[t]: 1, self.coff[t]: 1}, 0, 0)
        for value in graph.reads:
            if value == "x":
                continue
            producer = run[graph.producer(value).name]
            self.constraint({producer: 1, **self.saved(value)}, 1, np.inf)  # run + kept >= 1
        for op in self.ops:
            for value in op.inputs:
                if value == "x":
                    continue
                coefs = {run[graph.producer(value).name]: 1.0, run[op.name]: -1.0}
                for index, c in self.saved(value).items():
                    coefs[index] = coefs.get(index, 0) + c
                self.constraint(coefs, 0, np.inf)  # run_p + kept >= run_o

    def add_compression(
        self, compressible: frozenset[Tag], forced: frozenset[Tag], conflicting: frozenset[Tag]
    ) -> None:
        """Lets the tags of ``compressible`` be kept compressed; those of ``forced`` may be kept
        only compressed; none of ``conflicting`` is kept when anything is compressed."""
        if Tag.LAYER_INPUT in compressible:
            self.upper[self.cx] = 1
            self.upper[self.cox] = self.upper[self.off_x]
            if Tag.LAYER_INPUT in forced:
                self.upper[self.off_x] = 0
                self.constraint({self.cx: 1, self.cox: 1}, 1, 1)
        for t in self.tags:
            if t not in compressible:
                continue
            self.upper[self.ckeep[t]] = 1
            self.upper[self.coff[t]] = 1  # the offload rows bound it
            if t in forced:
                self.upper[[self.keep[t], self.off[t]]] = 0
        compressing = [self.cx, self.cox] + [i for t in self.tags for i in (self.ckeep[t], self.coff[t])]
        compressing = [i for i in compressing if self.upper[i] > 0]
        for t in self.tags:
            if t in conflicting:
                for c in compressing:
                    self.constraint({**dict.fromkeys(self.choices(t), 1.0), c: 1}, -np.inf, 1)

    def add_exclusions(self, exclude: "Sequence[RematSpec]") -> None:
        """No-good cuts: differ from each excluded spec in at least one choice."""
        for spec in exclude:
            coefs: dict[int, float] = {}
            flips = 0
            squeezed = Tag.LAYER_INPUT in spec.compress
            off = spec.offloads_boundary
            choices = [
                (self.off_x, off and not squeezed),
                (self.cx, squeezed and not off),
                (self.cox, squeezed and off),
            ]
            for t in self.tags:
                small = t in spec.compress
                choices += [
                    (self.keep[t], t in spec.save and not small),
                    (self.off[t], t in spec.offload and not small),
                    (self.ckeep[t], t in spec.save and small),
                    (self.coff[t], t in spec.offload and small),
                ]
            for var, chosen in choices:
                coefs[var] = -1.0 if chosen else 1.0
                flips += chosen
            self.constraint(coefs, 1 - flips, np.inf)

    def add_budget(self, workload: Workload, budget: int, target) -> bool:
        """Every branch of the activation model's ``max`` within ``budget``; False when even the
        optimizer update does not fit. On XLA:CPU kept tags shrink the layer's working set too
        (not held twice); compressed ones do not (the backward holds them dequantized), and
        compressed layer inputs add their dequantization's temporary. XLA:GPU and XLA:TPU slice kept
        tags out of their stacks as copies, and XLA:GPU adds its GEMM workspace and FSDP's
        transposed shards (``predict``). On
        XLA:TPU the state is counted as it allocates it (tiles padded) and the temporaries
        (activations and gradients) as their allocation, which ``hbm_temp`` scales from the
        live bytes the rows bound: the room is turned back into live bytes (``live_temp``), and
        the chip's VMEM scratch is taken off each working set (``vmem_scratch``)."""
        base = predict(workload, RematSpec(), target=target)
        fixed = base.params + base.optimizer + base.inputs
        temps = budget - fixed  # XLA:TPU: an allocation, of which the live bytes are less
        room = (live_temp(temps, target) if on_tpu(target) else temps) - base.grads
        if room < update_workspace(workload):
            return False
        n, x = workload.config.n_layers, self.x
        on_gpu = target is not None  # XLA:GPU or XLA:TPU: kept tags do not shrink the layer's set
        kept = {}
        for t in self.tags:
            kept[self.keep[t]] = n * self.tag_bytes[t]
            kept[self.ckeep[t]] = n * self.small_bytes[t]
        # the layer inputs: off the device when offloaded, smaller when compressed
        kept |= {self.off_x: -n * x, self.cox: -n * x, self.cx: -n * (x - self.small_x)}
        # XLA:CPU: a kept (uncompressed) tag is not held again by the layer's backward pass
        layer_kept = kept | ({} if on_gpu else {self.keep[t]: (n - 1) * self.tag_bytes[t] for t in self.tags})
        # what the (de)quantization adds to the layer's working set (``dequantize_bytes``)
        for var in (self.cx, self.cox):
            layer_kept[var] += self.temp_x
        for t in self.tags:
            layer_kept[self.ckeep[t]] += self.temp[t]
            layer_kept[self.coff[t]] = layer_kept.get(self.coff[t], 0) + self.temp[t]
        room -= compiler_extras(workload, target=target)
        layer = layer_working_set(workload, target=target)
        head = head_branch(workload, target=target)
        # XLA:TPU: the chip's VMEM scratch holds up to its size of either working set, as in
        # ``predict``; taken off each branch alone, since max(0, w - s) of the larger is the
        # larger of the two (0 elsewhere). The part of the layer's set that the spec adds
        # (dequantization) keeps its full size: a row never below ``predict``.
        scratch = vmem_scratch(target)
        layer, head = layer - min(layer, scratch), head - min(head, scratch)
        # n*(x + K) + working - K + z <= room (XLA:GPU, XLA:TPU: + K), and n*(x + K) + head <= room
        self.constraint(layer_kept, -np.inf, room - n * x - layer)
        self.constraint(kept, -np.inf, room - n * x - head)
        return True

    def compress_cost(self, device: DevicePreset, elements: int, nbytes: int, small: int) -> float:
        """GFLOP a compressed value costs: its (de)quantization's FLOPs, and its traffic (read
        and written at full size and compressed, twice) as the FLOPs the device runs meanwhile."""
        moved = 2 * (nbytes + small) * device.flops / device.hbm_bandwidth
        return (COMPRESS_FLOPS * elements + moved) / 1e9

    def solve(self, device: DevicePreset) -> RematSpec | None:
        """The least-cost choice (``choose``) as a spec; None when infeasible."""
        chosen = self.choose(device)
        if chosen is None:
            return None
        compressed = {t for t in self.tags if chosen[self.ckeep[t]] or chosen[self.coff[t]]}
        if chosen[self.cx] or chosen[self.cox]:
            compressed.add(Tag.LAYER_INPUT)
        boundary = {Tag.LAYER_INPUT} if chosen[self.off_x] or chosen[self.cox] else set()
        return RematSpec(
            save={t for t in self.tags if chosen[self.keep[t]] or chosen[self.ckeep[t]]},
            offload={t for t in self.tags if chosen[self.off[t]] or chosen[self.coff[t]]} | boundary,
            compress=dict.fromkeys(compressed, self.fmt),
        )

    def choose(self, device: DevicePreset) -> "np.ndarray | None":
        """The least-cost choice (GFLOP: an offloaded byte costs what the device computes while
        it crosses twice, a compressed one its (de)quantization): the 0/1 value of each
        variable; None when infeasible."""
        cost = np.zeros(self.size)
        for op in self.ops:
            cost[self.run[op.name]] = op.flops / 1e9
        crossing = device.flops / device.host_bandwidth / 1e9  # GFLOP run while a byte crosses once
        for t in self.tags:
            squeeze = self.compress_cost(device, self.elements[t], self.tag_bytes[t], self.small_bytes[t])
            cost[self.off[t]] = 2 * self.tag_bytes[t] * crossing
            cost[self.keep[t]] = self.tag_bytes[t] * 1e-15  # among equal costs, keep fewer bytes
            cost[self.ckeep[t]] = squeeze + self.small_bytes[t] * 1e-15
            cost[self.coff[t]] = squeeze + 2 * self.small_bytes[t] * crossing
        squeeze_x = self.compress_cost(device, self.elements_x, self.x, self.small_x)
        cost[self.off_x] = 2 * self.x * crossing
        cost[self.cx] = squeeze_x
        cost[self.cox] = squeeze_x + 2 * self.small_x * crossing
        # Imported here: scipy.optimize is about a second of every `import jaxckpt` otherwise.
        from scipy.optimize import Bounds, LinearConstraint, milp

        result = milp(
            cost,
            constraints=LinearConstraint(np.array(self.rows), self.lo, self.hi),
            integrality=np.ones(self.size),
            bounds=Bounds(0, self.upper),
            options={"mip_rel_gap": 0.0},
        )
        if result.status != 0:
            return None
        return np.round(result.x).astype(int)
