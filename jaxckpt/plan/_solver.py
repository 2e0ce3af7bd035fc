"""``plan_memory``: the cheapest remat spec under a memory budget, checked by the compiler.

``solve`` (``_milp.py``) picks the spec of least cost whose predicted peak fits. The
chosen spec is then compiled (``measure``). When XLA needs more than the budget,
a no-good cut excludes it and the next cheapest spec is solved for, so the plan is the
cheapest spec that XLA confirms; only after several misses is the solver's budget
lowered by the overshoot. A spec is only returned once its measured peak fits.

Compression (``RematSpec.compress``) is the solver's fourth choice only with
``allow_compress``: it changes the gradients slightly, so it is never chosen unasked.
``compress`` is ``jaxckpt train --compress``: every spec the planner considers keeps its
kept tags compressed in that format (``compress_tags``: only those).

With ``per_layer`` the spec may differ across the stack (``remat.Layered``): the first k
layers under a richer spec than the rest, the split found by ``layered_choices`` (the
uniform specs among the candidates), compiled cheapest first until one fits.
"""

import dataclasses
import os
from collections.abc import Collection

from jaxckpt.plan._analytic import Prediction, predict
from jaxckpt.plan._compression import compress_spec, compressed_tag_bytes
from jaxckpt.plan._cost import Choice, choice, step_flops
from jaxckpt.plan._devices import DevicePreset, device_preset
from jaxckpt.plan._infeasible import held_bytes, infeasible_message, splits
from jaxckpt.plan._measure import measure
from jaxckpt.plan._milp import solve
from jaxckpt.plan._per_layer import choice_layered, layered_choices, predict_layered, uniform_candidates
from jaxckpt.plan._specs import spec_dict, spec_name
from jaxckpt.plan._targets import Target, compile_target
from jaxckpt.plan._workload import Workload, require_workload
from jaxckpt.remat import FORMATS, PRESETS, Layered, RematSpec, Tag
from jaxckpt.train import MemoryReport

MAX_ATTEMPTS = 10
"""Specs compiled at most before falling back to full remat."""
PREDICTION_MARGIN = 0.05
"""Specs the solver picks may be predicted up to this fraction over the budget: they may fit."""
CHECK_MARGIN = 0.10
"""No remat, or a split batch under full remat, is compiled when predicted up to this fraction
over the budget (one compile each; the model is within 10% of XLA)."""
CUTS_BEFORE_TIGHTENING = 6
"""Misses after which the solver's budget is lowered by the overshoot."""
LOOSENING_ATTEMPTS = 2
"""Cheaper specs compiled at most after a fit the model over-predicted (``_plan_whole``)."""


