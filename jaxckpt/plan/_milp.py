"""``solve``: the cheapest per-layer remat spec whose predicted peak fits a budget.

The choice per tag is save, offload or recompute. The cost is the recompute FLOPs
plus the offload traffic (priced at the device's host bandwidth); the constraint is
the analytic peak (``predict``) within the budget. Both are linear in the choices once
the recomputed ops are variables too, so the problem is a small mixed-integer program,
solved exactly with ``scipy.optimize.milp``:

* ``keep_t + off_t <= 1`` for each tag t;
* ``run_o >= 1 - keep(v) - off(v)`` for each value v the backward pass reads, o its producer;
* ``run_p >= run_o - keep(i) - off(i)`` for each input i of each op o, p the producer of i;
* every branch of the ``max`` in the activation model below the budget.

The layer input (the remat boundary) is always kept; with ``offload`` one more variable,
``off_x``, moves every layer's boundary to host memory (``offload_full``): ``n x`` bytes
off every budget row, two crossings of the host link a layer in the cost.
"""

from collections.abc import Sequence

import numpy as np

from jaxckpt.plan._analytic import predict
from jaxckpt.plan._compilers import live_temp, on_tpu
from jaxckpt.plan._devices import DEVICES, DevicePreset
from jaxckpt.plan._layer_graph import LayerGraph, layer_graph
from jaxckpt.plan._state import update_workspace
from jaxckpt.plan._targets import Target
from jaxckpt.plan._working_set import compiler_extras, head_branch, layer_working_set
from jaxckpt.plan._workload import Workload
from jaxckpt.remat import RematSpec, Tag


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
) -> RematSpec | None:
    """The per-layer spec of least cost whose predicted peak is within ``budget`` (exact MILP).

    Args:
        workload: the step; over ``workload.devices`` ``budget`` is per device.
        budget: bytes (per device).
        device: prices recompute (its matmul rate) and offload (its host link).
        offload: allow offloading tags to host memory, and the layer inputs themselves
            (the remat boundaries, ``Tag.LAYER_INPUT``: ``offload_full``).
        tags: restrict the decision to these tags (the others are recomputed; the layer
            inputs are kept on the device unless ``Tag.LAYER_INPUT`` is among them).
        exclude: specs not to return (each a no-good cut on the choice variables).
        target: the compiler the peak is predicted for (``predict(target=)``): None for
            XLA:CPU, a GPU target name for XLA:GPU.

    Returns:
        The spec, or None when no spec's prediction fits.

    Example:
        >>> from jaxckpt import nn, plan
        >>> w = plan.Workload(nn.TransformerConfig.preset("tiny"), batch=2, seq=64)
        >>> spec = plan.solve(w, plan.predict(w, "save_attn").total)
        >>> plan.predict(w, spec).total <= plan.predict(w, "save_attn").total
        True
    """
    graph = layer_graph(workload, target=target)
    boundary = offload and (tags is None or Tag.LAYER_INPUT in tags)  # off_x: offload_full's choice
    tags = [t for t in (tags if tags is not None else _tunable(graph)) if t != Tag.LAYER_INPUT]
    program = _Program(graph, tags)
    program.add_recompute_rules(offload, boundary)
    program.add_exclusions(exclude)
    if not program.add_budget(workload, budget, target):
        return None
    return program.solve(device)


