"""The planner with compressed residuals (``RematSpec.compress``, issue 34): what ``predict``
and ``choice`` price, the solver's fourth choice (only with ``allow_compress``), and the
prediction against XLA's compiled figures, on XLA:CPU and (``gpu_compile``) XLA:GPU.

The shapes are odd and small; the compiled steps are shared through module fixtures (a spec
compiled once, ``compile_report``'s cache, serves every test that asks for it).
"""

import itertools
from types import SimpleNamespace

import pytest

import jaxckpt.plan._auto as auto
from jaxckpt import nn, plan, remat, train
from jaxckpt.plan._compression import compressed_values, compressible_tags
from jaxckpt.remat import RematSpec, Tag

CPU = plan.Workload(
    nn.TransformerConfig.preset(
        "tiny", d_model=56, n_heads=2, n_kv_heads=2, ffn_dim=120, vocab_size=301, n_layers=16
    ),
    batch=3,
    seq=320,
)
"""fp32 (XLA:CPU keeps bf16 arithmetic in fp32 buffers, which the model leaves out), 16 layers
of d_model 56 at 960 tokens: the layer inputs are a large share of the step, so int8 ones
make room that no uncompressed spec has."""

GPU = plan.Workload(
    nn.TransformerConfig.preset(
        "tiny",
        d_model=96,
        n_heads=3,
        n_kv_heads=1,
        head_dim=32,
        ffn_dim=200,
        vocab_size=301,
        n_layers=3,
        dtype="bfloat16",
        param_dtype="bfloat16",
    ),
    batch=3,
    seq=80,
)
"""bf16, GQA (3 query heads on 1), cuDNN attention on XLA:GPU."""

TARGET = "h100-80g"
INT8 = {name: remat.compressed(name, "int8") for name in ("full", "save_attn", "minimal", "offload_full")}


def _specs_over_budgets(workload, count=12, **options) -> list[tuple[int, RematSpec | None]]:
    """``(budget, solve's answer)`` for ``count`` budgets from ``full`` + int8's predicted peak
    to above ``none``'s."""
    target = options.get("target")
    low = plan.predict(workload, INT8["full"], target=target).total
    high = plan.predict(workload, "none", target=target).total * 1.02
    budgets = [int(low + (high - low) * i / (count - 1)) for i in range(count)]
    return [(budget, plan.solve(workload, budget, **options)) for budget in budgets]


def test_stored_bytes_are_compressed_bytes_of_each_shape():
    config, n = CPU.config, CPU.batch * CPU.seq
    small = remat.compressed_bytes((n, config.d_model), config.compute_dtype, "int8")
    stored, full = plan.compressed_tag_bytes(CPU, INT8["full"])[Tag.LAYER_INPUT]
    assert (stored, full) == (config.n_layers * small, config.n_layers * n * config.d_model * 4)
    saved = plan.predict(CPU, "full").activations - plan.predict(CPU, INT8["full"]).activations
    graph = plan.layer_graph(CPU)
    pad = n * 128 * 4  # the layer input's float32 groups on XLA:CPU: 56 features in a group of 128
    assert saved == full - stored - pad
    # the attention output is tagged per head: groups of head_dim (28) features, one scale a row
    heads = remat.compressed_bytes((n * config.n_heads, config.head_dim), "float32", "int8")
    assert graph.stored_value_bytes("o", "int8") == heads


def test_offloaded_int8_takes_about_half_the_host_link_of_bf16():
    full, small = (
        plan.choice(GPU, "offload_full", target=TARGET),
        plan.choice(GPU, INT8["offload_full"], target=TARGET),
    )
    d = GPU.config.d_model
    assert small.predicted.host_activations / full.predicted.host_activations == pytest.approx(
        (d + 4) / (2 * d)
    )
    assert small.transfer_bytes / full.transfer_bytes == pytest.approx((d + 4) / (2 * d))
    h100 = plan.DEVICES[TARGET]
    assert small.seconds(h100) < full.seconds(h100)  # the link dominates; the quantization is cheap


def test_quantization_is_priced_in_the_step_time():
    config = CPU.config
    c, base = plan.choice(CPU, INT8["full"]), plan.choice(CPU, "full")
    elements = config.n_layers * CPU.batch * CPU.seq * config.d_model
    assert c.compress_flops == plan.COMPRESS_FLOPS * elements and base.compress_flops == 0
    assert c.recompute_flops == base.recompute_flops
    cpu = plan.DEVICES["cpu"]
    assert (
        c.seconds(cpu) - base.seconds(cpu) == pytest.approx(c.compress_seconds(cpu)) and c.compress_bytes > 0
    )


