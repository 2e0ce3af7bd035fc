"""The planner on four models written as users write them (``tests/_support/foreign_models``):
its graph read off the program (``plan.program_graph``), its predicted peak against XLA:CPU's
measured one under each preset, and ``plan.plan_fn``'s plan for a budget between the extremes
measured within it.

The presets: no remat, full recompute, saving the dots (``jax.checkpoint_policies``'
``dots_with_no_batch_dims_saveable``), saving every name of the block (its
``checkpoint_name``\\ s, or the names the planner gives an untagged block's primitives).
Full recompute is the compile the model's working set is read from (``program_model``): its
prediction is its measurement by construction, so it is no test of the model and is left
out; the three others are predictions.
"""

import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from foreign_models import MODELS

from jaxckpt import nn, plan, remat

TOLERANCE = 0.10
"""The planner's prediction within 10% of XLA:CPU's peak (issue 35)."""
CP = jax.checkpoint_policies


def _peak(step, args) -> int:
    """XLA:CPU's peak of ``step`` compiled from ``args``: the compiler's own figures, read here."""
    stats = jax.jit(step).lower(*args).compile().memory_analysis()
    return (
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        + stats.temp_size_in_bytes
        - stats.alias_size_in_bytes
    )


@pytest.fixture(scope="module", params=sorted(MODELS))
def case(request):
    """One model, its block, its program model, and its measured peak under each preset."""
    model = MODELS[request.param]()
    block = plan.Block(model.block, model.block_args, model.count)
    program = plan.program_model(model.step_fn, block, *model.args)
    policies = {
        "none": None,
        "dots": CP.dots_with_no_batch_dims_saveable,
        "names": program.graph.policy(program.graph.names),
    }
    measured = {name: _peak(model.step_fn(policy), model.args) for name, policy in policies.items()}
    measured["full"] = program.full.peak  # plan.measure_fn's, the compile the model is read from
    return model, block, program, policies, measured


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["none", "dots", "names"])
def test_prediction_within_ten_percent_of_xla_cpu(case, preset):
    model, _, program, policies, measured = case
    predicted = program.predict(policies[preset]).total
    error = predicted / measured[preset] - 1
    assert abs(error) <= TOLERANCE, (
        f"{model.name} {preset}: predicted {predicted}, measured {measured[preset]}"
    )


@pytest.mark.slow
def test_plan_for_a_budget_between_the_extremes_measures_within_it(case):
    model, block, program, _, measured = case
    budget = (measured["full"] + measured["names"]) // 2
    assert measured["full"] < budget < measured["none"]
    planned = plan.plan_fn(model.step_fn, block, *model.args, budget=budget, model=program)
    assert planned.measured.peak <= budget
    assert planned.save, f"{model.name}: full recompute where {budget} bytes allow more"
    # the plan's step, compiled again here from the policy the plan gives
    assert _peak(model.step_fn(planned.policy), model.args) == planned.measured.peak
    full_flops = model.count * program.graph.graph.recompute_flops(frozenset())
    assert planned.recompute_flops < full_flops


@pytest.mark.slow
def test_names_come_from_the_program(case):
    """A tagged model is planned over its ``checkpoint_name``s; an untagged one over its dots,
    convolutions, activations and norms; each name's bytes are what saving it stores."""
    model, block, program, _, _ = case
    graph = program.graph
    if model.tagged:
        assert {"qkv", "attn_out", "attn_lse", "mlp_hidden", "mlp_act"} <= set(graph.names)
    else:
        kinds = {name.split(":")[0] for name in graph.names}
        assert kinds & {"dot_general", "conv_general_dilated"}, graph.names
    x = block.input_bytes
    for name in graph.names:
        assert graph.stored_bytes(graph.policy([name])) - x == graph.graph.values[name].nbytes > 0


TRANSFORMER = nn.TransformerConfig.preset(
    "tiny", d_model=40, n_heads=5, n_kv_heads=1, head_dim=8, ffn_dim=88, n_layers=3
)