class BudgetError(ValueError):
    """No remat spec fits the budget. ``minimum_bytes`` is the smallest peak: measured by
    XLA (``measured`` True), or, when the state the step holds throughout is already over
    the budget and nothing was compiled, predicted under full remat (``measured`` False).

    Example:
        >>> from jaxckpt import nn, plan
        >>> w = plan.Workload(nn.TransformerConfig.preset("tiny", n_layers=1), batch=1, seq=16)
        >>> try:
        ...     plan.plan_memory(w, budget=2**20)
        ... except plan.BudgetError as err:
        ...     err.minimum_bytes > 2**20
        True
    """

    def __init__(self, message: str, minimum_bytes: int, measured: bool = True):
        super().__init__(message)
        self.minimum_bytes = minimum_bytes
        self.measured = measured


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The answer of ``plan_memory``.

    Attributes:
        spec: the chosen ``RematSpec`` (a ``remat.Layered`` one under ``per_layer``); ``remat``
            names it (a preset name, ``"solved"``, or the groups: ``"2 x save_attn + 4 x full"``).
        budget: bytes allowed. predicted: the analytic figures of ``spec``.
        measured: XLA's figures for ``spec`` (``measured.peak <= budget``).
        recompute_flops: forward FLOPs the backward pass repeats, per step.
        step_flops: FLOPs of one step without remat (forward + backward).
        minimum_bytes: the predicted peak of ``full`` remat (the least of the per-layer specs).
        attempts: every ``(spec, predicted, measured)`` compiled on the way.
        devices: FSDP devices planned for; every byte figure is one device's, and the
            FLOPs are one device's share of the step.
        workload: what was planned: the one asked for, or (``split_batch``) its batch cut
            into more micro-batches.
        compress_flops: FLOPs of the compressed residuals' (de)quantization, per step (0
            without compression).
        target: the compiler the plan was predicted and measured for (None: XLA:CPU).

    Example:
        >>> from jaxckpt import nn, plan
        >>> w = plan.Workload(nn.TransformerConfig.preset("tiny", n_layers=2), batch=2, seq=64)
        >>> p = plan.plan_memory(w, budget=20 * 2**20)
        >>> p.measured.peak <= p.budget, p.to_dict()["remat"] == p.remat
        (True, True)
    """

    spec: "RematSpec | Layered"
    remat: str
    budget: int
    predicted: Prediction
    measured: MemoryReport
    recompute_flops: int
    step_flops: int
    minimum_bytes: int
    attempts: tuple
    devices: int = 1
    workload: Workload | None = None
    compress_flops: int = 0
    target: "Target | None" = None

    @property
    def recompute_fraction(self) -> float:
        """Extra recompute as a fraction of the step's FLOPs."""
        return self.recompute_flops / self.step_flops

    def to_dict(self) -> dict:
        """The chosen spec and its figures, JSON-ready; ``compressed`` lists each compressed
        tag with its format and its stored bytes (every layer's, one micro-batch's) beside
        what it would take uncompressed."""
        spec = spec_dict(self.spec)
        out = {
            "remat": self.remat,
            "spec": spec,
            "predicted_bytes": self.predicted.total,
            "measured_bytes": self.measured.peak,
            "host_bytes": self.predicted.host,
            "measured_host_bytes": self.measured.host_argument + self.measured.host_temp,
            "measured_on": self.measured.measured_on,
            "recompute_flops": self.recompute_flops,
            "devices": self.devices,
        }
        if self.spec.compress:
            workload = self.workload
            sizes = {} if workload is None else compressed_tag_bytes(workload, self.spec, target=self.target)
            out["compressed"] = [
                {
                    "tag": str(tag),
                    "format": self.spec.compress[tag],
                    "bytes": stored,
                    "uncompressed_bytes": full,
                }
                for tag, (stored, full) in sizes.items()
            ]
            out["compress_flops"] = self.compress_flops
        if self.measured.flops is not None:  # the compiler's cost analysis of the spec's step
            m = self.measured
            out |= {"measured_flops": m.flops, "measured_bytes_accessed": m.bytes_accessed}
        if self.workload is not None:
            out |= {"batch": self.workload.batch, "micro_batches": self.workload.micro_batches}
        return out


