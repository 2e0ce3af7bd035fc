"""A ``LayerGraph`` read off a program: the user's repeated block, traced to a jaxpr.

``Block`` is the protocol: the block's function, its abstract arguments (its parameters
first, its input last) and how many times the step runs it. ``program_graph`` traces it and
builds the graph the MILP (``_milp``) solves over, with no table written for the model:

* the decisions (a ``LayerGraph`` value each) are the block's ``checkpoint_name``\\ d values;
  a block with no names gets them from its primitives: each dot, convolution, activation
  (``tanh``, ``logistic``, ``erf``, ``exp``) and normalisation statistic (``rsqrt``) whose
  value depends on the input, named ``"<primitive>:<k>"`` (the k-th of that primitive, in
  program order, nested ``jit`` calls inlined). A ``jax.checkpoint`` policy cannot name an
  untagged value; ``ProgramGraph.policy`` recognises it by its primitive, its operands'
  shapes and its parameters, so values alike in all three (two equal convolutions) are one
  decision, named after all of them (``"conv_general_dilated:0+1"``);
* each value's bytes are what JAX itself stores when that name alone is saved
  (``vjp_residuals`` of the block under the policy, minus the
  block's input, which every policy keeps): the autodiff residuals it brings, not a guess;
  a name whose saving stores nothing (nothing reads it back) is left out;
* each value's producer is an op whose inputs are the nearest named values (or the input)
  it is computed from, and whose FLOPs are those of the equations between them (dots and
  convolutions at ``2 x`` their multiply-adds, everything else one FLOP an element;
  ``jit``, ``custom_jvp``, ``custom_vjp`` and loops counted through, loops times their trips).

``ProgramGraph.stored_bytes(policy)`` answers exactly, for any policy, what one block keeps
(``vjp_residuals`` again: the list ``jax.ad_checkpoint.print_saved_residuals`` prints); the
graph's sum over saved names is its linear model, which the MILP needs.
"""

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Collection

import jax
from jax.extend import core

from jaxckpt.plan._graph import LayerGraph, Op, Value
from jaxckpt.remat import Tag

CANDIDATES = frozenset({"dot_general", "conv_general_dilated", "tanh", "logistic", "erf", "exp", "rsqrt"})
"""The primitives whose outputs an untagged block is planned over."""
_MATMULS = frozenset({"dot_general", "conv_general_dilated"})
_INLINED = frozenset({"jit", "pjit"})


@dataclasses.dataclass(frozen=True)
class Block:
    """The protocol: what a model gives the planner about its repeated block.

    Attributes:
        fn: one block's forward pass, ``fn(*args) -> output``: the same computation the step
            runs ``count`` times under ``jax.checkpoint`` (``jax.lax.scan``, ``nnx.scan``,
            ``linen.scan`` or a loop), with its parameters as arguments (for an NNX module:
            ``lambda state, x: nnx.merge(graphdef, state)(x)``).
        args: ``fn``'s abstract arguments (``jax.ShapeDtypeStruct`` pytrees; arrays do too):
            its parameters first, then its input, one array (the remat boundary).
        count: how many blocks one step runs.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxckpt import plan
        >>> w, x = jax.ShapeDtypeStruct((40, 40), jnp.float32), jax.ShapeDtypeStruct((37, 40), jnp.float32)
        >>> block = plan.Block(lambda w, x: x + jnp.tanh(x @ w), (w, x), count=6)
        >>> block.input_bytes
        5920
    """

    fn: Callable
    args: tuple
    count: int

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"Block.fn must be the block's function; got {type(self.fn).__name__}")
        if not isinstance(self.args, tuple) or not self.args:
            raise ValueError("Block.args must be a non-empty tuple: the block's parameters, then its input")
        count = self.count
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"Block.count must be an int >= 1 (blocks per step); got {count!r}")
        leaves = jax.tree.leaves(self.args[-1])
        if len(leaves) != 1 or not hasattr(leaves[0], "shape"):
            raise ValueError(
                "Block.args[-1] must be the block's input, one array (the remat boundary); got "
                f"{len(leaves)} leaves"
            )

    @property
    def input_bytes(self) -> int:
        """Bytes of the block's input: what full recompute keeps of each block."""
        return _nbytes(self.args[-1])


