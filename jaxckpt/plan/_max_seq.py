"""``max_seq``: the longest sequence a train step fits in a budget, and the plan that gets there.

"How long can my sequence be?" is answered in two stages:

1. a binary search on the analytic model (``predict``, no compile): at each length T the
   candidate plans are the remat specs that can fit (the exact MILP's cheapest spec, with
   offload allowed, and ``FALLBACK_PRESETS``), each with the MLP untiled or tiled
   (``mlp_chunk``), and T fits when one of them is predicted within the budgets (device,
   and host when given); the longest such T is kept, with the plan of least cost (recompute
   and host traffic, ``Choice.seconds``) among those that fit it;
2. a compiled confirmation near the edge: that plan's step is compiled for the target
   (``measure``: XLA:GPU or XLA:TPU without the device, else XLA:CPU) at that T, at a T
   moved by the measured over- or under-shoot, then bisected, within a few compiles.

The answer is one device's: with ``workload.devices`` the figures are per device under
FSDP, as everywhere in the planner.
"""

import dataclasses
from collections.abc import Sequence

from jaxckpt._sizes import format_bytes
from jaxckpt.plan._analytic import predict
from jaxckpt.plan._cost import choice
from jaxckpt.plan._devices import DEVICES, DevicePreset
from jaxckpt.plan._measure import CPU_CAVEAT, measure
from jaxckpt.plan._milp import solve
from jaxckpt.plan._specs import spec_dict, spec_name
from jaxckpt.plan._targets import Target, compile_target
from jaxckpt.plan._workload import Workload, require_workload
from jaxckpt.remat import PRESETS, RematSpec
from jaxckpt.remat import get as get_remat

FALLBACK_PRESETS = ("offload_full_save_attn", "offload_full", "full")
"""Presets tried beside the solver's spec at each length, those that exist in ``remat.PRESETS``:
what keeps least on the device (the layer boundaries in host memory, or only them on it)."""

DEFAULT_TILE = 4096
"""Tokens per MLP chunk tried when the workload's model does not set ``mlp_chunk``."""


@dataclasses.dataclass(frozen=True)
class SeqPlan:
    """One way to run a step at a length: the remat spec and the MLP tile (None: untiled).

    Example:
        >>> from jaxckpt import remat
        >>> SeqPlan(remat.get("full"), 4096).to_dict()["mlp_chunk"]
        4096
    """

    spec: RematSpec
    mlp_chunk: "int | None"

    def to_dict(self) -> dict:
        """The remat spec (its preset name when it is one, and its fields) and the tile."""
        return {"remat": spec_name(self.spec), "spec": spec_dict(self.spec), "mlp_chunk": self.mlp_chunk}


@dataclasses.dataclass(frozen=True)
class MaxSeqAnswer:
    """The longest T that fits, its plan, and the figures that say so.

    Attributes:
        max_seq: the longest tokens per sequence, confirmed by a compile (0: none fits).
        predicted_max_seq: the analytic model's longest T (before the compiled confirmation).
        plan: the plan at ``max_seq`` (None when nothing fits).
        predicted_bytes: the analytic device peak at ``max_seq``.
        measured_bytes: the compiler's device peak at ``max_seq``.
        host_bytes: host memory (``pinned_host``) the step needs at ``max_seq`` (predicted).
        usable_bytes: the budget less its headroom.
        measured_on: the compiler of ``measured_bytes`` (``MemoryReport.measured_on``).
        collective_bytes: what one device receives through collectives in a step at
            ``max_seq`` (``MemoryReport.collective_bytes``; None on one device).
        attempts: each compile: ``seq``, ``measured_bytes``, ``fits``.
        notes: what the user should know (a length past the model's ``max_len``).
        caveat: how far the compiler's figures carry.

    Example:
        >>> from jaxckpt import plan, remat
        >>> full = plan.SeqPlan(remat.get("full"), None)
        >>> answer = plan.MaxSeqAnswer(8192, 9216, full, 1, 2, 0, 3, "xla-cpu")
        >>> answer.to_dict()["plan"]["remat"], answer.max_seq
        ('full', 8192)
    """

    max_seq: int
    predicted_max_seq: int
    plan: "SeqPlan | None"
    predicted_bytes: int
    measured_bytes: int
    host_bytes: int
    usable_bytes: int
    measured_on: str
    attempts: tuple = ()
    collective_bytes: "int | None" = None
    notes: tuple = ()
    caveat: str = ""

    def to_dict(self) -> dict:
        """JSON-ready fields (``plan`` through ``SeqPlan.to_dict``)."""
        out = dataclasses.asdict(self)
        out["plan"] = None if self.plan is None else self.plan.to_dict()
        out["attempts"], out["notes"] = list(self.attempts), list(self.notes)
        return out