def plan_memory(
    workload: Workload,
    budget: int,
    *,
    headroom: float = 0.0,
    device: "str | DevicePreset" = "cpu",
    offload: bool | None = None,
    split_batch: bool = False,
    target: "str | Target | None" = None,
    autotune_results: "str | os.PathLike | None" = None,
    allow_compress: bool = False,
    compress: str | None = None,
    compress_tags: "Collection[Tag | str] | None" = None,
    per_layer: bool = False,
) -> MemoryPlan:
    """The remat spec of least recompute whose compiled peak fits ``budget`` bytes.

    No remat at all is taken when it fits. Otherwise the MILP (``solve``) picks the
    tags to save (and, with ``offload``, to offload); the spec is compiled and
    measured, and while XLA needs more than the budget the solver's budget is lowered
    by the overshoot. When XLA needs less than the model predicted for the spec that fit,
    by more than 5% of the budget, the solver's budget is raised by that error and a
    cheaper spec is compiled (``LOOSENING_ATTEMPTS`` at most), kept where it fits too. As
    the budget grows the recompute does not rise: a larger budget admits every spec a
    smaller one does (``tests/plan/test_plan_solver.py`` sweeps it).

    Args:
        workload: the step. Over ``workload.devices`` (FSDP, ``mesh="fsdp=D"``) the plan
            is per device and each candidate is compiled over D devices (``measure``).
        budget: bytes per device. headroom: the fraction of ``budget`` kept free.
        device: a ``DEVICES`` name or ``DevicePreset`` (prices recompute and offload).
        offload: allow host offload of remat residuals, priced at the device's host link
            (needs a backend with its own host memory to measure); None: only for a GPU
            target (XLA:CPU's ``pinned_host`` is the same RAM: it saves nothing).
        split_batch: when no spec fits the whole batch, cut it into the fewest
            micro-batches (``SPLITS``) that fit; ``MemoryPlan.workload`` says how.
        target: None predicts and measures for XLA:CPU; a GPU target (``plan.TARGETS``)
            predicts for XLA:GPU and compiles every candidate with it, without a GPU
            (``measure(target=)``: the larger peak of the two GEMM emitters).
        autotune_results: the target's autotune results from a real GPU (``measure``).
        allow_compress: let the solver store kept tags compressed (int8, or ``compress``'s
            format), on the device or in host memory, where that is the cheapest way to fit
            (``solve(allow_compress=)``); full remat with compressed layer inputs is the last
            resort. Off by default: compression changes the gradients slightly.
        compress: ``"int8"`` or ``"fp8"``: every spec considered keeps what it keeps
            compressed (``jaxckpt train --compress``: ``remat.compressed(spec, compress)``),
            but ``Tag.ATTN_LSE``. None: nothing is compressed unless ``allow_compress``.
        compress_tags: with ``compress``, only these tags are compressed where kept.
        per_layer: let the spec differ across the stack (``remat.Layered``): the first k
            layers under a richer spec than the rest, where that fits the budget at less
            recompute than any uniform spec (``layered_choices``; the uniform specs are
            among its choices, so the plan never recomputes more than without it). Mixes
            remat'd specs without offload or compression; not with ``allow_compress`` or
            ``compress``.

    Returns:
        A ``MemoryPlan`` whose ``measured.peak <= budget * (1 - headroom)``.

    Raises:
        BudgetError: when nothing fits; it gives the minimum peak and what would fit.
            A budget below what the step holds from start to end (its arguments: the
            parameters, the optimizer state on the device and the input tokens;
            ``held_bytes``) is answered from that sum, before anything is compiled.
        ValueError: for a budget that is not a positive int, a headroom outside [0, 1), an
            unknown ``compress`` format, or ``compress_tags`` without ``compress``.

    Example:
        >>> from jaxckpt import nn, plan
        >>> w = plan.Workload(nn.TransformerConfig.preset("tiny", n_layers=2), batch=2, seq=128)
        >>> p = plan.plan_memory(w, budget=20 * 2**20)
        >>> p.measured.peak <= 20 * 2**20
        True
    """
    require_workload(workload, "plan_memory")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"plan_memory: budget={budget!r} must be a positive int (bytes)")
    if not 0.0 <= headroom < 1.0:
        raise ValueError(f"plan_memory: headroom={headroom!r} must be in [0, 1)")
    squeeze = _Compression.of(allow_compress, compress, compress_tags)
    if not isinstance(per_layer, bool):
        raise ValueError(f"plan_memory: per_layer={per_layer!r} must be True or False")
    if per_layer and (allow_compress or compress is not None):
        raise ValueError(
            "plan_memory: per_layer=True mixes uncompressed specs; it does not go with allow_compress= "
            "or compress= (plan one or the other)"
        )
    device = device_preset(device) if isinstance(device, str) else device
    limit = int(budget * (1 - headroom))
    target = None if target is None else compile_target(target)
    offload = target is not None if offload is None else offload
    compiler = _Compiler(target, autotune_results, offload, squeeze, per_layer)
    try:
        return _plan_whole(workload, budget, limit, device, compiler)
    except BudgetError as err:
        if not split_batch:
            raise
        whole = err
    for split in splits(workload):
        if compiler.predict(split, "full").total > limit * (1 + CHECK_MARGIN):
            continue
        try:
            return _plan_whole(split, budget, limit, device, compiler)
        except BudgetError:
            continue
    raise whole


