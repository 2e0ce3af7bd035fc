"""``preset_table``: every remat preset's predicted bytes next to the spec ``plan_memory`` chose.

This is what ``jaxckpt plan`` prints: one row per preset, predicted from shapes
(``choice``, no compile), plus the solved spec when no preset was chosen, the
planner's answer (or its ``BudgetError``) and every spec it compiled on the way. With
``compress`` (``jaxckpt plan --compress``) every row is its preset compressed as ``jaxckpt
train --compress`` would train it (``full+int8``). With ``per_layer`` (``jaxckpt plan
--per-layer``) the planner may choose a ``remat.Layered`` spec, its row named by its groups
(``3 x save_attn + 3 x full``).
"""

import dataclasses
import os
from collections.abc import Collection

from jaxckpt.plan._compression import compress_spec
from jaxckpt.plan._cost import Choice, choice, roofline_seconds, step_flops, xla_step_cost
from jaxckpt.plan._devices import DevicePreset, device_preset
from jaxckpt.plan._measure import CPU_CAVEAT
from jaxckpt.plan._solver import BudgetError, MemoryPlan, plan_memory
from jaxckpt.plan._specs import spec_dict, spec_name
from jaxckpt.plan._targets import CPU, Target, compile_target
from jaxckpt.plan._workload import Workload, placement, require_workload
from jaxckpt.remat import PRESETS, Layered, RematSpec, Tag, has_pinned_host


@dataclasses.dataclass(frozen=True)
class PresetRow:
    """One row of the table: a spec's predicted bytes and recompute, one device's.

    Example:
        >>> from jaxckpt import nn, plan
        >>> w = plan.Workload(nn.TransformerConfig.preset("tiny", n_layers=2), batch=2, seq=64)
        >>> row = plan.preset_table(w, budget=20 * 2**20).rows[0]
        >>> row.remat, row.to_dict()["recompute_flops"]
        ('none', 0)
    """

    remat: str
    choice: Choice
    fits: bool
    recompute_fraction: float
    estimated_seconds: float | None = None
    """``Choice.step_seconds`` on the table's device (None: no device named)."""

    def to_dict(self) -> dict:
        """The row as ``jaxckpt plan --json`` writes it; ``host_bytes`` is the host memory the
        row needs beside the device's ``total_bytes`` (``Prediction.host``: offloaded
        residuals, host-placed optimizer state)."""
        p = self.choice.predicted
        return {
            "remat": self.remat,
            "params_bytes": int(p.params),
            "grads_bytes": int(p.grads),
            "optimizer_bytes": int(p.optimizer),
            "activation_bytes": int(p.activations),
            "total_bytes": int(p.total),
            "host_bytes": int(p.host),
            "fits": self.fits,
            "recompute_flops": int(self.choice.recompute_flops),
            "recompute_fraction": self.recompute_fraction,
            "estimated_seconds": self.estimated_seconds,
            "compress": {str(tag): fmt for tag, fmt in self.choice.spec.compress.items()},
        }


