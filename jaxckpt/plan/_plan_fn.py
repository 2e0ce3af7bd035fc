"""``plan_fn``: a remat policy for any model's train step under a memory budget, from its
program, checked by the compiler; ``program_model`` and ``FnPrediction``: the predicted peak.

The model of a step's peak, for a policy applied to each of its ``count`` blocks:

    state + count x stored(policy) + max(working - (stored(policy) - stored(full)), 0)

* ``state``: the step's arguments and outputs (less what it donates): the parameters, the
  optimizer state, the batch and the new state. The gradients are not counted apart: what
  of them XLA holds beside the outputs is in ``working`` (the ViT step's whole temporaries
  under full recompute, 135 KB, are below its parameters' 180 KB: the gradients share the
  outputs' buffers, which the optimizer's elementwise update may write in place).
* ``stored``: what one block keeps for the backward pass, JAX's own residuals (the vjp's) of
  the block under the policy (``ProgramGraph.stored_bytes``).
* ``working``: what the backward pass of one block holds besides the stored blocks, under
  full recompute: its recomputed residuals, the cotangents, the gradients, the head's and
  the loss's temporaries. It is XLA's, read off one compile of the step under full
  recompute (``program_model``); a block that keeps more recomputes less, so its working
  set shrinks by what it keeps (on XLA:CPU a kept value is not held twice: ``predict``'s
  rule for jaxckpt's own layers), down to none.

The full-recompute compile sets ``working``, so that policy's prediction is its measurement;
every other policy's is a prediction (``tests/plan/test_plan_foreign.py`` checks four models'
within 10% of XLA:CPU's peak, with no remat, saving the dots, saving the names).

``plan_fn`` solves the MILP of ``_milp`` over the block's names (``program_graph``): each
saved or recomputed, the cost the FLOPs recomputed, the budget the model above (its
``stored`` the sum of the saved names' bytes), then compiles the chosen policy's step; when
XLA needs more than the budget, that choice is cut and the next cheapest is solved for.
"""

import dataclasses
from collections.abc import Callable, Collection

import jax
import numpy as np

from jaxckpt.plan._devices import DevicePreset, device_preset
from jaxckpt.plan._measure import measure_fn
from jaxckpt.plan._milp import _Program
from jaxckpt.plan._program_graph import Block, ProgramGraph, program_graph
from jaxckpt.plan._solver import CHECK_MARGIN, BudgetError
from jaxckpt.train import MemoryReport

MAX_ATTEMPTS = 8
"""Policies compiled at most by ``plan_fn`` before it settles for full recompute."""
FULL = jax.checkpoint_policies.nothing_saveable


@dataclasses.dataclass(frozen=True)
class FnPrediction:
    """The predicted peak of a step under one policy (see the module): ``total`` is
    ``state + count * stored + working``.

    Example:
        >>> FnPrediction(state=1000, stored=40, count=3, working=60).total
        1180
    """

    state: int
    stored: int
    count: int
    working: int

    @property
    def total(self) -> int:
        return self.state + self.count * self.stored + self.working


def _measure(step_fn: Callable, abstract_args: tuple, target) -> MemoryReport:
    """XLA's memory figures of ``step_fn`` compiled from ``abstract_args`` (``measure_fn``)."""
    return measure_fn(step_fn, *abstract_args, target=target)


@dataclasses.dataclass(frozen=True)
class ProgramModel:
    """A step's memory model (see the module), from its block's graph and one compile.

    Attributes:
        graph: the block's ``ProgramGraph``.
        state: bytes of the step's arguments and outputs, less the donated.
        working: the working set under full recompute (XLA's, from ``full``).
        full: XLA's figures for the step under full recompute.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxckpt import plan
        >>> w = jax.ShapeDtypeStruct((40, 40), jnp.float32)
        >>> x = jax.ShapeDtypeStruct((37, 40), jnp.float32)
        >>> def step_fn(policy):  # one block, applied 3 times
        ...     layer = jax.checkpoint(lambda w, x: jnp.tanh(x @ w), policy=policy)
        ...     return jax.grad(lambda w, x: layer(w, layer(w, layer(w, x))).sum())
        >>> model = plan.program_model(step_fn, plan.Block(lambda w, x: jnp.tanh(x @ w), (w, x), 3), w, x)
        >>> model.predict([]).total == model.full.peak  # the compile the working set is read from
        True
    """

    graph: ProgramGraph
    state: int
    working: int
    full: MemoryReport

    @property
    def count(self) -> int:
        return self.graph.block.count

    @classmethod
    def read_off(cls, graph: ProgramGraph, full: MemoryReport) -> "ProgramModel":
        """The model of a step whose figures under full recompute are ``full`` (however
        compiled: ``measure_fn``, or ``plan.measure`` for jaxckpt's own train step)."""
        state = full.argument + full.output - full.alias
        working = full.peak - state - graph.block.count * graph.full_stored_bytes
        return cls(graph, state, max(working, 0), full)

    def predict(self, policy: "Callable | Collection[str] | None") -> FnPrediction:
        """The predicted peak under ``policy``: a ``jax.checkpoint`` policy, a collection of
        the block's names to save (``ProgramGraph.policy``), or None for no remat.

        Raises:
            ValueError: for a name that is not the block's.
        """
        if policy is not None and not callable(policy):
            policy = self.graph.policy(policy)
        stored = self.graph.stored_bytes(policy)
        kept_more = stored - self.graph.full_stored_bytes
        return FnPrediction(self.state, stored, self.count, max(self.working - kept_more, 0))