@pytest.mark.slow
def test_jaxckpts_transformer_through_the_program_path():
    """jaxckpt's own step, its ``nn.Block`` traced: the program path's prediction within 10% of
    ``plan.measure`` for the presets between the extremes and without remat (the model read
    off the step's full-recompute figures)."""
    workload = plan.Workload(TRANSFORMER, batch=3, seq=37)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: nn.Block(TRANSFORMER, rngs=nnx.Rngs(0))))
    x = jax.ShapeDtypeStruct((3, 37, TRANSFORMER.d_model), TRANSFORMER.compute_dtype)
    block = plan.Block(lambda s, x: nnx.merge(graphdef, s)(x), (state, x), TRANSFORMER.n_layers)
    model = plan.ProgramModel.read_off(plan.program_graph(block), plan.measure(workload, "full"))
    assert {"q_proj", "attn_out", "mlp_act"} <= set(model.graph.names)
    for preset in ("none", "dots", "save_attn", "minimal"):
        spec = remat.get(preset)
        predicted = model.predict(spec.policy() if spec.enabled else None).total
        measured = plan.measure(workload, preset).peak
        assert abs(predicted / measured - 1) <= TOLERANCE, (preset, predicted, measured)


def test_an_untagged_dot_is_named_and_sized_from_its_shape():
    """``program_graph`` on a plain function: the dot's output, ``[37, 56]`` float32, is what
    saving it stores (the tanh reads it back), its FLOPs ``2 x 37 x 40 x 56``."""
    w = jax.ShapeDtypeStruct((40, 56), jnp.float32)
    v = jax.ShapeDtypeStruct((56, 40), jnp.float32)
    x = jax.ShapeDtypeStruct((37, 40), jnp.float32)
    block = plan.Block(lambda w, v, x: x + jnp.tanh(x @ w) @ v, (w, v, x), count=3)
    graph = plan.program_graph(block)
    assert graph.names == ("dot_general:0", "tanh:0")
    assert graph.graph.values["dot_general:0"].nbytes == 37 * 56 * 4
    assert graph.graph.producer("dot_general:0").flops == 2 * 37 * 40 * 56
    assert graph.graph.producer("tanh:0").inputs == ("dot_general:0",)
    # the second dot's output is read by nothing: no decision
    assert "dot_general:1" not in graph.names
    with pytest.raises(ValueError, match="dot_general:1"):
        graph.policy(["dot_general:1"])


def test_block_checks_its_fields():
    x = jax.ShapeDtypeStruct((3, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"Block\.count"):
        plan.Block(jnp.tanh, (x,), count=0)
    with pytest.raises(ValueError, match=r"Block\.args\[-1\]"):
        plan.Block(lambda p, xs: xs, (x, (x, x)), count=2)
    with pytest.raises(TypeError, match=r"Block\.fn"):
        plan.Block("f", (x,), count=2)
    assert plan.Block(jnp.tanh, (x,), count=2).input_bytes == math.prod(x.shape) * 4


def test_a_budget_below_full_recompute_is_answered_with_its_minimum():
    w = jax.ShapeDtypeStruct((40, 40), jnp.float32)
    x = jax.ShapeDtypeStruct((37, 40), jnp.float32)

    def step_fn(policy):
        layer = jax.checkpoint(lambda w, x: jnp.tanh(x @ w), policy=policy)
        return jax.grad(lambda w, x: layer(w, layer(w, x)).sum())

    block = plan.Block(lambda w, x: jnp.tanh(x @ w), (w, x), 2)
    with pytest.raises(plan.BudgetError, match="below the step's peak under full recompute") as err:
        plan.plan_fn(step_fn, block, w, x, budget=1000)
    assert err.value.minimum_bytes == plan.measure_fn(step_fn(CP.nothing_saveable), w, x).peak
    with pytest.raises(ValueError, match="budget"):
        plan.plan_fn(step_fn, block, w, x, budget=0)