@pytest.mark.parametrize(
    ("workload", "options"),
    [(CPU, {}), (GPU, {"target": TARGET}), (GPU, {"target": TARGET, "offload": True})],
    ids=["cpu", "gpu", "gpu-offload"],
)
def test_solver_never_compresses_without_allow_compress(workload, options):
    asked = _specs_over_budgets(workload, **options)
    assert all(spec is None or not spec.compress for _, spec in asked)
    assert asked[0][1] is None or options.get("offload")  # full + int8's budget: only offload fits
    allowed = _specs_over_budgets(workload, allow_compress=True, **options)
    assert all(spec is not None for _, spec in allowed)
    if not options.get("offload"):  # compression fits what nothing else does (offload might)
        assert allowed[0][1].compress
    for budget, spec in allowed:  # never the lse, and every answer fits its budget as predicted
        assert Tag.ATTN_LSE not in spec.compress
        assert plan.predict(workload, spec, target=options.get("target")).total <= budget


def test_solver_compresses_only_where_the_budget_needs_it():
    full = plan.predict(CPU, "full").total
    below = plan.solve(CPU, full - 1, allow_compress=True)
    assert below is not None and Tag.LAYER_INPUT in below.compress
    roomy = plan.predict(CPU, "none").total  # everything kept fits: nothing to compress
    assert plan.solve(CPU, roomy, allow_compress=True) == plan.solve(CPU, roomy)


def test_solver_keeps_no_nested_tag_when_it_compresses():
    """Under the tiled MLP the MLP's tags sit in a ``lax.map``: a spec that compresses anything
    per layer cannot keep them (the compressed remat refuses them at trace time)."""
    tiled = CPU.replace(config=CPU.config.replace(mlp_chunk=100))
    assert Tag.MLP_UP not in compressible_tags(tiled)
    for _, spec in _specs_over_budgets(tiled, allow_compress=True):
        if spec is not None and spec.compress:
            assert not spec.kept_tags & {Tag.MLP_GATE, Tag.MLP_UP, Tag.MLP_ACT, Tag.MLP_DOWN}, spec


def test_forced_compression_keeps_what_it_keeps_compressed():
    """``compressed_tags`` (``--compress``): every kept tag of the set is stored compressed."""
    budget = plan.predict(CPU, "save_attn").total
    spec = plan.solve(CPU, budget, compress_format="fp8", compressed_tags=set(Tag))
    assert spec.compress and set(spec.compress.values()) == {"fp8"}
    assert spec.compress.keys() == spec.kept_tags - {Tag.ATTN_LSE}
    only = plan.solve(CPU, budget, compressed_tags={Tag.LAYER_INPUT})
    assert dict(only.compress) == {Tag.LAYER_INPUT: "int8"}


SMALL = [Tag.Q_PROJ, Tag.ATTN_OUT, Tag.ATTN_LSE, Tag.MLP_UP]


def _brute_force(workload, budget: int, target=None) -> float | None:
    """Least cost over every way of keeping the ``SMALL`` tags (recomputed, saved, saved in
    int8; never the lse in int8) and the layer inputs (plain or int8) whose prediction fits."""
    device = plan.DEVICES["cpu"]
    best = None
    per_tag = [[None, "save"] + (["int8"] if t != Tag.ATTN_LSE else []) for t in SMALL]
    for choices in itertools.product(*per_tag, [None, "int8"]):
        save = {t for t, c in zip(SMALL, choices, strict=False) if c}
        compress = {t: "int8" for t, c in zip(SMALL, choices, strict=False) if c == "int8"}
        if choices[-1]:
            compress[Tag.LAYER_INPUT] = "int8"
        spec = RematSpec(save=save, compress=compress)
        c = plan.choice(workload, spec, target=target)
        if c.predicted.total <= budget:
            best = c.seconds(device) if best is None else min(best, c.seconds(device))
    return best


