"""Per-layer plans: ``predict_layered`` / ``layered_choices`` price a ``remat.Layered`` stack
from the uniform specs, and ``plan_memory(per_layer=True)`` uses a budget between two specs'
peaks, confirmed by XLA:CPU's compiled memory analysis."""

import functools
import itertools

import pytest

from jaxckpt import nn, plan, remat
from jaxckpt.remat import Layered

# Odd sizes where the activations, not the state, make the differences between specs.
CONFIG = nn.TransformerConfig.preset(
    "tiny",
    d_model=40,
    n_layers=5,
    n_heads=5,
    n_kv_heads=1,
    head_dim=8,
    ffn_dim=72,
    vocab_size=97,
    max_len=256,
)
W = plan.Workload(CONFIG, batch=3, seq=157)
FULL, ATTN = remat.get("full"), remat.get("save_attn")
MIXED = Layered(((2, "save_attn"), (3, "full")))


@functools.cache
def _measured(spec):
    return plan.measure(W, spec)


def test_groups_of_one_spec_are_priced_as_the_uniform_stack():
    assert plan.predict_layered(W, Layered(((2, "full"), (3, "full")))) == plan.predict(W, "full")
    assert plan.predict_layered(W, "save_attn") == plan.predict(W, "save_attn")


def test_a_mixed_stack_is_priced_between_its_specs_and_recomputes_its_share():
    full, attn, mixed = plan.predict(W, FULL), plan.predict(W, ATTN), plan.predict_layered(W, MIXED)
    assert full.total < mixed.total < attn.total
    assert (mixed.params, mixed.grads, mixed.optimizer) == (full.params, full.grads, full.optimizer)
    flops = {s: plan.choice(W, s).recompute_flops for s in (FULL, ATTN)}
    assert plan.choice_layered(W, MIXED).recompute_flops == (2 * flops[ATTN] + 3 * flops[FULL]) // 5


def test_a_spec_of_another_depth_or_that_offloads_is_refused_by_name():
    with pytest.raises(ValueError, match="covers 4 layers; the workload's config has n_layers=5"):
        plan.predict_layered(W, Layered(((1, "full"), (3, "full"))))
    with pytest.raises(ValueError, match=r"group 2 x .* offloads, compresses or is not remat'd"):
        plan.choice_layered(W, Layered(((2, "offload_full"), (3, "full"))))
    with pytest.raises(ValueError, match="per_layer=True mixes uncompressed specs"):
        plan.plan_memory(W, 2**30, per_layer=True, compress="int8")


def test_the_choices_fit_the_budget_cheapest_first_and_use_it():
    """Halfway between ``full`` and ``save_attn`` the cheapest choice is a split that
    recomputes less than ``full``, and every choice is predicted within the budget."""
    budget = (plan.predict(W, FULL).total + plan.predict(W, ATTN).total) // 2
    choices = plan.layered_choices(W, budget, candidates=(ATTN, FULL))
    assert all(c.predicted.total <= budget for c in choices)
    flops = [c.recompute_flops for c in choices]
    assert flops == sorted(flops) and choices[-1].spec == FULL
    best = choices[0]
    assert isinstance(best.spec, Layered) and best.spec.specs == (ATTN, FULL)
    assert best.recompute_flops < plan.choice(W, FULL).recompute_flops
    # one more layer under save_attn would not fit
    k = best.spec.groups[0][0]
    assert plan.predict_layered(W, Layered.of((k + 1, ATTN), (4 - k, FULL))).total > budget


def test_the_uniform_candidates_are_a_frontier():
    specs = plan.uniform_candidates(W, budgets=3)
    priced = [(plan.predict(W, s).total, plan.choice(W, s).recompute_flops) for s in specs]
    assert FULL in specs and all(s.enabled and not s.offload for s in specs)
    assert all(a[0] > b[0] and a[1] < b[1] for a, b in itertools.pairwise(priced))


@pytest.mark.slow  # about 6 s on an idle machine (210 s under a load of 20): four compiled train steps
def test_a_mixed_stack_is_predicted_within_10_percent_of_xla():
    for spec in (MIXED, Layered(((3, "minimal"), (2, "ratio_0.5")))):
        predicted, measured = plan.predict_layered(W, spec).total, _measured(spec).peak
        assert abs(predicted / measured - 1) < 0.10, (spec.describe(), predicted, measured)
    assert _measured(FULL).peak < _measured(MIXED).peak < _measured(ATTN).peak


LONG = plan.Workload(nn.TransformerConfig.preset("tiny"), batch=4, seq=1024)
"""4 layers at T1024, where the layers' activations set the peaks and the model is a few % over
XLA (the step above is under it by up to 10%, so each plan would compile a spec after
another): ``full`` 94.54 MiB predicted, ``save_attn`` 100.73, the budget between them (as
``tests/cli/test_plan_per_layer_cli.py``'s ``jaxckpt plan --per-layer``)."""


@pytest.mark.slow  # two or three compiled train steps (57 s under a load of 35; 482 s before, at T157)
def test_plan_memory_per_layer_fits_and_never_recomputes_more_than_the_uniform_plan():
    """At 95 MiB, between ``full``'s and ``save_attn``'s predicted peaks and ``save_attn``
    more than the 5% margin over it, the per-layer plan is a split of the two that XLA
    confirms, recomputing less than ``full`` and no more than the uniform plan."""
    budget = 95 * 2**20
    uniform = plan.plan_memory(LONG, budget)
    layered = plan.plan_memory(LONG, budget, per_layer=True)
    assert layered.measured.peak <= budget
    assert layered.recompute_flops <= uniform.recompute_flops
    assert layered.recompute_flops < plan.choice(LONG, FULL).recompute_flops
    assert abs(layered.predicted.total / layered.measured.peak - 1) < 0.10
    assert isinstance(layered.spec, Layered) and layered.remat == layered.spec.describe()
    groups = layered.to_dict()["spec"]["groups"]
    assert sum(g["layers"] for g in groups) == LONG.config.n_layers