@dataclasses.dataclass(frozen=True)
class PresetTable:
    """The answer of ``preset_table``.

    Attributes:
        workload: what was planned for. budget: bytes per device; headroom: the
            fraction kept free, so ``usable_bytes`` were allowed.
        rows: every preset usable here (offload presets need ``pinned_host``), then the
            solved spec when the planner chose one that is no preset.
        chosen: the ``MemoryPlan``, or None when nothing fits (then ``error`` says why).
        minimum_bytes: the smallest peak: predicted (the least row, or full remat), or
            measured by XLA when nothing fits (``minimum_source``).
        step_flops: one device's FLOPs of a step without remat.
        device: the device name the budget came from (None: a size was given).
        model: the model's preset name, for the report.

    Example:
        >>> from jaxckpt import nn, plan
        >>> w = plan.Workload(nn.TransformerConfig.preset("tiny", n_layers=2), batch=2, seq=64)
        >>> t = plan.preset_table(w, budget=20 * 2**20, model="tiny")
        >>> t.to_dict()["chosen"]["remat"] == t.chosen.remat, t.to_dict()["model"]
        (True, 'tiny')
    """

    workload: Workload
    budget: int
    headroom: float
    rows: tuple[PresetRow, ...]
    chosen: MemoryPlan | None
    error: BudgetError | None
    minimum_bytes: int
    minimum_source: str
    step_flops: int
    offload_shown: bool
    device: str | None = None
    model: str | None = None
    target: Target | None = None
    compression: dict | None = None
    """How the planner could compress: ``{"allow": bool, "format": str | None, "tags": [...] | None}``."""

    @property
    def measured_on(self) -> str:
        """The compiler every measured figure comes from: ``"xla-cpu"``, ``"xla-gpu:<target>"``
        or ``"xla-tpu:<generation>"``."""
        return CPU if self.target is None else self.target.measured_on

    @property
    def usable_bytes(self) -> int:
        """The budget less the headroom."""
        return int(self.budget * (1 - self.headroom))

    def to_dict(self) -> dict:
        """The JSON of ``jaxckpt plan --json``: the rows, the choice and its attempts (or the error)."""
        w, config = self.workload, self.workload.config
        size = {"optimizer": w.optimizer.name, "micro_batches": w.micro_batches, "devices": w.devices}
        model = {
            "param_dtype": config.param_dtype,
            "dtype": config.dtype,
            "lora": None if config.lora is None else config.lora.to_dict(),
            "quantize_base": config.quantize_base,
            "moments_dtype": w.optimizer.moments_dtype,
            "optimizer_placement": placement(w.optimizer.offload),
            "master_placement": placement(w.optimizer.offload_master),
        }
        result = {
            "budget_bytes": int(self.budget),
            "headroom": self.headroom,
            "usable_bytes": self.usable_bytes,
            "minimum_bytes": self.minimum_bytes,
            "minimum_source": self.minimum_source,
            "step_flops": self.step_flops,
            "rows": [row.to_dict() for row in self.rows],
            "chosen": None,
            "measured_on": self.measured_on,
            "caveat": CPU_CAVEAT if self.target is None else self.target.caveat,
            "offload_rows": "shown" if self.offload_shown else "omitted: no pinned_host memory here",
            "model": self.model,
            "device": self.device,
            "config": {"batch": w.batch, "seq": w.seq, **model, **size},
            "compression": self.compression or {"allow": False, "format": None, "tags": None},
        }
        if self.chosen is None:
            return {**result, "error": str(self.error)}
        c = self.chosen
        result["chosen"] = {
            **c.to_dict(),
            "spec": _spec_json(c.spec),
            "predicted_bytes": int(c.predicted.total),
        }
        # an estimate (nothing ran); xla_step_cost scales one scan's cost, a Layered stack has one per group
        if self.device is not None and c.measured.flops is not None and not isinstance(c.spec, Layered):
            m = c.measured
            flops, moved = xla_step_cost(
                m.flops, m.bytes_accessed, c.workload or w, c.spec, target=self.target
            )
            result["chosen"] |= {
                "step_flops_estimate": flops,
                "step_bytes_estimate": moved,
                "roofline_seconds": roofline_seconds(flops, moved, device_preset(self.device)),
            }
        result["attempts"] = [  # every spec the planner compiled, in order; "chosen": the plan's
            {
                "remat": _name(s),
                "chosen": s == c.spec,
                "predicted_bytes": int(p.total),
                "measured_bytes": int(m.peak),
                "measured_on": m.measured_on,
                **({} if m.peak_range is None else {"measured_range_bytes": list(m.peak_range)}),
            }
            for s, p, m in c.attempts
        ]
        return result


