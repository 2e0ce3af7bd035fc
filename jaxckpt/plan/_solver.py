"""``plan_memory``: the cheapest remat spec under a memory budget, checked by the compiler.

The choice per tag is save, offload or recompute. The cost is the recompute FLOPs
(in seconds at the device's matmul rate) plus the offload traffic (at its host
bandwidth); the constraint is the analytic peak (``predict``) within the budget.
Both are linear in the choices once the recomputed ops are variables too, so the
problem is a small mixed-integer program, solved exactly with ``scipy.optimize.milp``:

* ``keep_t + off_t <= 1`` for each tag t;
* ``run_o >= 1 - keep(v) - off(v)`` for each value v the backward pass reads, o its producer;
* ``run_p >= run_o - keep(i) - off(i)`` for each input i of each op o, p the producer of i;
* every branch of the ``max`` in the activation model below the budget.

The chosen spec is then compiled (``measure``). When XLA needs more than the budget,
a no-good cut excludes it and the next cheapest spec is solved for, so the plan is the
cheapest spec that XLA confirms; only after several misses is the solver's budget
lowered by the overshoot. A spec is only returned once its measured peak fits.
"""

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from jaxckpt._checks import require_positive_int
from jaxckpt._sizes import format_bytes
from jaxckpt.nn import TransformerConfig
from jaxckpt.plan._analytic import (
    Prediction,
    head_working_set,
    layer_working_set,
    predict,
    saved_tags,
    state_bytes,
    update_workspace,
)
from jaxckpt.plan._devices import DEVICES, DevicePreset
from jaxckpt.plan._layer_graph import LayerGraph, layer_graph
from jaxckpt.plan._measure import measure
from jaxckpt.remat import PRESETS, RematSpec, Tag
from jaxckpt.remat import get as get_remat
from jaxckpt.train import MemoryReport

MAX_ATTEMPTS = 10
"""Specs compiled at most before falling back to full remat."""
PREDICTION_MARGIN = 0.05
"""Specs predicted up to this fraction over the budget are compiled: they may fit."""
CUTS_BEFORE_TIGHTENING = 6
"""Misses after which the solver's budget is lowered by the overshoot."""


class BudgetError(ValueError):
    """No remat spec fits the budget. ``minimum_bytes`` is the smallest peak measured."""

    def __init__(self, message: str, minimum_bytes: int):
        super().__init__(message)
        self.minimum_bytes = minimum_bytes


@dataclasses.dataclass(frozen=True)
class Choice:
    """One remat spec with its predicted bytes and its costs per train step."""

    spec: RematSpec
    predicted: Prediction
    recompute_flops: int
    transfer_bytes: int

    def seconds(self, device: DevicePreset) -> float:
        """Recompute time at the device's matmul rate plus offload traffic at its host bandwidth."""
        return self.recompute_flops / device.flops + self.transfer_bytes / device.host_bandwidth


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The answer of ``plan_memory``.

    Attributes:
        spec: the chosen ``RematSpec``; ``remat`` names it (a preset name or ``"solved"``).
        budget: bytes allowed. predicted: the analytic figures of ``spec``.
        measured: XLA's figures for ``spec`` (``measured.peak <= budget``).
        recompute_flops: forward FLOPs the backward pass repeats, per step.
        step_flops: FLOPs of one step without remat (forward + backward).
        minimum_bytes: the predicted peak of ``full`` remat (the least of the per-layer specs).
        attempts: every ``(spec, predicted, measured)`` compiled on the way.
    """

    spec: RematSpec
    remat: str
    budget: int
    predicted: Prediction
    measured: MemoryReport
    recompute_flops: int
    step_flops: int
    minimum_bytes: int
    attempts: tuple

    @property
    def recompute_fraction(self) -> float:
        """Extra recompute as a fraction of the step's FLOPs."""
        return self.recompute_flops / self.step_flops

    def to_dict(self) -> dict:
        return {
            "remat": self.remat,
            "spec": spec_dict(self.spec),
            "predicted_bytes": self.predicted.total,
            "measured_bytes": self.measured.peak,
            "recompute_flops": self.recompute_flops,
        }


def spec_dict(spec: RematSpec) -> dict:
    """A ``RematSpec`` as JSON-ready lists."""
    return {
        "save": sorted(spec.save),
        "offload": sorted(spec.offload),
        "layers_per_checkpoint": spec.layers_per_checkpoint,
        "save_dots": spec.save_dots,
        "enabled": spec.enabled,
    }


def spec_name(spec: RematSpec) -> str:
    """The preset name of ``spec``, or ``"solved"``."""
    return next((name for name, preset in PRESETS.items() if preset == spec), "solved")


def step_flops(config: TransformerConfig, batch: int, seq: int, micro_batches: int = 1) -> int:
    """FLOPs of one train step without remat: forward + backward (twice the forward)."""
    graph = layer_graph(config, batch, seq)
    head = 2 * batch * seq * config.d_model * config.vocab_size
    return 3 * micro_batches * (config.n_layers * graph.forward_flops() + head)


