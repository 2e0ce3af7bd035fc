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
"""

from collections.abc import Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from jaxckpt.plan._analytic import head_working_set, layer_working_set, predict
from jaxckpt.plan._devices import DEVICES, DevicePreset
from jaxckpt.plan._layer_graph import LayerGraph, layer_graph
from jaxckpt.plan._state import update_workspace
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
) -> RematSpec | None:
    """The per-layer spec of least cost whose predicted peak is within ``budget`` (exact MILP).

    Args:
        workload: the step; over ``workload.devices`` ``budget`` is per device.
        budget: bytes (per device).
        device: prices recompute (its matmul rate) and offload (its host link).
        offload: allow offloading tags to host memory.
        tags: restrict the decision to these tags (the others are recomputed).
        exclude: specs not to return (each a no-good cut on the choice variables).

    Returns:
        The spec, or None when no spec's prediction fits.

    Example:
        >>> from jaxckpt import nn, plan
        >>> w = plan.Workload(nn.TransformerConfig.preset("tiny"), batch=2, seq=64)
        >>> spec = plan.solve(w, plan.predict(w, "save_attn").total)
        >>> plan.predict(w, spec).total <= plan.predict(w, "save_attn").total
        True
    """
    base = predict(workload, RematSpec())
    config = workload.config
    graph = layer_graph(workload)
    tags = [t for t in (tags if tags is not None else _tunable(graph)) if t != Tag.LAYER_INPUT]
    ops = list(graph.ops)
    nt, no = len(tags), len(ops)
    # variables: keep_t (nt), off_t (nt), run_o (no)
    nv = 2 * nt + no
    keep = {t: i for i, t in enumerate(tags)}
    off = {t: nt + i for i, t in enumerate(tags)}
    run = {op.name: 2 * nt + i for i, op in enumerate(ops)}
    rows, lo, hi = [], [], []

    def constraint(coefs: dict[int, float], low: float, high: float) -> None:
        row = np.zeros(nv)
        for index, c in coefs.items():
            row[index] += c
        rows.append(row)
        lo.append(low)
        hi.append(high)

    def saved(value: str) -> dict[int, float]:
        tag = graph.values[value].tag  # the layer input's tag is not a decision: always kept
        return {keep[tag]: 1.0, off[tag]: 1.0} if tag in keep else {}

    for t in tags:
        constraint({keep[t]: 1, off[t]: 1}, -np.inf, 1)
        if not offload:
            constraint({off[t]: 1}, 0, 0)
    for value in graph.reads:
        if value == "x":
            continue
        producer = run[graph.producer(value).name]
        constraint({producer: 1, **saved(value)}, 1, np.inf)  # run + keep + off >= 1
    for op in ops:
        for value in op.inputs:
            if value == "x":
                continue
            producer = run[graph.producer(value).name]
            coefs = {producer: 1.0, run[op.name]: -1.0}
            for index, c in saved(value).items():
                coefs[index] = coefs.get(index, 0) + c
            constraint(coefs, 0, np.inf)  # run_p + keep + off >= run_o
    for spec in exclude:  # differ from spec in at least one choice
        coefs: dict[int, float] = {}
        flips = 0
        for t in tags:
            for var, chosen in ((keep[t], t in spec.save), (off[t], t in spec.offload)):
                coefs[var] = -1.0 if chosen else 1.0
                flips += chosen
        constraint(coefs, 1 - flips, np.inf)
    # bytes: a tag's values, counted once per layer; kept tags shrink the working set too
    tag_bytes = {t: sum(v.nbytes for v in graph.values.values() if v.tag == t) for t in tags}
    fixed = base.params + base.grads + base.optimizer + base.inputs
    x = graph.values["x"].nbytes
    working = layer_working_set(workload)
    head = head_working_set(workload)
    n = config.n_layers
    room = budget - fixed
    if room < update_workspace(workload):  # the optimizer update alone does not fit
        return None
    # n*(x + K) + working - K <= room, and n*(x + K) + head <= room
    constraint({keep[t]: (n - 1) * tag_bytes[t] for t in tags}, -np.inf, room - n * x - working)
    constraint({keep[t]: n * tag_bytes[t] for t in tags}, -np.inf, room - n * x - head)
    # cost in GFLOP: an offloaded byte costs what the device computes while it crosses twice
    cost = np.zeros(nv)
    for op in ops:
        cost[run[op.name]] = op.flops / 1e9
    for t in tags:
        cost[off[t]] = 2 * tag_bytes[t] * device.flops / device.host_bandwidth / 1e9
        cost[keep[t]] = tag_bytes[t] * 1e-15  # among equal costs, keep fewer bytes
    result = milp(
        cost,
        constraints=LinearConstraint(np.array(rows), lo, hi),
        integrality=np.ones(nv),
        bounds=Bounds(0, 1),
        options={"mip_rel_gap": 0.0},
    )
    if result.status != 0:
        return None
    chosen = np.round(result.x).astype(int)
    return RematSpec(
        save={t for t in tags if chosen[keep[t]]},
        offload={t for t in tags if chosen[off[t]]},
    )
