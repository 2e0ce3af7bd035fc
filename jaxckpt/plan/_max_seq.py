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

With ``compress=`` (``int8`` / ``fp8``) every candidate keeps what it keeps compressed
(``compress_spec``, as ``plan_memory(compress=)`` and ``jaxckpt train --compress`` do;
``compress_tags=``: only those tags), and the compiled confirmation compiles that compressed
spec; with ``allow_compress=True`` the solver's candidate may compress what it chooses.

The answer is one device's: with ``workload.devices`` the figures are per device under
FSDP, as everywhere in the planner.
"""

import dataclasses
from collections.abc import Collection, Sequence

from jaxckpt._sizes import format_bytes
from jaxckpt.plan._analytic import predict
from jaxckpt.plan._compression import compress_spec
from jaxckpt.plan._cost import choice
from jaxckpt.plan._devices import DEVICES, DevicePreset
from jaxckpt.plan._measure import CPU_CAVEAT, measure
from jaxckpt.plan._milp import solve
from jaxckpt.plan._specs import spec_dict, spec_name
from jaxckpt.plan._targets import Target, compile_target
from jaxckpt.plan._workload import Workload, require_workload
from jaxckpt.remat import FORMATS, PRESETS, RematSpec, Tag
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


@dataclasses.dataclass(frozen=True)
class _Compression:
    """What ``max_seq``'s candidates store compressed: with ``fmt`` every spec's kept ``tags``
    (None: all that can be), as ``plan_memory(compress=)``; with ``allow`` the solver may choose."""

    fmt: "str | None" = None
    tags: "frozenset[Tag] | None" = None
    allow: bool = False

    @classmethod
    def of(cls, compress, compress_tags, allow_compress) -> "_Compression":
        if compress is not None and compress not in FORMATS:
            raise ValueError(f"max_seq: compress={compress!r} must be one of {', '.join(FORMATS)} or None")
        if compress_tags is not None and compress is None:
            raise ValueError("max_seq: compress_tags= needs compress= (the format: int8 or fp8)")
        if not isinstance(allow_compress, bool):
            raise ValueError(f"max_seq: allow_compress={allow_compress!r} must be True or False")
        tags = None
        if compress_tags is not None:
            valid = {str(t) for t in Tag}
            unknown = sorted(str(t) for t in compress_tags if str(t) not in valid)
            if unknown:
                names = ", ".join(sorted(valid))
                raise ValueError(f"max_seq: compress_tags names {unknown}, no tags; valid tags: {names}")
            tags = frozenset(Tag(str(t)) for t in compress_tags)
        return cls(compress, tags, allow_compress)

    def apply(self, spec: RematSpec) -> RematSpec:
        """``spec`` with what it keeps compressed (unchanged without ``compress``)."""
        return spec if self.fmt is None else compress_spec(spec, self.fmt, self.tags)

    def solver_options(self) -> dict:
        forced = None if self.fmt is None else (self.tags if self.tags is not None else frozenset(Tag))
        fmt = self.fmt or "int8"
        return {"allow_compress": self.allow, "compress_format": fmt, "compressed_tags": forced}


def _plans(workload: Workload, specs, tiles, compression: _Compression = _Compression()) -> tuple:
    """The candidate specs (None: the solver's) and tiles, as ``max_seq`` documents them, and
    what they compress."""
    if specs is None:
        specs = (None, *(PRESETS[name] for name in FALLBACK_PRESETS if name in PRESETS))
    if tiles is None:
        tiles = (workload.config.mlp_chunk,) if workload.config.mlp_chunk else (None, DEFAULT_TILE)
    specs = tuple(compression.apply(get_remat(s)) if s is not None else None for s in specs)
    return specs, tuple(tiles), compression


def _fitting(
    workload: Workload, seq: int, limits: tuple, device: DevicePreset, target, plans
) -> "tuple | None":
    """``(plan, prediction)`` of least cost predicted within the device and host ``limits`` at
    ``seq``, or None."""
    limit, host_limit = limits
    specs, tiles, compression = plans
    best = None
    for tile in tiles:
        w = at_length(workload, seq, tile if tile is None or tile < seq else None)
        for spec in specs:
            if spec is None:  # the exact MILP's cheapest spec, offload allowed
                options = compression.solver_options()
                spec = solve(w, limit, device=device, offload=True, target=target, **options)
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


def _host_bound(workload: Workload, plan: SeqPlan, host_budget, target, multiple: int, limit_seq: int) -> int:
    """The longest T at which ``plan``'s predicted host memory is within ``host_budget``
    (``limit_seq`` without one): the compiled confirmation moves T by the device's figures
    alone, and must not move it past the host's."""
    if host_budget is None:
        return limit_seq

    def fits(seq: int) -> bool:
        return predict(at_length(workload, seq, plan.mlp_chunk), plan.spec, target=target).host <= host_budget

    return _search(fits, multiple, limit_seq)


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
    compress: "str | None" = None,
    compress_tags: "Collection[Tag | str] | None" = None,
    allow_compress: bool = False,
) -> MaxSeqAnswer:
    """The longest tokens per sequence whose step fits ``budget``, searched on the analytic
    model and confirmed by compiling for ``target``.

    The analytic search keeps the longest T at which some candidate plan is predicted within
    the budgets, and the cheapest plan there. Then that plan is compiled: at that T, and at a
    T moved by the measured over- or under-shoot (the state is fixed, the rest grows with T;
    never past the longest T whose predicted host memory is within ``host_budget``),
    then bisected between the longest compiled fit and the shortest compiled miss, within
    ``compiles`` compiles. The answer is the longest T the compiler confirmed.

    With ``compress`` every candidate keeps what it keeps compressed, and the confirmation
    compiles that spec: ``max_seq(w, budget, specs=["offload_full"], compress="int8")`` searches
    and compiles ``remat.compressed("offload_full", "int8")``, its layer inputs in int8 on the host.

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
        compress: ``"int8"`` or ``"fp8"``: every candidate keeps what it keeps compressed
            (``plan.compress_spec``, as ``plan_memory(compress=)``; ``Tag.ATTN_LSE`` never),
            and the confirmation compiles that spec. None: nothing compressed unless
            ``allow_compress``.
        compress_tags: with ``compress``, only these tags are compressed where kept
            (``"layer_input"``: the remat boundaries).
        allow_compress: the solver's candidate may store kept tags compressed (in
            ``compress``'s format, else int8) where that is cheaper.

    Returns:
        A ``MaxSeqAnswer``; its ``max_seq`` is 0 when not even ``multiple`` tokens fit.

    Raises:
        ValueError: for a ``multiple`` or ``compiles`` under 1, an unknown ``compress``
            format or tag, or ``compress_tags`` without ``compress``.

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
    compression = _Compression.of(compress, compress_tags, allow_compress)
    plans, found = _plans(workload, specs, tiles, compression), {}

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
    longest = _host_bound(workload, plan, host_budget, target, multiple, limit_seq)
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
        seq = min(seq, longest)  # the compiler checks the device; the host is predicted
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