@dataclasses.dataclass(frozen=True)
class _Compression:
    """What the planner may compress: anything (``allow``) in ``fmt``, or (``forced``) the
    tags every spec keeps, in ``fmt`` (``plan_memory(compress=)``)."""

    allow: bool = False
    fmt: str = "int8"
    forced: frozenset | None = None

    @classmethod
    def of(cls, allow_compress: bool, compress: str | None, compress_tags) -> "_Compression":
        if not isinstance(allow_compress, bool):
            raise ValueError(f"plan_memory: allow_compress={allow_compress!r} must be True or False")
        if compress is not None and compress not in FORMATS:
            raise ValueError(f"plan_memory: compress={compress!r} must be one of {', '.join(FORMATS)}")
        if compress_tags is not None and compress is None:
            raise ValueError("plan_memory: compress_tags= needs compress= (the format: int8 or fp8)")
        forced = None
        if compress is not None:
            forced = frozenset(Tag) if compress_tags is None else frozenset(_tag(t) for t in compress_tags)
        return cls(allow_compress, compress or "int8", forced)

    def apply(self, spec: RematSpec) -> RematSpec:
        """``spec`` as ``compress`` makes it (unchanged without it)."""
        if self.forced is None:
            return spec
        return compress_spec(spec, self.fmt, None if self.forced == frozenset(Tag) else self.forced)

    def solver_options(self) -> dict:
        return {"allow_compress": self.allow, "compress_format": self.fmt, "compressed_tags": self.forced}


def _tag(name) -> Tag:
    try:
        return Tag(str(name))
    except ValueError:
        raise ValueError(
            f"plan_memory: compress_tags names {str(name)!r}, which is no tag; valid tags: "
            f"{', '.join(map(str, Tag))}"
        ) from None


@dataclasses.dataclass(frozen=True)
class _Compiler:
    """The backend a plan is for: its model (``predict``/``choice``), its measurement, and
    what it may compress."""

    target: Target | None
    autotune_results: "str | os.PathLike | None"
    offload: bool
    compression: _Compression = _Compression()
    per_layer: bool = False

    def predict(self, workload: Workload, spec) -> Prediction:
        if isinstance(spec, Layered):
            return predict_layered(workload, spec, target=self.target)
        return predict(workload, spec, target=self.target)

    def choice(self, workload: Workload, spec) -> Choice:
        if isinstance(spec, Layered):
            return choice_layered(workload, spec, target=self.target)
        return choice(workload, spec, target=self.target)

    def measure(self, workload: Workload, spec) -> MemoryReport:
        return measure(workload, spec, target=self.target, autotune_results=self.autotune_results)


