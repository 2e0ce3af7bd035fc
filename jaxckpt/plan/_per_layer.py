"""Per-layer plans: a remat spec that differs across the stack (``remat.Layered``), priced
from the uniform specs' predictions, and the split that fits a budget at least recompute.

One spec for every layer steps between the presets' peaks: a budget between ``full`` and
``save_attn`` gets ``full`` and leaves the rest unused. A ``Layered`` stack gives its first
``k`` layers a richer spec ``a`` and the rest a leaner ``b``, and its peak moves in steps of
one layer's difference between them.

Pricing (``predict_layered``): a group of ``c`` layers keeps what its spec keeps for a stack
of ``c`` layers (``_analytic.stored_bytes``, segments cut within the group as
``nn.stack_pieces`` cuts them); the rest of the activations (the working set of the layer
and of the head, XLA:CPU's widened copies, the optimizer's workspace) is taken from the
uniform prediction of each group's spec and the largest is kept: one layer's backward runs
at a time. The state, the gradients and the inputs do not depend on the spec; the groups
read the stack's parameters in place (``nn.run_blocks``: no copy, checked by
``tests/remat/test_layered.py``). The recompute is each group's share (``choice`` over a
stack of its layers).

The search (``layered_choices``): the uniform candidates are the presets without offload or
compression and the MILP's solutions (``solve``) at budgets spread from ``full``'s peak to
no remat's, reduced to their frontier (no candidate both larger and recomputing more); every
``(a, b, k)`` with ``a`` richer than ``b`` is priced in closed form, and the choices
predicted within a budget come cheapest first. ``plan_memory(per_layer=True)`` compiles them
in that order until one fits.
"""

import dataclasses

import numpy as np

from jaxckpt.plan._analytic import Prediction, predict, stored_bytes
from jaxckpt.plan._cost import Choice, choice
from jaxckpt.plan._devices import DEVICES, DevicePreset
from jaxckpt.plan._layer_graph import layer_graph
from jaxckpt.plan._milp import solve
from jaxckpt.plan._targets import Target
from jaxckpt.plan._workload import Workload, require_workload
from jaxckpt.remat import PRESETS, Layered, RematSpec
from jaxckpt.remat import get as get_remat

SOLVER_BUDGETS = 8
"""Budgets at which the MILP is asked for a uniform spec, spread evenly from ``full``'s
predicted peak to no remat's (each adds one candidate at most)."""


FIRST_GROUP_MIN = 2
"""Layers a split's first group has at least. A first group of one layer measures as if that
layer kept everything: on XLA:CPU (``tiny``, 6 layers, B4 T1024) ``1 x save_attn + 5 x full``
peaked at 146.23 MiB (predicted 106.14; ``none`` keeps about 49 MiB a layer) where
``2 x save_attn + 4 x full`` peaked at 103.57 and ``5 x save_attn + 1 x full`` (a last group of
one) at 106.55. Not yet understood (``nn.run_blocks``); such splits are left out."""


def _mixable(spec: RematSpec) -> bool:
    """Whether a spec may be a group of a per-layer plan: remat'd, nothing offloaded or
    compressed (a group without remat keeps its own copy of its layers' parameters for the
    backward pass, and the compressed remat reads its layers as a slice: both copy)."""
    return spec.enabled and not spec.offload and not spec.compress


def _groups(
    spec: "str | RematSpec | Layered", n_layers: int, where: str
) -> tuple[tuple[int, RematSpec], ...]:
    spec = get_remat(spec)
    if not isinstance(spec, Layered):
        return ((n_layers, spec),)
    if spec.n_layers != n_layers:
        raise ValueError(
            f"{where}: the Layered spec {spec.describe()!r} covers {spec.n_layers} layers; the workload's "
            f"config has n_layers={n_layers}"
        )
    for count, group in spec.groups:
        if not _mixable(group):
            raise ValueError(
                f"{where}: group {count} x {group!r} offloads, compresses or is not remat'd; a per-layer "
                "plan mixes remat'd specs that keep their tags on the device, uncompressed"
            )
    return spec.groups


def _with_layers(workload: Workload, n_layers: int) -> Workload:
    return workload.replace(config=workload.config.replace(n_layers=n_layers))