class _Program:
    """The MILP's variables and rows: ``keep_t``, ``off_t`` per tag, then ``run_o`` per op,
    then ``off_x`` (the layer inputs in host memory)."""

    def __init__(self, graph: LayerGraph, tags: list[Tag]):
        self.graph, self.tags, self.ops = graph, tags, list(graph.ops)
        nt = len(tags)
        self.size = 2 * nt + len(self.ops) + 1
        self.keep = {t: i for i, t in enumerate(tags)}
        self.off = {t: nt + i for i, t in enumerate(tags)}
        self.run = {op.name: 2 * nt + i for i, op in enumerate(self.ops)}
        self.off_x = self.size - 1
        self.rows, self.lo, self.hi = [], [], []
        # bytes: a tag's values, counted once per layer
        self.tag_bytes = {t: sum(v.nbytes for v in graph.values.values() if v.tag == t) for t in tags}

    def constraint(self, coefs: dict[int, float], low: float, high: float) -> None:
        """``low <= sum(c * var) <= high``."""
        row = np.zeros(self.size)
        for index, c in coefs.items():
            row[index] += c
        self.rows.append(row)
        self.lo.append(low)
        self.hi.append(high)

    def saved(self, value: str) -> dict[int, float]:
        """``keep + off`` of the tag ``value`` carries (the layer input is not a decision: kept)."""
        tag = self.graph.values[value].tag
        return {self.keep[tag]: 1.0, self.off[tag]: 1.0} if tag in self.keep else {}

    def add_recompute_rules(self, offload: bool, boundary: bool) -> None:
        """A tag is kept or offloaded at most once; what the backward pass reads is saved or rerun;
        the layer inputs go to host memory only when ``boundary``."""
        graph, run = self.graph, self.run
        if not boundary:
            self.constraint({self.off_x: 1}, 0, 0)
        for t in self.tags:
            self.constraint({self.keep[t]: 1, self.off[t]: 1}, -np.inf, 1)
            if not offload:
                self.constraint({self.off[t]: 1}, 0, 0)
        for value in graph.reads:
            if value == "x":
                continue
            producer = run[graph.producer(value).name]
            self.constraint({producer: 1, **self.saved(value)}, 1, np.inf)  # run + keep + off >= 1
        for op in self.ops:
            for value in op.inputs:
                if value == "x":
                    continue
                coefs = {run[graph.producer(value).name]: 1.0, run[op.name]: -1.0}
                for index, c in self.saved(value).items():
                    coefs[index] = coefs.get(index, 0) + c
                self.constraint(coefs, 0, np.inf)  # run_p + keep + off >= run_o

    def add_exclusions(self, exclude: "Sequence[RematSpec]") -> None:
        """No-good cuts: differ from each excluded spec in at least one choice."""
        for spec in exclude:
            coefs: dict[int, float] = {}
            flips = 0
            choices = [(self.off_x, spec.offloads_boundary)]
            for t in self.tags:
                choices += [(self.keep[t], t in spec.save), (self.off[t], t in spec.offload)]
            for var, chosen in choices:
                coefs[var] = -1.0 if chosen else 1.0
                flips += chosen
            self.constraint(coefs, 1 - flips, np.inf)

    def add_budget(self, workload: Workload, budget: int, target) -> bool:
        """Every branch of the activation model's ``max`` within ``budget``; False when even the
        optimizer update does not fit. On XLA:CPU kept tags shrink the layer's working set too
        (not held twice); XLA:GPU and XLA:TPU slice them out of their stacks as copies, and
        XLA:GPU adds its GEMM workspace and FSDP's transposed shards (``predict``). On
        XLA:TPU the state is counted as it allocates it (tiles padded) and the temporaries
        (activations and gradients) as their allocation, which ``hbm_temp`` scales from the
        live bytes the rows bound: the room is turned back into live bytes (``live_temp``)."""
        base = predict(workload, RematSpec(), target=target)
        fixed = base.params + base.optimizer + base.inputs
        temps = budget - fixed  # XLA:TPU: an allocation, of which the live bytes are less
        room = (live_temp(temps, target) if on_tpu(target) else temps) - base.grads
        if room < update_workspace(workload):
            return False
        n, x = workload.config.n_layers, self.graph.values["x"].nbytes
        kept = lambda per_tag: {self.keep[t]: per_tag * self.tag_bytes[t] for t in self.tags}
        on_gpu = target is not None  # XLA:GPU or XLA:TPU: kept tags do not shrink the layer's set
        room -= compiler_extras(workload, target=target)
        layer = layer_working_set(workload, target=target)
        head = head_branch(workload, target=target)
        # n*(x + K) + working - K <= room (XLA:GPU, XLA:TPU: + K), and n*(x + K) + head <= room,
        # the n*x of the layer inputs off the device when they are offloaded (off_x)
        self.constraint(kept(n if on_gpu else n - 1) | {self.off_x: -n * x}, -np.inf, room - n * x - layer)
        self.constraint(kept(n) | {self.off_x: -n * x}, -np.inf, room - n * x - head)
        return True

    def solve(self, device: DevicePreset) -> RematSpec | None:
        """The least-cost choice (GFLOP: an offloaded byte costs what the device computes while
        it crosses twice), as a spec; None when infeasible."""
        cost = np.zeros(self.size)
        for op in self.ops:
            cost[self.run[op.name]] = op.flops / 1e9
        crossing = device.flops / device.host_bandwidth / 1e9  # GFLOP run while a byte crosses once
        for t in self.tags:
            cost[self.off[t]] = 2 * self.tag_bytes[t] * crossing
            cost[self.keep[t]] = self.tag_bytes[t] * 1e-15  # among equal costs, keep fewer bytes
        cost[self.off_x] = 2 * self.graph.values["x"].nbytes * crossing
        # Imported here: scipy.optimize is about a second of every `import jaxckpt` otherwise.
        from scipy.optimize import Bounds, LinearConstraint, milp

        result = milp(
            cost,
            constraints=LinearConstraint(np.array(self.rows), self.lo, self.hi),
            integrality=np.ones(self.size),
            bounds=Bounds(0, 1),
            options={"mip_rel_gap": 0.0},
        )
        if result.status != 0:
            return None
        chosen = np.round(result.x).astype(int)
        boundary = {Tag.LAYER_INPUT} if chosen[self.off_x] else set()
        return RematSpec(
            save={t for t in self.tags if chosen[self.keep[t]]},
            offload={t for t in self.tags if chosen[self.off[t]]} | boundary,
        )