def _plan_whole(
    workload: Workload, budget: int, limit: int, device: DevicePreset, compiler: _Compiler
) -> MemoryPlan:
    """``plan_memory`` for the batch as given (no split)."""
    attempts = []

    def try_spec(spec: RematSpec) -> MemoryReport:
        done = next((m for s, _, m in attempts if s == spec), None)
        if done is None:
            done = compiler.measure(workload, spec)
            attempts.append((spec, compiler.predict(workload, spec), done))
        return done

    def found(spec: RematSpec) -> MemoryPlan:
        c = compiler.choice(workload, spec)
        return _plan(workload, budget, c, try_spec(spec), minimum, attempts, compiler.target)

    squeeze = compiler.compression
    # the last resorts: full remat, with its layer inputs compressed when that is allowed or asked
    fallbacks = [squeeze.apply(PRESETS["full"])]
    if squeeze.allow:
        fallbacks.append(compress_spec(PRESETS["full"], squeeze.fmt))
    minimum = min(compiler.predict(workload, spec).total for spec in fallbacks)
    if held_bytes(workload) > limit:  # arithmetic answers it: no peak can be below the arguments
        message = infeasible_message(workload, limit, minimum, compiler, budget=budget, measured=False)
        raise BudgetError(message, minimum, measured=False)
    # The prediction is within a few % of XLA, either way: a spec predicted slightly over
    # the limit may fit, so the search starts optimistic and lets the compiler decide.
    aim = int(limit * (1 + PREDICTION_MARGIN))
    none = PRESETS["none"]
    if compiler.predict(workload, none).total <= limit * (1 + CHECK_MARGIN) and try_spec(none).peak <= limit:
        return found(none)  # no recompute at all
    excluded: list[RematSpec] = []
    candidates = (
        uniform_candidates(workload, target=compiler.target, device=device) if compiler.per_layer else ()
    )

    def cheapest(aim: int) -> RematSpec | None:
        """The spec of least cost predicted within ``aim``, none of ``excluded``."""
        if compiler.per_layer:
            fitting = layered_choices(
                workload, aim, target=compiler.target, candidates=candidates, exclude=excluded
            )
            return fitting[0].spec if fitting else None
        return solve(
            workload,
            aim,
            device=device,
            offload=compiler.offload,
            exclude=excluded,
            target=compiler.target,
            **squeeze.solver_options(),
        )

    def cost(spec: RematSpec) -> float:
        return compiler.choice(workload, spec).seconds(device)

    def cheaper_that_fits(spec: RematSpec, measured: MemoryReport) -> RematSpec:
        """After a fit: where the model was over on the spec by more than PREDICTION_MARGIN of
        the limit, the cheapest spec at the aim raised by that error, as long as it costs less
        and XLA finds that it fits too (a compile each, LOOSENING_ATTEMPTS at most). The model
        is over on some large steps (XLA:TPU, llama2-7b LoRA on v6e: the spec that fit was
        predicted 28.57 GiB and measured 25.52), and cheaper specs that fit are predicted
        over the aim and never tried."""
        for _ in range(LOOSENING_ATTEMPTS):
            over = compiler.predict(workload, spec).total - measured.peak
            if over <= limit * PREDICTION_MARGIN:
                break
            candidate = cheapest(aim + over)
            if candidate is None or candidate == spec or cost(candidate) >= cost(spec):
                break
            result = try_spec(candidate)
            if result.peak > limit:
                excluded.append(candidate)
                break
            spec, measured = candidate, result
        return spec

    for _ in range(MAX_ATTEMPTS):
        spec = cheapest(aim)
        if spec is None:
            break
        measured = try_spec(spec)
        if measured.peak <= limit:
            return found(cheaper_that_fits(spec, measured))
        # The next cheapest spec is tried (a no-good cut): the plan stays the cheapest
        # that fits. The model's error differs from spec to spec (the same tiny step is
        # under-predicted saving everything and over-predicted under minimal), so one miss
        # says nothing of the next spec; after a few misses the prediction is evidently
        # low: ask for less.
        excluded.append(spec)
        if len(excluded) >= CUTS_BEFORE_TIGHTENING:
            aim = min(aim, compiler.predict(workload, spec).total) - (measured.peak - limit)
    # the prediction may be above what XLA needs: full remat settles it (compressed, when allowed)
    smallest = None
    for spec in fallbacks:
        peak = try_spec(spec).peak
        if peak <= limit:
            return found(spec)
        smallest = peak if smallest is None else min(smallest, peak)
    raise BudgetError(infeasible_message(workload, limit, smallest, compiler, budget=budget), smallest)


def _plan(workload: Workload, budget: int, c: Choice, measured, minimum, attempts, target=None) -> MemoryPlan:
    return MemoryPlan(
        workload=workload,
        spec=c.spec,
        remat=c.spec.describe() if isinstance(c.spec, Layered) else spec_name(c.spec),
        budget=budget,
        predicted=c.predicted,
        measured=measured,
        recompute_flops=c.recompute_flops,
        step_flops=step_flops(workload),
        devices=workload.devices,
        minimum_bytes=minimum,
        attempts=tuple(attempts),
        compress_flops=c.compress_flops,
        target=target,
    )