def program_model(step_fn: Callable, block: Block, *abstract_args, target=None) -> ProgramModel:
    """Traces ``block`` and compiles ``step_fn(full recompute)`` once: the model ``plan_fn``
    plans with.

    Args:
        step_fn: the step builder: ``step_fn(policy)`` returns the train step with ``policy``
            as the ``jax.checkpoint`` policy of each block (None: no ``jax.checkpoint``).
        block: the repeated block (``plan.Block``).
        *abstract_args: the step's arguments, ``jax.ShapeDtypeStruct`` pytrees.
        target: None for XLA:CPU; a ``plan.TARGETS`` name compiles for it (``measure_fn``).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxckpt import plan
        >>> w = jax.ShapeDtypeStruct((6, 40, 40), jnp.float32)
        >>> x = jax.ShapeDtypeStruct((37, 40), jnp.float32)
        >>> def layer(w, x):
        ...     return x + jnp.tanh(x @ w)
        >>> def step_fn(policy):
        ...     body = layer if policy is None else jax.checkpoint(layer, policy=policy)
        ...     def loss(w, x):
        ...         return jax.lax.scan(lambda x, w: (body(w, x), None), x, w)[0].sum()
        ...     return lambda w, x: w - 0.1 * jax.grad(loss)(w, x)
        >>> block = plan.Block(layer, (jax.ShapeDtypeStruct((40, 40), jnp.float32), x), count=6)
        >>> model = plan.program_model(step_fn, block, w, x)
        >>> model.predict(None).total > model.predict([]).total  # no remat keeps more
        True
    """
    if not callable(step_fn):
        raise TypeError(f"step_fn must build the step from a policy; got {type(step_fn).__name__}")
    return ProgramModel.read_off(program_graph(block), _measure(step_fn(FULL), abstract_args, target))


@dataclasses.dataclass(frozen=True)
class FnPlan:
    """The answer of ``plan_fn``.

    Attributes:
        save: the block's names saved (the others are recomputed; empty: full recompute);
            None: no remat at all.
        policy: the ``jax.checkpoint`` policy to build the step with (None: no remat).
        budget: bytes. predicted: the model's figures. measured: XLA's (``peak <= budget``).
        recompute_flops: forward FLOPs the backward pass repeats, per step (the graph's).
        attempts: every ``(save, predicted total, measured peak)`` compiled on the way.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxckpt import plan
        >>> w = jax.ShapeDtypeStruct((40, 40), jnp.float32)
        >>> x = jax.ShapeDtypeStruct((37, 40), jnp.float32)
        >>> def step_fn(policy):
        ...     layer = jax.checkpoint(lambda w, x: jnp.tanh(x @ w), policy=policy)
        ...     return jax.grad(lambda w, x: layer(w, layer(w, layer(w, x))).sum())
        >>> block = plan.Block(lambda w, x: jnp.tanh(x @ w), (w, x), 3)
        >>> p = plan.plan_fn(step_fn, block, w, x, budget=2**20)
        >>> p.save is None, p.policy is None  # it all fits: no remat
        (True, True)
    """

    save: "frozenset[str] | None"
    policy: "Callable | None"
    budget: int
    predicted: FnPrediction
    measured: MemoryReport
    recompute_flops: int
    attempts: tuple

    def to_dict(self) -> dict:
        """The plan's figures, JSON-ready."""
        return {
            "save": None if self.save is None else sorted(self.save),
            "budget": self.budget,
            "predicted_bytes": self.predicted.total,
            "measured_bytes": self.measured.peak,
            "recompute_flops": self.recompute_flops,
        }


