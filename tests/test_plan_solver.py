"""``plan.plan_memory`` / ``plan.solve``: exact, verified by the compiler, monotone in the budget."""

import itertools

import pytest

from jaxckpt import nn, plan, remat, train
from jaxckpt.remat import RematSpec, Tag

CONFIG = nn.TransformerConfig.preset("tiny", n_layers=2)
BATCH, SEQ = 2, 128
SMALL_TAG_SET = [Tag.NORM_OUT, Tag.Q_PROJ, Tag.ATTN_OUT, Tag.ATTN_LSE, Tag.MLP_UP, Tag.MLP_ACT]


def _brute_force(budget: int, tags) -> int | None:
    """Least recompute over every subset of ``tags`` whose prediction fits."""
    costs = [
        plan.choice(CONFIG, BATCH, SEQ, RematSpec(save=subset)).recompute_flops
        for r in range(len(tags) + 1)
        for subset in itertools.combinations(tags, r)
        if plan.predict(CONFIG, BATCH, SEQ, RematSpec(save=subset)).total <= budget
    ]
    return min(costs, default=None)


def _span() -> tuple[int, int]:
    full = plan.predict(CONFIG, BATCH, SEQ, "full").total
    return full, plan.predict(CONFIG, BATCH, SEQ, RematSpec(save=set(SMALL_TAG_SET))).total


@pytest.mark.parametrize("fraction", [0.0, 0.15, 0.3, 0.5, 0.8, 1.0])
def test_solver_equals_brute_force_on_a_small_tag_set(fraction):
    low, high = _span()
    budget = int(low + fraction * (high - low))
    spec = plan.solve(CONFIG, BATCH, SEQ, budget, tags=SMALL_TAG_SET)
    assert plan.predict(CONFIG, BATCH, SEQ, spec).total <= budget
    assert plan.choice(CONFIG, BATCH, SEQ, spec).recompute_flops == _brute_force(budget, SMALL_TAG_SET)


def test_excluded_specs_give_the_next_cheapest():
    low, high = _span()
    budget = int(low + 0.5 * (high - low))
    first = plan.solve(CONFIG, BATCH, SEQ, budget)
    second = plan.solve(CONFIG, BATCH, SEQ, budget, exclude=[first])
    assert second != first
    costs = [plan.choice(CONFIG, BATCH, SEQ, s).recompute_flops for s in (first, second)]
    assert costs[0] <= costs[1]


def test_plan_memory_is_the_cheapest_spec_that_measures_within_the_budget():
    """A spec predicted slightly over the budget but measured within it is found."""
    spec = remat.PRESETS["minimal"]
    measured = plan.measure(CONFIG, BATCH, SEQ, spec).peak
    chosen = plan.plan_memory(CONFIG, BATCH, SEQ, measured)
    assert chosen.measured.peak <= measured
    assert chosen.recompute_flops <= plan.choice(CONFIG, BATCH, SEQ, spec).recompute_flops


def test_solver_returns_none_below_the_minimum():
    low, _ = _span()
    assert plan.solve(CONFIG, BATCH, SEQ, low - 1) is None


def test_offload_is_chosen_only_when_allowed_and_leaves_device_memory():
    low, high = _span()
    budget = int(low + 0.2 * (high - low))
    on_device = plan.solve(CONFIG, BATCH, SEQ, budget)
    fast_link = plan.DevicePreset("fast-link", 2**40, flops=1e9, host_bandwidth=1e12)
    with_host = plan.solve(CONFIG, BATCH, SEQ, budget, offload=True, device=fast_link)
    assert not on_device.offload and with_host.offload
    # on an H100 a byte over PCIe costs ~40k FLOPs: recomputing tiny's matmuls is cheaper
    h100 = plan.solve(CONFIG, BATCH, SEQ, budget, offload=True, device=plan.DEVICES["h100-80g"])
    assert not h100.offload
    cheap = plan.choice(CONFIG, BATCH, SEQ, with_host)
    assert cheap.recompute_flops < plan.choice(CONFIG, BATCH, SEQ, on_device).recompute_flops
    assert cheap.transfer_bytes > 0 and cheap.predicted.total <= budget