def choice(
    config: TransformerConfig,
    batch: int,
    seq: int,
    remat: "str | RematSpec",
    *,
    optimizer: str = "adamw",
    micro_batches: int = 1,
) -> Choice:
    """``remat`` with its prediction and per-step recompute FLOPs and offload bytes.

    ``layers_per_checkpoint = k`` recomputes each layer twice except the last of a segment.
    """
    spec = get_remat(remat)
    graph = layer_graph(config, batch, seq)
    pred = predict(config, batch, seq, spec, optimizer=optimizer, micro_batches=micro_batches)
    if not spec.enabled:
        return Choice(spec, pred, 0, 0)
    tags = saved_tags(spec)
    per_layer = graph.recompute_flops(tags)
    k = min(spec.layers_per_checkpoint, config.n_layers)
    extra = graph.forward_flops() * (k - 1) / k if k > 1 else 0  # the segment's re-forward
    offloaded = graph.stored_bytes(tags) - graph.stored_bytes(tags - spec.offload)
    return Choice(
        spec,
        pred,
        int(micro_batches * config.n_layers * (per_layer + extra)),
        2 * micro_batches * config.n_layers * offloaded,
    )


def _tunable(graph: LayerGraph) -> list[Tag]:
    """The tags worth deciding: carried by a value the backward pass or a recompute can read
    (not the layer input, which is always kept; not ``mlp_down``, which nothing reads)."""
    readable = graph.reads | {name for op in graph.ops for name in op.inputs}
    return sorted({graph.values[name].tag for name in readable} - {None, Tag.LAYER_INPUT})


def solve(
    config: TransformerConfig,
    batch: int,
    seq: int,
    budget: int,
    *,
    optimizer: str = "adamw",
    micro_batches: int = 1,
    device: DevicePreset = DEVICES["cpu"],
    offload: bool = False,
    tags: "list[Tag] | None" = None,
    exclude: "Sequence[RematSpec]" = (),
) -> RematSpec | None:
    """The per-layer spec of least cost whose predicted peak is within ``budget`` (exact MILP).

    Args:
        tags: restrict the decision to these tags (the others are recomputed).
        offload: allow offloading tags to host memory.
        exclude: specs not to return (each a no-good cut on the choice variables).

    Returns:
        The spec, or None when no spec's prediction fits.
    """
    graph = layer_graph(config, batch, seq)
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
    base = predict(config, batch, seq, RematSpec(), optimizer=optimizer, micro_batches=micro_batches)
    fixed = base.params + base.grads + base.optimizer + base.inputs
    x = graph.values["x"].nbytes
    working = layer_working_set(config, batch, seq)
    head = head_working_set(config, batch, seq)
    n = config.n_layers
    room = budget - fixed
    if room < update_workspace(config, optimizer):  # the optimizer update alone does not fit
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