def at_length(workload: Workload, seq: int, mlp_chunk: "int | None" = None) -> Workload:
    """``workload`` at ``seq`` tokens per sequence with its MLP tiled by ``mlp_chunk``; the
    model's ``max_len`` is raised to ``seq`` where it is shorter (memory does not depend on it).

    Example:
        >>> from jaxckpt import nn, plan
        >>> w = plan.Workload(nn.TransformerConfig.preset("tiny"), batch=1, seq=64)
        >>> long = at_length(w, 4 * w.config.max_len, 256)
        >>> long.seq == long.config.max_len, long.config.mlp_chunk
        (True, 256)
    """
    config = workload.config.replace(max_len=max(seq, workload.config.max_len), mlp_chunk=mlp_chunk)
    return workload.replace(config=config, seq=seq)


def _plans(workload: Workload, specs, tiles) -> tuple:
    """The candidate specs (None: the solver's) and tiles, as ``max_seq`` documents them."""
    if specs is None:
        specs = (None, *(PRESETS[name] for name in FALLBACK_PRESETS if name in PRESETS))
    if tiles is None:
        tiles = (workload.config.mlp_chunk,) if workload.config.mlp_chunk else (None, DEFAULT_TILE)
    return tuple(get_remat(s) if s is not None else None for s in specs), tuple(tiles)


def _fitting(
    workload: Workload, seq: int, limits: tuple, device: DevicePreset, target, plans
) -> "tuple | None":
    """``(plan, prediction)`` of least cost predicted within the device and host ``limits`` at
    ``seq``, or None."""
    limit, host_limit = limits
    specs, tiles = plans
    best = None
    for tile in tiles:
        w = at_length(workload, seq, tile if tile is None or tile < seq else None)
        for spec in specs:
            if spec is None:  # the exact MILP's cheapest spec, offload allowed
                spec = solve(w, limit, device=device, offload=True, target=target)
                if spec is None:
                    continue
            c = choice(w, spec, target=target)
            if c.predicted.total > limit or (host_limit is not None and c.predicted.host > host_limit):
                continue
            cost = c.seconds(device)  # recompute and host traffic
            if best is None or cost < best[0]:
                best = (cost, SeqPlan(spec, w.config.mlp_chunk), c.predicted)
    return None if best is None else best[1:]