@pytest.mark.slow
def test_budget_sweep_fits_and_recompute_never_rises():
    full = plan.measure(CONFIG, BATCH, SEQ, "full").peak
    none = plan.measure(CONFIG, BATCH, SEQ, "none").peak
    previous = None
    for fraction in (0.0, 0.1, 0.25, 0.5, 0.75, 1.0):
        budget = int(full + fraction * (none - full))
        chosen = plan.plan_memory(CONFIG, BATCH, SEQ, budget)
        assert chosen.measured.peak <= budget
        if previous is not None:
            assert chosen.recompute_flops <= previous
        previous = chosen.recompute_flops
    assert previous == 0  # the no-remat budget is met without remat


@pytest.mark.slow
def test_infeasible_budget_names_the_minimum_and_what_would_fit():
    full = plan.measure(CONFIG, BATCH, SEQ, "full").peak
    with pytest.raises(plan.BudgetError, match="smallest peak") as err:
        plan.plan_memory(CONFIG, BATCH, SEQ, full - 2**20)
    assert err.value.minimum_bytes == full
    assert "What would fit" in str(err.value)
    assert "--devices 2 (FSDP: jaxckpt train --mesh fsdp=2)" in str(err.value)  # the batch of 2 splits


def test_plan_memory_rejects_bad_input():
    with pytest.raises(ValueError, match="batch 2 must be a multiple of devices=3"):
        plan.plan_memory(CONFIG, BATCH, SEQ, 2**30, devices=3)
    with pytest.raises(ValueError, match="budget"):
        plan.plan_memory(CONFIG, BATCH, SEQ, 0)
    with pytest.raises(ValueError, match="headroom"):
        plan.plan_memory(CONFIG, BATCH, SEQ, 2**30, headroom=1.5)


@pytest.mark.slow
def test_remat_auto_trains_under_its_budget():
    budget = plan.measure(CONFIG, BATCH, SEQ, "save_attn").peak + 2**20
    config = CONFIG.replace(remat="auto", budget=budget)
    run = train.train(config, steps=2, batch=BATCH, seq=SEQ, progress=False)
    assert run.plan is not None and run.memory.peak <= budget
    assert run.trainer.spec == run.plan.spec
    assert len(run.steps) == 2 and all(s["loss"] > 0 for s in run.steps)


def test_remat_auto_needs_a_budget_and_the_planner():
    with pytest.raises(ValueError, match="needs a budget"):
        CONFIG.replace(remat="auto")
    with pytest.raises(ValueError, match="planner"):
        remat.get("auto")
    assert CONFIG.replace(remat="auto", budget="30MiB").budget == 30 * 2**20
    with pytest.raises(ValueError, match="budget"):
        CONFIG.replace(budget="lots")


@pytest.mark.parametrize(
    ("text", "expected"),
    [("32GB", 32 * 10**9), ("30GiB", 30 * 2**30), ("4096", 4096), ("1.5 MiB", 1572864), (512, 512)],
)
def test_parse_size(text, expected):
    assert plan.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "12XB", "-3GB", "0", "GB", True])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="size"):
        plan.parse_size(text)


def test_device_presets():
    assert plan.DEVICES["ascend-910"].memory == 32 * 10**9
    assert plan.DEVICES["h200-141g"].memory == 141 * 10**9
    assert set(plan.DEVICES) >= {"ascend-910", "ascend-910b", "a100-40g", "a100-80g", "h100-80g", "cpu"}
    with pytest.raises(ValueError, match="valid devices"):
        plan.device_preset("tpu-v9")


def test_by_cost_thresholds():
    every = remat.by_cost(0, CONFIG, SEQ)
    assert Tag.NORM_OUT in every.save and Tag.Q_PROJ in every.save
    assert remat.by_cost(1e12, CONFIG, SEQ).save == frozenset()
    with pytest.raises(ValueError, match="threshold"):
        remat.by_cost(-1, CONFIG, SEQ)


def test_solver_never_recomputes_more_than_by_cost_at_its_budget():
    for threshold in (1, 10, 50, 100, 1000):
        rule = plan.choice(CONFIG, BATCH, SEQ, remat.by_cost(threshold, CONFIG, SEQ))
        solved = plan.solve(CONFIG, BATCH, SEQ, rule.predicted.total)
        assert plan.choice(CONFIG, BATCH, SEQ, solved).recompute_flops <= rule.recompute_flops