@dataclasses.dataclass(frozen=True)
class _Priced:
    """One uniform spec's terms for pricing groups of it: what ``c`` layers keep, and the
    activations beside them (``rest``)."""

    spec: RematSpec
    prediction: Prediction
    kept: tuple[int, ...]  # kept[c]: bytes c layers keep (c = 0 .. n_layers)
    flops: tuple[int, ...]  # flops[c]: recompute FLOPs of c layers
    rest: int


def _priced(workload: Workload, spec: RematSpec, target) -> _Priced:
    config = workload.config
    graph = layer_graph(workload, target=target)
    n = config.n_layers
    kept = [0] + [stored_bytes(graph, spec, config.replace(n_layers=c)) for c in range(1, n + 1)]
    flops = [0] + [
        choice(_with_layers(workload, c), spec, target=target).recompute_flops for c in range(1, n + 1)
    ]
    prediction = predict(workload, spec, target=target)
    return _Priced(spec, prediction, tuple(kept), tuple(flops), prediction.activations - kept[n])


def predict_layered(
    workload: Workload, remat: "str | RematSpec | Layered", *, target: "str | Target | None" = None
) -> Prediction:
    """``predict`` for a stack whose spec differs across its layers (``remat.Layered``).

    Each group keeps what its spec keeps for a stack of its layers; the working set, the
    widened copies and the workspace are the largest of the groups' specs' (one layer's
    backward pass runs at a time); the state is the uniform stack's (the groups read the
    stacked parameters in place). A plain spec is ``predict``'s answer.

    Args:
        workload: the step. remat: a ``Layered`` spec (or a preset name or ``RematSpec``)
            whose groups are remat'd and neither offload nor compress.
        target: as ``predict(target=)``.

    Raises:
        ValueError: for a ``Layered`` spec of another depth than ``workload.config.n_layers``,
            or with a group that offloads, compresses or is not remat'd.

    Example:
        >>> from jaxckpt import nn, plan, remat
        >>> w = plan.Workload(nn.TransformerConfig.preset("tiny", n_layers=4), batch=2, seq=256)
        >>> full, attn = plan.predict(w, "full").total, plan.predict(w, "save_attn").total
        >>> mixed = plan.predict_layered(w, remat.Layered(((2, "save_attn"), (2, "full")))).total
        >>> full < mixed < attn
        True
    """
    require_workload(workload, "predict_layered")
    groups = _groups(remat, workload.config.n_layers, "predict_layered")
    if len(groups) == 1:
        return predict(workload, groups[0][1], target=target)
    priced = [(count, _priced(workload, spec, target)) for count, spec in groups]
    activations = sum(p.kept[count] for count, p in priced) + max(p.rest for _, p in priced)
    return dataclasses.replace(priced[0][1].prediction, activations=activations)


def choice_layered(
    workload: Workload, remat: "str | RematSpec | Layered", *, target: "str | Target | None" = None
) -> Choice:
    """``choice`` for a ``remat.Layered`` stack: its ``predict_layered`` bytes and its groups'
    recompute FLOPs added (each group's as a stack of its layers). No offload, no compression.

    Example:
        >>> from jaxckpt import nn, plan, remat
        >>> w = plan.Workload(nn.TransformerConfig.preset("tiny", n_layers=4), batch=2, seq=64)
        >>> half = plan.choice_layered(w, remat.Layered(((2, "save_attn"), (2, "full"))))
        >>> full, attn = plan.choice(w, "full").recompute_flops, plan.choice(w, "save_attn").recompute_flops
        >>> half.recompute_flops == (full + attn) // 2
        True
    """
    require_workload(workload, "choice_layered")
    groups = _groups(remat, workload.config.n_layers, "choice_layered")
    if len(groups) == 1:
        return choice(workload, groups[0][1], target=target)
    flops = sum(
        choice(_with_layers(workload, count), spec, target=target).recompute_flops for count, spec in groups
    )
    return Choice(get_remat(remat), predict_layered(workload, remat, target=target), flops, 0)