def plan_memory(
    config: TransformerConfig,
    batch: int,
    seq: int,
    budget: int,
    *,
    devices: int = 1,
    headroom: float = 0.0,
    optimizer: str = "adamw",
    micro_batches: int = 1,
    device: "str | DevicePreset" = "cpu",
    offload: bool = False,
) -> MemoryPlan:
    """The remat spec of least recompute whose compiled peak fits ``budget`` bytes.

    No remat at all is taken when it fits. Otherwise the MILP (``solve``) picks the
    tags to save (and, with ``offload``, to offload); the spec is compiled and
    measured, and while XLA needs more than the budget the solver's budget is lowered
    by the overshoot. As the budget grows the recompute never rises: a larger budget
    admits every spec a smaller one does.

    Args:
        config: the model. batch, seq, micro_batches: the step's input.
        budget: bytes per device. headroom: the fraction of ``budget`` kept free.
        devices: 1 (FSDP planning arrives with sharded training).
        optimizer: a key of ``OPTIMIZERS``. device: a ``DEVICES`` name (prices recompute
            and offload). offload: allow host offload (needs ``pinned_host`` to measure).

    Returns:
        A ``MemoryPlan`` whose ``measured.peak <= budget * (1 - headroom)``.

    Raises:
        BudgetError: when nothing fits; it gives the minimum peak and what would fit.
        NotImplementedError: for ``devices > 1``.

    Example:
        >>> from jaxckpt import nn, plan
        >>> cfg = nn.TransformerConfig.preset("tiny", n_layers=2)
        >>> p = plan.plan_memory(cfg, 2, 128, budget=20 * 2**20)
        >>> p.measured.peak <= 20 * 2**20
        True
    """
    if devices != 1:
        raise NotImplementedError(
            f"devices={devices}: per-device (FSDP) planning is not implemented yet; plan for one device"
        )
    for name, value in (("batch", batch), ("seq", seq), ("micro_batches", micro_batches), ("budget", budget)):
        require_positive_int(name, value, "plan_memory: ")
    if not 0.0 <= headroom < 1.0:
        raise ValueError(f"plan_memory: headroom must be in [0, 1), got {headroom!r}")
    device = DEVICES[device] if isinstance(device, str) else device
    limit = int(budget * (1 - headroom))
    size = dict(optimizer=optimizer, micro_batches=micro_batches)
    attempts = []

    def try_spec(spec: RematSpec) -> MemoryReport:
        done = next((m for s, _, m in attempts if s == spec), None)
        if done is not None:
            return done
        measured = measure(config, batch, seq, spec, **size)
        attempts.append((spec, choice(config, batch, seq, spec, **size).predicted, measured))
        return measured

    def found(spec: RematSpec) -> MemoryPlan:
        c = choice(config, batch, seq, spec, **size)
        return _plan(config, batch, seq, budget, c, try_spec(spec), minimum, attempts, micro_batches)

    solve_ = lambda target, excluded: solve(
        config, batch, seq, target, device=device, offload=offload, exclude=excluded, **size
    )
    minimum = choice(config, batch, seq, "full", **size).predicted.total
    # The prediction is within a few % of XLA, either way: a spec predicted slightly over
    # the limit may fit, so the search starts optimistic and lets the compiler decide.
    target = int(limit * (1 + PREDICTION_MARGIN))
    none = choice(config, batch, seq, "none", **size)
    if none.predicted.total <= target and try_spec(none.spec).peak <= limit:
        return found(none.spec)  # no recompute at all
    excluded: list[RematSpec] = []
    for _ in range(MAX_ATTEMPTS):
        spec = solve_(target, excluded)
        if spec is None:
            break
        measured = try_spec(spec)
        if measured.peak <= limit:
            return found(spec)
        # The next cheapest spec is tried (a no-good cut): the plan stays the cheapest
        # that fits. After a few misses the prediction is evidently low: ask for less.
        excluded.append(spec)
        if len(excluded) >= CUTS_BEFORE_TIGHTENING:
            predicted = choice(config, batch, seq, spec, **size).predicted.total
            target = min(target, predicted) - (measured.peak - limit)
    # the prediction may be above what XLA needs: full remat settles it
    if try_spec(PRESETS["full"]).peak <= limit:
        return found(PRESETS["full"])
    smallest = try_spec(PRESETS["full"]).peak
    raise BudgetError(_infeasible_message(config, batch, seq, limit, smallest, size), smallest)


def _plan(config, batch, seq, budget, c: Choice, measured, minimum, attempts, micro_batches) -> MemoryPlan:
    return MemoryPlan(
        spec=c.spec,
        remat=spec_name(c.spec),
        budget=budget,
        predicted=c.predicted,
        measured=measured,
        recompute_flops=c.recompute_flops,
        step_flops=step_flops(config, batch, seq, micro_batches),
        minimum_bytes=minimum,
        attempts=tuple(attempts),
    )


def _infeasible_message(config, batch, seq, limit, smallest, size) -> str:
    """What would fit instead: micro-batches, a shorter sequence, another optimizer, more devices."""
    full = lambda b=batch, t=seq, **kw: predict(config, b, t, "full", **{**size, **kw}).total
    hints = []
    for m in (2, 4, 8, 16, 32):
        if batch % m == 0 and full(batch // m, micro_batches=m * size["micro_batches"]) <= limit:
            hints.append(
                f"--batch {batch // m} --micro-batches {m * size['micro_batches']} (same tokens per step)"
            )
            break
    for t in (seq // 2, seq // 4, seq // 8):
        if t >= 1 and full(t) <= limit:
            hints.append(f"--seq {t}")
            break
    for opt in ("adafactor", "sgd"):
        if opt != size["optimizer"] and full(optimizer=opt) <= limit:
            hints.append(f"--optimizer {opt}")
            break
    params, opt_bytes = state_bytes(config, size["optimizer"])
    # FSDP shards the state (params, gradients, optimizer) and the update, not the activations
    sharded = 2 * params + opt_bytes + update_workspace(config, size["optimizer"])
    unsharded = full(optimizer="sgd") - 2 * params  # SGD: no state, no update workspace
    shards = math.ceil(sharded / (limit - unsharded)) if unsharded < limit else None
    if shards and shards > 1:
        hints.append(f"about {shards} devices with FSDP (sharded training is not implemented yet)")
    hint = "; ".join(hints) if hints else "a larger device"
    return (
        f"no remat spec fits {format_bytes(limit)}: the smallest peak is {format_bytes(smallest)} "
        f"(params {format_bytes(params)}, gradients {format_bytes(params)}, optimizer "
        f"{format_bytes(opt_bytes)} before any activation). What would fit: {hint}"
    )