def _round(seq: int, multiple: int) -> int:
    return max(multiple, seq // multiple * multiple)


def _search(fits, multiple: int, limit_seq: int) -> int:
    """The largest multiple of ``multiple`` up to ``limit_seq`` for which ``fits`` holds (0:
    none), ``fits`` being monotone: doubling, then bisection."""
    lo, hi = 0, multiple
    while hi <= limit_seq and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, _round(limit_seq, multiple) + multiple)
    while hi - lo > multiple:
        mid = _round((lo + hi) // 2, multiple)
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def max_seq(
    workload: Workload,
    budget: int,
    *,
    device: "str | DevicePreset | None" = None,
    target: "str | Target | None" = None,
    headroom: float = 0.0,
    host_budget: "int | None" = None,
    specs: "Sequence[str | RematSpec | None] | None" = None,
    tiles: "Sequence[int | None] | None" = None,
    multiple: int = 1024,
    limit_seq: int = 2**24,
    compiles: int = 4,
) -> MaxSeqAnswer:
    """The longest tokens per sequence whose step fits ``budget``, searched on the analytic
    model and confirmed by compiling for ``target``.

    The analytic search keeps the longest T at which some candidate plan is predicted within
    the budgets, and the cheapest plan there. Then that plan is compiled: at that T, and at a
    T moved by the measured over- or under-shoot (the state is fixed, the rest grows with T),
    then bisected between the longest compiled fit and the shortest compiled miss, within
    ``compiles`` compiles. The answer is the longest T the compiler confirmed.

    Args:
        workload: the step; its ``seq`` is ignored (its batch, model, optimizer and devices
            are kept).
        budget: bytes per device.
        device: prices recompute and offload (default: the target's preset, else ``cpu``).
        target: the compiler of the confirmation (None: XLA:CPU), as for ``measure``.
        headroom: the fraction of ``budget`` kept free.
        host_budget: bytes of host memory (``pinned_host``) a plan may use; None: no limit.
        specs: the remat specs tried (names or ``RematSpec``; None in the list: the exact
            MILP's cheapest spec with offload allowed). Default: the solver's and
            ``FALLBACK_PRESETS``.
        tiles: the MLP tiles tried (None in the list: untiled). Default: the model's
            ``mlp_chunk`` when it has one, else untiled and ``DEFAULT_TILE``.
        multiple: T is a multiple of this.
        limit_seq: the longest T searched.
        compiles: at most this many compiles confirm the answer.

    Returns:
        A ``MaxSeqAnswer``; its ``max_seq`` is 0 when not even ``multiple`` tokens fit.

    Raises:
        ValueError: for a ``multiple`` or ``compiles`` under 1.

    Example:
        >>> from jaxckpt import nn, plan
        >>> w = plan.Workload(nn.TransformerConfig.preset("tiny", n_layers=1), batch=1, seq=64)
        >>> answer = plan.max_seq(w, 48 * 2**20, specs=["full"], tiles=[None], multiple=256, compiles=2)
        >>> answer.max_seq > 0 and answer.measured_bytes <= answer.usable_bytes
        True
    """
    require_workload(workload, "max_seq")
    if multiple < 1 or compiles < 1:
        raise ValueError(f"max_seq: multiple={multiple} and compiles={compiles} must be >= 1")
    if multiple % (2 * workload.seq_shards):
        raise ValueError(
            f"max_seq: multiple={multiple} must be a multiple of 2 x seq_shards={workload.seq_shards}"
        )
    name = target if isinstance(target, str) else getattr(target, "name", None)
    if isinstance(device, str) or device is None:
        device = DEVICES.get(device or name or "cpu", DEVICES["cpu"])
    limit = int(budget * (1 - headroom))
    plans, found = _plans(workload, specs, tiles), {}

    def fits(seq: int) -> bool:
        found[seq] = _fitting(workload, seq, (limit, host_budget), device, target, plans)
        return found[seq] is not None

    predicted_seq = _search(fits, multiple, limit_seq)
    caveat = CPU_CAVEAT if target is None else compile_target(target).caveat
    if not predicted_seq:
        notes = (f"not even {multiple} tokens fit",)
        return MaxSeqAnswer(0, 0, None, 0, 0, 0, limit, "", notes=notes, caveat=caveat)
    plan, prediction = found[predicted_seq]
    fixed = prediction.params + prediction.grads + prediction.optimizer  # what T does not change
    attempts, seq, best, miss = [], predicted_seq, None, None
    while len(attempts) < compiles and seq not in {a["seq"] for a in attempts}:
        measured = measure(at_length(workload, seq, plan.mlp_chunk), plan.spec, target=target)
        fits_here = measured.peak <= limit
        attempts.append({"seq": seq, "measured_bytes": int(measured.peak), "fits": fits_here})
        if fits_here:
            best = (seq, measured)
        else:
            miss = seq if miss is None else min(miss, seq)
        low = best[0] if best else 0
        if miss is not None and best is not None:
            seq = _round((low + miss) // 2, multiple)
        else:  # move by the measured over- or under-shoot, the state fixed
            scale = (limit - fixed) / max(1, measured.peak - fixed)
            seq = _round(int(seq * scale * (0.99 if fits_here else 0.98)), multiple)
            seq = min(seq, miss - multiple) if miss is not None else seq
        if (miss is not None and miss - low <= multiple) or seq <= low:
            break
    if best is None:
        notes = (f"no length confirmed by the compiler in {len(attempts)} compiles",)
        on = measured.measured_on
        return MaxSeqAnswer(0, predicted_seq, None, 0, 0, 0, limit, on, tuple(attempts), None, notes, caveat)
    seq, measured = best
    prediction = predict(at_length(workload, seq, plan.mlp_chunk), plan.spec, target=target)
    notes = []
    if seq > workload.config.max_len:
        notes.append(
            f"{seq} tokens is past the model's max_len {workload.config.max_len}: train it with its "
            "context extended (RoPE scaling)"
        )
    return MaxSeqAnswer(
        seq, predicted_seq, plan, int(prediction.total), int(measured.peak), int(prediction.host),
        limit, measured.measured_on, tuple(attempts), measured.collective_bytes, tuple(notes), caveat,
    )  # fmt: skip


def describe_max_seq(answer: MaxSeqAnswer) -> str:
    """One line per figure of ``answer``, for the command line.

    Example:
        >>> print(describe_max_seq(MaxSeqAnswer(0, 0, None, 0, 0, 0, 2**30, "")))
        nothing fits 1.00 GiB
    """
    if answer.plan is None:
        return f"nothing fits {format_bytes(answer.usable_bytes)}" + "".join(f"; {n}" for n in answer.notes)
    plan = answer.plan.to_dict()
    tile = f"MLP tiled by {plan['mlp_chunk']} tokens" if plan["mlp_chunk"] else "MLP untiled"
    size = format_bytes
    compiled = ", ".join(f"T={a['seq']} {size(a['measured_bytes'])}" for a in answer.attempts)
    lines = [
        f"longest sequence: {answer.max_seq} tokens (analytic search: {answer.predicted_max_seq})",
        f"plan: remat {plan['remat']}, {tile}",
        f"device: predicted {size(answer.predicted_bytes)}, measured {size(answer.measured_bytes)} "
        f"({answer.measured_on}) of {size(answer.usable_bytes)}; host: {size(answer.host_bytes)}",
        f"compiles: {compiled}",
    ]
    if answer.collective_bytes is not None:
        lines.append(f"communication: {size(answer.collective_bytes)} per device per step")
    return "\n".join(lines + list(answer.notes))