def _solve(model: ProgramModel, budget: int, device: DevicePreset, exclude) -> "frozenset[str] | None":
    """The names to save at least recompute whose predicted peak is within ``budget``."""
    graph, names = model.graph.graph, list(model.graph.names)
    program = _Program(graph, names, "int8")
    program.add_recompute_rules(offload=False, boundary=False)
    n, x = model.count, graph.values["x"].nbytes
    room = budget - model.state - n * x
    keep = {program.keep[t]: program.tag_bytes[t] for t in names}
    # state + n (x + K) + max(working - K, 0) <= budget, K the saved names' bytes
    program.constraint({i: (n - 1) * k for i, k in keep.items()}, -np.inf, room - model.working)
    program.constraint({i: n * k for i, k in keep.items()}, -np.inf, room)
    for saved in exclude:  # differ from each excluded choice in one name at least
        coefs = {program.keep[t]: (-1.0 if t in saved else 1.0) for t in names}
        program.constraint(coefs, 1 - len(saved & set(names)), np.inf)
    chosen = program.choose(device)
    if chosen is None:
        return None
    return frozenset(t for t in names if chosen[program.keep[t]])


def plan_fn(
    step_fn: Callable,
    block: Block,
    *abstract_args,
    budget: int,
    target=None,
    device: "str | DevicePreset" = "cpu",
    model: "ProgramModel | None" = None,
) -> FnPlan:
    """The remat policy of least recompute whose compiled step fits ``budget`` bytes.

    No remat is taken when it fits. Otherwise the MILP picks the block's names to save (see
    the module); each choice is compiled, and one XLA finds over the budget is cut and the
    next cheapest solved for; full recompute is the last resort.

    Args:
        step_fn: the step builder: ``step_fn(policy)`` is the train step with ``policy`` the
            ``jax.checkpoint`` policy of each block (None: no ``jax.checkpoint``).
        block: the repeated block (``plan.Block``: its function, abstract arguments, count).
        *abstract_args: the step's arguments, ``jax.ShapeDtypeStruct`` pytrees.
        budget: bytes.
        target: None plans for XLA:CPU; a ``plan.TARGETS`` name compiles for that target
            (the model's working set is then that compiler's).
        device: a ``DEVICES`` name or ``DevicePreset``: prices the recompute.
        model: this step's ``program_model`` (for the same ``target``), to reuse its
            full-recompute compile; None builds it.

    Returns:
        An ``FnPlan`` whose ``measured.peak <= budget``; build the step with ``plan.policy``.

    Raises:
        ValueError: for a budget that is not a positive int.
        BudgetError: for a budget below the step's peak under full recompute (XLA's, in
            ``minimum_bytes``).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxckpt import plan
        >>> w = jax.ShapeDtypeStruct((6, 40, 40), jnp.float32)
        >>> x = jax.ShapeDtypeStruct((37, 40), jnp.float32)
        >>> def layer(w, x):
        ...     return x + jnp.tanh(x @ w)
        >>> def step_fn(policy):
        ...     body = layer if policy is None else jax.checkpoint(layer, policy=policy)
        ...     def loss(w, x):
        ...         return jax.lax.scan(lambda x, w: (body(w, x), None), x, w)[0].sum()
        ...     return lambda w, x: w - 0.1 * jax.grad(loss)(w, x)
        >>> block = plan.Block(layer, (jax.ShapeDtypeStruct((40, 40), jnp.float32), x), count=6)
        >>> p = plan.plan_fn(step_fn, block, w, x, budget=2**20)
        >>> p.measured.peak <= 2**20
        True
    """
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"plan_fn: budget={budget!r} must be a positive int (bytes)")
    device = device_preset(device) if isinstance(device, str) else device
    if model is None:
        model = program_model(step_fn, block, *abstract_args, target=target)
    elif model.graph.block is not block:
        raise ValueError("plan_fn: model= was built for another block; pass the block it was built from")
    graph = model.graph
    attempts = []

    def found(save, policy, measured) -> FnPlan:
        flops = 0 if save is None else block.count * graph.graph.recompute_flops(save)
        predicted = model.predict(policy)
        return FnPlan(save, policy, budget, predicted, measured, flops, tuple(attempts))

    def attempt(save, policy) -> MemoryReport:
        measured = model.full if policy is FULL else _measure(step_fn(policy), abstract_args, target)
        attempts.append((save, model.predict(policy).total, measured.peak))
        return measured

    if model.full.peak > budget:
        raise BudgetError(
            f"plan_fn: budget={budget} bytes is below the step's peak under full recompute, "
            f"{model.full.peak} bytes (XLA's): no policy of the block fits",
            model.full.peak,
        )
    if model.predict(None).total <= budget * (1 + CHECK_MARGIN):
        measured = attempt(None, None)
        if measured.peak <= budget:
            return found(None, None, measured)
    excluded: list[frozenset] = []
    for _ in range(MAX_ATTEMPTS):
        save = _solve(model, budget, device, excluded)
        if save is None:
            break
        policy = FULL if not save else graph.policy(save)
        measured = attempt(save, policy)
        if measured.peak <= budget:
            return found(save, policy, measured)
        excluded.append(save)
    return found(frozenset(), FULL, model.full)