def uniform_candidates(
    workload: Workload,
    *,
    target: "str | Target | None" = None,
    device: DevicePreset = DEVICES["cpu"],
    budgets: int = SOLVER_BUDGETS,
) -> tuple[RematSpec, ...]:
    """The uniform specs a per-layer plan mixes: the presets that are remat'd without offload
    or compression, and the MILP's solutions at ``budgets`` budgets spread from ``full``'s
    predicted peak to no remat's; of those, the frontier (none that another beats on both
    predicted bytes and recompute), from the largest to the smallest.

    Example:
        >>> from jaxckpt import nn, plan, remat
        >>> w = plan.Workload(nn.TransformerConfig.preset("tiny", n_layers=2), batch=2, seq=64)
        >>> specs = plan.uniform_candidates(w, budgets=2)
        >>> remat.get("full") in specs, remat.get("save_attn") in specs
        (True, True)
    """
    require_workload(workload, "uniform_candidates")
    low = predict(workload, "full", target=target).total
    high = predict(workload, "none", target=target).total
    specs = {spec for spec in PRESETS.values() if _mixable(spec)}
    for budget in np.linspace(low, high, budgets) if budgets > 0 else ():
        spec = solve(workload, int(budget), device=device, target=target)
        if spec is not None and _mixable(spec):
            specs.add(spec)
    return _frontier(workload, specs, target)


def _frontier(workload: Workload, specs, target) -> tuple[RematSpec, ...]:
    priced = [
        (predict(workload, s, target=target).total, choice(workload, s, target=target).recompute_flops, s)
        for s in specs
    ]
    frontier, least = [], None
    for total, _, spec in sorted(priced, key=lambda t: (t[1], t[0])):  # least recompute first
        if least is None or total < least:
            frontier.append((total, spec))
            least = total
    return tuple(spec for _, spec in sorted(frontier, key=lambda t: -t[0]))


def layered_choices(
    workload: Workload,
    budget: int,
    *,
    target: "str | Target | None" = None,
    candidates: "tuple[RematSpec, ...] | None" = None,
    exclude=(),
) -> list[Choice]:
    """Every split ``(k x a) + ((n - k) x b)`` (``k >= FIRST_GROUP_MIN``) of the uniform
    ``candidates`` (default: ``uniform_candidates``), the uniform specs among them, predicted
    within ``budget`` bytes, least recompute first (then smallest). A split's spec is a
    ``remat.Layered`` (its richer spec first), a uniform one a ``RematSpec``. ``exclude``:
    specs left out.

    Example:
        >>> from jaxckpt import nn, plan, remat
        >>> w = plan.Workload(nn.TransformerConfig.preset("tiny", n_layers=4), batch=2, seq=256)
        >>> budget = plan.predict_layered(w, remat.Layered(((2, "save_attn"), (2, "full")))).total
        >>> pair = (remat.get("save_attn"), remat.get("full"))
        >>> best = plan.layered_choices(w, budget, candidates=pair)[0]
        >>> best.spec.describe(), best.recompute_flops < plan.choice(w, "full").recompute_flops
        ('2 x save_attn + 2 x full', True)
    """
    require_workload(workload, "layered_choices")
    n = workload.config.n_layers
    specs = uniform_candidates(workload, target=target) if candidates is None else tuple(candidates)
    priced = [_priced(workload, get_remat(s), target) for s in specs]
    base = predict(workload, priced[0].spec, target=target)
    fixed = base.total - base.activations
    excluded = set(exclude)
    found = {}
    for i, a in enumerate(priced):
        for b in priced[i:]:  # the richer spec first (the frontier runs from the largest)
            for k in [n] if a is b else range(FIRST_GROUP_MIN, n):
                activations = a.kept[k] + b.kept[n - k] + max(a.rest, b.rest if k < n else 0)
                if fixed + activations > budget:
                    continue
                spec = Layered.of((k, a.spec), (n - k, b.spec))
                if spec in excluded or spec in found:
                    continue
                prediction = dataclasses.replace(base, activations=activations)
                found[spec] = Choice(spec, prediction, a.flops[k] + b.flops[n - k], 0)
    return sorted(found.values(), key=lambda c: (c.recompute_flops, c.predicted.total))