def preset_table(
    workload: Workload,
    budget: int,
    *,
    headroom: float = 0.0,
    device: "str | DevicePreset | None" = None,
    model: str | None = None,
    split_batch: bool = False,
    target: "str | Target | None" = None,
    autotune_results: "str | os.PathLike | None" = None,
    allow_compress: bool = False,
    compress: str | None = None,
    compress_tags: "Collection[Tag | str] | None" = None,
    per_layer: bool = False,
) -> PresetTable:
    """Every remat preset's predicted bytes and recompute, and ``plan_memory``'s answer.

    Args:
        workload: the step. budget: bytes per device. headroom: the fraction kept free.
        device: the device the budget is (a ``DEVICES`` name or preset): it prices
            recompute and offload; None prices them as ``"cpu"`` and names no device.
        model: the model's preset name, carried into the report.
        split_batch: let the planner cut the batch into micro-batches (``plan_memory``);
            the rows stay those of the batch as given.
        target: a GPU target (``plan.TARGETS``): rows predicted for XLA:GPU, the plan
            compiled with it (``plan_memory(target=)``), offload presets shown and
            planned for (a GPU has host memory of its own). None: XLA:CPU.
        autotune_results: the target's autotune results from a real GPU.
        allow_compress, compress, compress_tags: as ``plan_memory``'s; with ``compress``
            each row is its preset with what it keeps compressed (``compress_tags``: those
            of them it keeps), named ``<preset>+<format>`` (``spec_name``).
        per_layer: let the planner give the stack's layers different specs
            (``plan_memory(per_layer=)``); a ``remat.Layered`` choice adds its row, named by
            its groups (``Layered.describe``).

    Returns:
        A ``PresetTable``; when nothing fits, its ``chosen`` is None and ``error`` the
        planner's ``BudgetError`` (nothing is raised for it).

    Raises:
        ValueError: for a bad budget or headroom (as ``plan_memory``).

    Example:
        >>> from jaxckpt import nn, plan
        >>> w = plan.Workload(nn.TransformerConfig.preset("tiny", n_layers=2), batch=2, seq=64)
        >>> t = plan.preset_table(w, budget=20 * 2**20)
        >>> t.chosen.measured.peak <= 20 * 2**20, [r.remat for r in t.rows][:2]
        (True, ['none', 'full'])
    """
    require_workload(workload, "preset_table")
    target = None if target is None else compile_target(target)
    preset = device_preset(device) if isinstance(device, str) else device
    name = None if preset is None else preset.name
    chosen, error = None, None
    try:
        chosen = plan_memory(
            workload,
            budget,
            headroom=headroom,
            device=preset or device_preset("cpu"),
            split_batch=split_batch,
            target=target,
            autotune_results=autotune_results,
            allow_compress=allow_compress,
            compress=compress,
            compress_tags=compress_tags,
            per_layer=per_layer,
        )
    except BudgetError as err:
        error = err
    limit = int(budget * (1 - headroom))
    step = step_flops(workload)
    offload = target is not None or has_pinned_host()
    tags = None if compress_tags is None else frozenset(Tag(str(t)) for t in compress_tags)
    specs = {n: PRESETS[n] for n in PRESETS if offload or not PRESETS[n].offload}
    if compress is not None:
        specs = {spec_name(s): s for s in (compress_spec(s, compress, tags) for s in specs.values())}
    rows = [_row(n, choice(workload, s, target=target), limit, step, preset) for n, s in specs.items()]
    if chosen is not None and chosen.remat not in specs:
        c = Choice(chosen.spec, chosen.predicted, chosen.recompute_flops, 0, chosen.compress_flops)
        rows.append(_row(chosen.remat, c, limit, step, preset))
    if chosen is not None:  # both predicted: the planner's full-remat figure and the rows'
        minimum = min([int(chosen.minimum_bytes)] + [int(r.choice.predicted.total) for r in rows])
        source = "predicted"
    else:
        minimum, source = int(error.minimum_bytes), "measured" if error.measured else "predicted"
    return PresetTable(
        workload, budget, headroom, tuple(rows), chosen, error, minimum, source, step, offload,
        device=name, model=model, target=target,
        compression={"allow": allow_compress, "format": compress or ("int8" if allow_compress else None),
                     "tags": None if tags is None else sorted(map(str, tags))},
    )  # fmt: skip


def _name(spec: "RematSpec | Layered") -> str:
    """A spec's name in the table: its preset's (``spec_name``), or a ``Layered`` spec's groups."""
    return spec.describe() if isinstance(spec, Layered) else spec_name(spec)


def _spec_json(spec: "RematSpec | Layered") -> dict:
    """``spec_dict`` with the tags as strings (a ``Layered`` spec's in each of its ``groups``)."""

    def strings(fields: dict) -> dict:
        return {k: list(map(str, v)) if isinstance(v, list) else v for k, v in fields.items()}

    fields = spec_dict(spec)
    return {"groups": [strings(g) for g in fields["groups"]]} if "groups" in fields else strings(fields)


def _row(name: str, c: Choice, limit: int, step: int, device: DevicePreset | None) -> PresetRow:
    seconds = None if device is None else c.step_seconds(device, step)
    return PresetRow(name, c, int(c.predicted.total) <= limit, c.recompute_flops / step, seconds)