def _nbytes(tree) -> int:
    return sum(math.prod(a.shape) * jax.numpy.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def _aval_bytes(aval) -> int:
    return math.prod(aval.shape) * aval.dtype.itemsize


# ---------------------------------------------------------------- signatures: naming an untagged value


def _param_key(params: dict) -> str:
    return repr(sorted((k, v) for k, v in params.items() if "jaxpr" not in k))


def signature(primitive, avals, params: dict) -> tuple:
    """What a policy sees of an equation: its primitive, its operands' shapes and dtypes, its
    parameters (``jax.checkpoint`` calls a policy as ``policy(prim, *avals, **params)``)."""
    shapes = tuple((tuple(a.shape), str(a.dtype)) for a in avals if hasattr(a, "shape"))
    return (primitive.name, shapes, _param_key(params))


def names_policy(names: Collection[str], signatures: Collection[tuple] = ()) -> Callable:
    """The ``jax.checkpoint`` policy saving the values named ``names`` (``checkpoint_name``)
    and the untagged values of ``signatures``; everything else is recomputed."""
    names, signatures = frozenset(names), frozenset(signatures)

    def policy(prim, *avals, **params) -> bool:
        if prim.name == "name":
            return params["name"] in names
        return bool(signatures) and signature(prim, avals, params) in signatures

    return policy


# ---------------------------------------------------------------- the block's equations, jit inlined


@dataclasses.dataclass(frozen=True)
class _Eqn:
    eqn: object
    inputs: tuple  # ids of the values read (None for a literal)
    outputs: tuple  # ids of the values written


def _flatten(closed) -> tuple[list[_Eqn], list[int]]:
    """The equations of ``closed`` in program order, calls of ``jit`` inlined, and the ids
    of its inputs; every value gets an int id."""
    ids = itertools.count()
    eqns: list[_Eqn] = []

    def walk(jaxpr, env: dict) -> list:
        for eqn in jaxpr.eqns:
            ins = tuple(None if isinstance(v, core.Literal) else env.get(v) for v in eqn.invars)
            if eqn.primitive.name in _INLINED:
                inner = eqn.params["jaxpr"]
                sub = {v: next(ids) for v in inner.jaxpr.constvars}
                sub.update(zip(inner.jaxpr.invars, ins, strict=True))
                outs = walk(inner.jaxpr, sub)
                for v, out in zip(eqn.outvars, outs, strict=True):
                    env[v] = out
                continue
            outs = tuple(next(ids) for _ in eqn.outvars)
            env.update(zip(eqn.outvars, outs, strict=True))
            eqns.append(_Eqn(eqn, ins, outs))
        return [None if isinstance(v, core.Literal) else env.get(v) for v in jaxpr.outvars]

    env = {v: next(ids) for v in closed.jaxpr.constvars}
    inputs = [next(ids) for _ in closed.jaxpr.invars]
    env.update(zip(closed.jaxpr.invars, inputs, strict=True))
    walk(closed.jaxpr, env)
    return eqns, inputs


def subjaxprs(eqn):
    """The jaxprs an equation calls (a scan's body, a cond's branches, a custom_vjp's
    function), from its parameters, each as a plain ``Jaxpr``."""
    for value in eqn.params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            if hasattr(item, "jaxpr") and hasattr(item.jaxpr, "eqns"):
                yield item.jaxpr
            elif hasattr(item, "eqns"):
                yield item


def eqn_flops(eqn) -> int:
    """Forward FLOPs of one equation (see the module)."""
    name = eqn.primitive.name
    if name == "dot_general":
        (contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval
        return 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs.shape[i] for i in contract)
    if name == "conv_general_dilated":
        rhs, out = eqn.invars[1].aval, eqn.outvars[0].aval
        out_features = rhs.shape[eqn.params["dimension_numbers"].rhs_spec[0]]
        return 2 * math.prod(out.shape) * math.prod(rhs.shape) // out_features
    inner = list(subjaxprs(eqn))
    if inner:
        trips = eqn.params.get("length", 1) if name == "scan" else 1
        return trips * sum(eqn_flops(e) for jaxpr in inner for e in jaxpr.eqns)
    sizes = [math.prod(v.aval.shape) for v in (*eqn.invars, *eqn.outvars) if hasattr(v.aval, "shape")]
    return max(sizes, default=0)


def _names_inside(eqn) -> dict[int, str]:
    """For a call of a ``custom_jvp``/``custom_vjp`` function: output index -> the
    ``checkpoint_name`` its inner function gives that output."""
    found = {}
    for jaxpr in subjaxprs(eqn):
        made = {v: e.params["name"] for e in jaxpr.eqns if e.primitive.name == "name" for v in e.outvars}
        for i, v in enumerate(jaxpr.outvars):
            if v in made and i < len(eqn.outvars):
                found[i] = made[v]
    return found


# ---------------------------------------------------------------- the graph


@dataclasses.dataclass(frozen=True)
class ProgramGraph:
    """The planner's view of a ``Block``: its ``LayerGraph`` (one value per decision) and the
    policy that saves a set of its names.

    Attributes:
        block: the block.
        graph: the values (``"x"``: the input; one per name, its ``tag`` the name) and ops.
        signatures: name -> the signatures of the untagged values it stands for (empty for a
            ``checkpoint_name``).
        tagged: whether the names are the block's own ``checkpoint_name``\\ s.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.ad_checkpoint import checkpoint_name
        >>> from jaxckpt import plan
        >>> w, x = jax.ShapeDtypeStruct((40, 40), jnp.float32), jax.ShapeDtypeStruct((37, 40), jnp.float32)
        >>> g = plan.program_graph(plan.Block(lambda w, x: jnp.tanh(checkpoint_name(x @ w, "h")), (w, x), 4))
        >>> g.tagged, g.names, g.stored_bytes(g.policy(["h"])) == 2 * 37 * 40 * 4  # x and h
        (True, ('h',), True)
    """

    block: Block
    graph: LayerGraph
    signatures: dict
    tagged: bool

    @property
    def names(self) -> tuple[str, ...]:
        """The decisions: the names whose saving stores something."""
        return tuple(n for n in self.graph.values if n != "x")

    def policy(self, save: Collection[str]) -> Callable:
        """The ``jax.checkpoint`` policy that saves ``save`` (names of this graph) and
        recomputes the rest.

        Raises:
            ValueError: for a name that is not one of ``names``.
        """
        unknown = sorted(set(save) - set(self.names))
        if unknown:
            raise ValueError(f"policy: {unknown} are not names of this block; its names: {list(self.names)}")
        tags = [n for n in save if not self.signatures.get(n)]
        sigs = [s for n in save for s in self.signatures.get(n, ())]
        return names_policy(tags, sigs)

    @functools.cached_property
    def full_stored_bytes(self) -> int:
        """``stored_bytes`` under full recompute (``nothing_saveable``): the block's input,
        and whatever else JAX cannot recompute."""
        return self.stored_bytes(jax.checkpoint_policies.nothing_saveable)

    def stored_bytes(self, policy: "Callable | None") -> int:
        """Bytes one block keeps for the backward pass under ``policy`` (None: no
        ``jax.checkpoint``, autodiff keeps what it needs), its parameters left out (the step
        holds them anyway): the residuals of its ``jax.vjp`` (``vjp_residuals``)."""
        return _stored_bytes(self.block, policy)


def vjp_residuals(fn: Callable, *args) -> list[tuple[object, "int | None"]]:
    """The residuals autodiff keeps of ``fn(*args)`` for its backward pass: each one's aval
    and, where it is one of ``fn``'s arguments, that argument's flat index (else None).

    What ``jax.ad_checkpoint.print_saved_residuals`` prints, from the public API: the vjp's
    residuals are the leaves of the function ``jax.vjp`` returns. Unlike the printed text
    (``remat._residuals.saved_residuals`` parses it), an argument is known by its position,
    whatever it is called.
    """
    leaves, tree = jax.tree.flatten(args)

    def flat(*leaves):
        return jax.vjp(fn, *jax.tree.unflatten(tree, leaves))

    closed, (_, backward) = jax.make_jaxpr(flat, return_shape=True)(*leaves)
    count = len(jax.tree.leaves(backward))
    residuals = closed.jaxpr.outvars[len(closed.jaxpr.outvars) - count :]
    position = {v: i for i, v in enumerate(closed.jaxpr.invars)}
    return [(r.aval, None if isinstance(r, core.Literal) else position.get(r)) for r in residuals]


def _stored_bytes(block: Block, policy) -> int:
    """Bytes of ``block``'s residuals under ``policy`` but its parameters (see ``stored_bytes``)."""
    fn = jax.checkpoint(block.fn, policy=policy or jax.checkpoint_policies.everything_saveable)
    n_params = len(jax.tree.leaves(block.args[:-1]))
    return sum(
        _aval_bytes(aval)
        for aval, argument in vjp_residuals(fn, *block.args)
        if argument is None or argument >= n_params
    )


def program_graph(block: Block) -> ProgramGraph:
    """Traces ``block`` and builds its graph (see the module).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxckpt import plan
        >>> w, x = jax.ShapeDtypeStruct((40, 40), jnp.float32), jax.ShapeDtypeStruct((37, 40), jnp.float32)
        >>> g = plan.program_graph(plan.Block(lambda w, x: x + jnp.tanh(x @ w), (w, x), count=6))
        >>> g.names, g.graph.values["dot_general:0"].nbytes  # the tanh's output: its derivative is stored
        (('dot_general:0', 'tanh:0'), 5920)
    """
    if not isinstance(block, Block):
        raise TypeError(f"program_graph: block must be a plan.Block; got {type(block).__name__}")
    closed = jax.make_jaxpr(block.fn)(*block.args)
    eqns, inputs = _flatten(closed)
    x_id = inputs[-1]
    tagged = any(e.eqn.primitive.name == "name" or _names_inside(e.eqn) for e in eqns)
    # which values depend on the input, and which decision each one is
    depends = {x_id}
    unit_of: dict[int, str] = {}
    signatures: dict[str, list] = {}
    members: dict[tuple, list[int]] = {}
    counters: dict[str, int] = {}
    for e in eqns:
        if not any(i in depends for i in e.inputs if i is not None):
            continue
        depends.update(e.outputs)
        prim = e.eqn.primitive.name
        if tagged:
            if prim == "name":
                unit_of[e.outputs[0]] = e.eqn.params["name"]
            for i, name in _names_inside(e.eqn).items():
                unit_of[e.outputs[i]] = name
            continue
        if prim not in CANDIDATES:
            continue
        k = counters.get(prim, 0)
        counters[prim] = k + 1
        sig = signature(e.eqn.primitive, [v.aval for v in e.eqn.invars], e.eqn.params)
        members.setdefault(sig, []).append(k)
        unit_of[e.outputs[0]] = sig
    # an untagged decision is named after its members: "conv_general_dilated:0+1" for two alike
    for out, sig in list(unit_of.items()) if not tagged else ():
        name = f"{sig[0]}:" + "+".join(map(str, members[sig]))
        unit_of[out] = name
        signatures[name] = [sig]
    # each decision's producer: its nearest decisions upstream, the equations in between
    front = {x_id: frozenset({"x"})}
    pending = {x_id: frozenset()}
    inputs_of: dict[str, set] = {}
    eqns_of: dict[str, set] = {}
    order: list[str] = []
    for index, e in enumerate(eqns):
        live = [i for i in e.inputs if i is not None and i in front]
        if not live:
            continue
        upstream = frozenset().union(*(front[i] for i in live))
        work = frozenset({index}).union(*(pending[i] for i in live))
        for out in e.outputs:
            name = unit_of.get(out)
            if name is None:
                front[out], pending[out] = upstream, work
                continue
            if name not in inputs_of:
                order.append(name)
            inputs_of.setdefault(name, set()).update(upstream - {name})
            eqns_of.setdefault(name, set()).update(work)
            front[out], pending[out] = frozenset({name}), frozenset()
    x_bytes = block.input_bytes
    x_leaf = jax.tree.leaves(block.args[-1])[0]
    shape = tuple(x_leaf.shape)
    values = {"x": Value("x", Tag.LAYER_INPUT, x_bytes, math.prod(shape[:-1]), shape[-1])}
    sigs = {name: tuple(s) for name, s in signatures.items()}
    for name in order:
        policy = names_policy([] if sigs.get(name) else [name], sigs.get(name, ()))
        nbytes = _stored_bytes(block, policy) - x_bytes
        if nbytes > 0:
            values[name] = Value(name, name, nbytes)
    # names made by the same equations from the same inputs (an attention kernel's output and
    # its log-sum-exp) are one op's outputs
    made: dict[tuple, list[str]] = {}
    for name in order:
        if name in values:
            key = (frozenset(i for i in inputs_of[name] if i in values), frozenset(eqns_of[name]))
            made.setdefault(key, []).append(name)
    ops = tuple(
        Op(
            "make:" + "+".join(names),
            tuple(sorted(inputs)),
            tuple(names),
            sum(eqn_flops(eqns[i].eqn) for i in work),
        )
        for (inputs, work), names in made.items()
    )
    graph = LayerGraph(
        values=values,
        ops=ops,
        reads=frozenset(values),
        internals=0,
        attention_tile=0,
        dtype=str(x_leaf.dtype),
    )
    kept = {name: sigs.get(name, ()) for name in values if name != "x"}
    return ProgramGraph(block, graph, kept, tagged)