@pytest.mark.parametrize("fraction", [0.0, 0.2, 0.45, 0.7, 1.0])
def test_solver_equals_brute_force_with_compression(fraction):
    low = plan.predict(CPU, INT8["full"]).total
    high = plan.predict(CPU, RematSpec(save=set(SMALL))).total
    budget = int(low + fraction * (high - low))
    tags = [*SMALL, Tag.LAYER_INPUT]
    spec = plan.solve(CPU, budget, tags=tags, allow_compress=True)
    assert plan.predict(CPU, spec).total <= budget
    assert set(compressed_values(plan.layer_graph(CPU), spec)) <= {"q", "o", "u", "x"}
    cpu = plan.DEVICES["cpu"]
    assert plan.choice(CPU, spec).seconds(cpu) == pytest.approx(_brute_force(CPU, budget), rel=1e-9)


# -- against the compiler -------------------------------------------------------------------


@pytest.fixture(scope="module")
def on_cpu() -> dict:
    """XLA:CPU's report of each compressed preset of ``CPU``."""
    return {name: plan.measure(CPU, INT8[name]) for name in ("full", "save_attn", "minimal")}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["full", "save_attn", "minimal"])
def test_prediction_within_10_percent_of_xla_cpu(on_cpu, name):
    measured, predicted = on_cpu[name].peak, plan.predict(CPU, INT8[name]).total
    assert abs(predicted / measured - 1) <= 0.10, (name, predicted, measured)


@pytest.mark.slow
def test_planner_compresses_at_a_budget_only_compression_meets(on_cpu):
    """Below ``full``'s peak (the least of every uncompressed spec's on XLA:CPU) the planner
    fits only with ``allow_compress``; it chooses compression, and XLA confirms the fit."""
    budget = on_cpu["full"].peak + 2**14  # full + int8's measured peak, and a little

    assert plan.predict(CPU, "full").total > budget * 1.05  # the solver's margin: no plain spec tried
    with pytest.raises(plan.BudgetError) as refused:  # full remat compiled, and too big
        plan.plan_memory(CPU, budget)
    assert refused.value.measured and refused.value.minimum_bytes > budget
    chosen = plan.plan_memory(CPU, budget, allow_compress=True)
    assert chosen.spec.compress and chosen.measured.peak <= budget
    assert chosen.to_dict()["compressed"][0]["format"] == "int8"


@pytest.fixture(scope="module")
def on_gpu() -> dict:
    """XLA:GPU's report (the larger of its two GEMM emitters') of each compressed preset of ``GPU``."""
    return {
        name: plan.measure(GPU, INT8[name], target=TARGET) for name in ("full", "minimal", "offload_full")
    }


@pytest.mark.gpu_compile
@pytest.mark.parametrize("name", ["full", "minimal", "offload_full"])
def test_prediction_within_10_percent_of_xla_gpu(on_gpu, name):
    measured, predicted = on_gpu[name].peak, plan.predict(GPU, INT8[name], target=TARGET).total
    assert abs(predicted / measured - 1) <= 0.10, (name, predicted, measured)


@pytest.mark.gpu_compile
def test_offloaded_int8_boundaries_are_the_predicted_host_bytes(on_gpu):
    """XLA:GPU reports the offloaded layer inputs as host temporaries: the int8 values and
    their scales, as ``predict`` counts them (about half of the bf16 boundaries)."""
    report = on_gpu["offload_full"]
    host = plan.predict(GPU, INT8["offload_full"], target=TARGET).host_activations
    assert report.host_temp + report.host_argument == host
    assert host < 0.55 * plan.predict(GPU, "offload_full", target=TARGET).host_activations


def test_auto_remat_plans_with_the_runs_compression(monkeypatch):
    """``remat="auto"`` with ``RunConfig.compress``: the planner plans with it, and the resolved
    run's spec carries the compression (its ``compress`` fields cleared)."""
    seen = {}

    def plan_memory(workload, budget, **kwargs):
        seen.update(kwargs)
        return SimpleNamespace(spec=INT8["save_attn"])

    monkeypatch.setattr(auto, "plan_memory", plan_memory)
    run = train.RunConfig(steps=1, batch=3, seq=64, remat="auto", budget="1GiB", compress="int8")
    resolved, _ = plan.resolve_auto(CPU.config, run.replace(compress_tags="attn_out,layer_input"))
    assert seen == {"compress": "int8", "compress_tags": ("attn_out", "layer_input")}
    assert (
        resolved.remat == INT8["save_attn"] and resolved.compress is None and resolved.compress_tags is None
    )
    assert resolved.remat_spec == INT8["save_attn"]
