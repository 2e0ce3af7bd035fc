"""The planner on LoRA, QLoRA, optimizer-state dtype and placement, and micro-batching.

The fast checks compile the tiny model a few times; the grid of predicted against measured
peaks over ranks, targets and quantization, and the 7B plans, are slow.
"""

import itertools
import json

import pytest
from flax import nnx
from pairwise_cover import assert_covers_every_pair, grid_params

from jaxckpt import nn, plan, train
from jaxckpt.cli import main

CONFIG = nn.TransformerConfig.preset("tiny", n_layers=3, d_model=48, n_heads=3, n_kv_heads=1, ffn_dim=80)
LORA = CONFIG.replace(lora=nn.LoraConfig(rank=5, targets="q,k,v,o,gate,up,down"), param_dtype="bfloat16")
HALF = CONFIG.replace(dtype="bfloat16")
"""A full fine-tuning with fp32 master weights of a bf16 compute: the placement tests of the
optimizer state and of the masters measure it, so they share its on-device compile."""
BATCH, SEQ = 3, 33


def make_workload(
    config: nn.TransformerConfig, batch: int = BATCH, seq: int = SEQ, **optimizer
) -> plan.Workload:
    """The one place this module builds a ``Workload``; ``optimizer`` are ``train.OptimizerConfig``
    fields (AdamW by default)."""
    return plan.Workload(config, batch, seq, optimizer=train.OptimizerConfig(**optimizer))


def _tree(config, kind):
    model = nnx.eval_shape(lambda: nn.Transformer(config, rngs=nnx.Rngs(0)))
    return plan.tree_bytes(nnx.state(model, kind))


def test_only_the_adapters_have_gradients_and_optimizer_state():
    """Params are the whole model (frozen base and adapters), the gradient and AdamW's moments
    the adapters'; the compiled step holds exactly that state as its arguments."""
    w = make_workload(LORA)
    params, opt = plan.state_bytes(w)
    adapters = _tree(LORA, nnx.LoRAParam)
    assert params == _tree(LORA, ...) and plan.trainable_bytes(w) == adapters
    assert opt == pytest.approx(2 * adapters, abs=64)  # mu, nu (+ counters, the loss scaler)
    predicted = plan.predict(w, "full")
    assert predicted.grads == adapters and predicted.optimizer == opt
    measured = plan.measure(w, "full")
    assert measured.grads == adapters
    assert measured.argument == pytest.approx(params + opt + w.input_bytes, abs=64)
    full = make_workload(CONFIG)
    assert plan.predict(full, "full").grads == _tree(CONFIG, nnx.Param) > 5 * adapters


def test_quantized_base_and_moments_dtype_size_the_state():
    nf4, int8 = (LORA.replace(quantize_base=q) for q in ("nf4", "int8"))
    sizes = {c.quantize_base: plan.state_bytes(make_workload(c))[0] for c in (LORA, nf4, int8)}
    assert sizes["nf4"] < sizes["int8"] < sizes[None]
    _, adamw = plan.state_bytes(make_workload(CONFIG))
    _, bf16 = plan.state_bytes(make_workload(CONFIG, moments_dtype="bfloat16"))
    assert bf16 == pytest.approx(adamw / 2, abs=64)


@pytest.mark.parametrize(
    "config",
    [
        LORA,
        LORA.replace(quantize_base="nf4"),
        pytest.param(CONFIG.replace(lora=nn.LoraConfig(rank=3, targets="q,v")), marks=pytest.mark.slow),
    ],
    ids=["lora-all-bf16", "qlora-nf4", "lora-qv-fp32"],
)
def test_lora_prediction_within_10_percent(config):
    w = make_workload(config)
    assert plan.predict(w, "full").total == pytest.approx(plan.measure(w, "full").peak, rel=0.10)


GRID_MODELS = {"tiny": (2, 256), "small": (2, 512)}
ALL_TARGETS = "q,k,v,o,gate,up,down"
PAIRWISE = [
    (4, "q,k,v,o", None),
    (16, ALL_TARGETS, None),
    (4, ALL_TARGETS, "nf4"),
    (16, "q,k,v,o", "nf4"),
    (4, "q,k,v,o", "int8"),
    (16, ALL_TARGETS, "int8"),
]
"""Every pair of (rank, targets, quantization) values in six rows instead of the twelve of
the full product: each compile is seconds, and the errors differ by factor, not by triple."""
LORA_GRID = [
    *((m, *row, "full") for m in GRID_MODELS for row in PAIRWISE),
    *itertools.product(GRID_MODELS, [16], ["q,k,v,o"], [None, "nf4"], ["save_attn"]),
]  # fmt: skip
"""The full grid (``pytest --grid``): (model, rank, targets, quantization, remat), every model
on every row of ``PAIRWISE`` under full remat, and ``save_attn`` on each model, with and
without a quantized base."""
LORA_COVERING = [
    ("tiny", 4, "q,k,v,o", None, "full"),
    ("small", 16, ALL_TARGETS, None, "full"),
    ("small", 4, ALL_TARGETS, "nf4", "full"),
    ("tiny", 16, "q,k,v,o", "nf4", "full"),
    ("small", 4, "q,k,v,o", "int8", "full"),
    ("tiny", 16, ALL_TARGETS, "int8", "full"),
    ("tiny", 16, "q,k,v,o", "nf4", "save_attn"),
    ("small", 16, "q,k,v,o", None, "save_attn"),
]
"""What ``make test`` runs of ``LORA_GRID``: 8 of its 16 cases, which still meet every pair of
values it meets (``test_the_lora_grid_covers_every_pair``)."""


def test_the_grid_covers_every_pair():
    for i, j in itertools.combinations(range(3), 2):
        pairs = {(row[i], row[j]) for row in PAIRWISE}
        values = [sorted({str(row[k]) for row in PAIRWISE}) for k in (i, j)]
        assert len(pairs) == len(values[0]) * len(values[1])


def test_the_lora_grid_covers_every_pair():
    assert_covers_every_pair(LORA_COVERING, LORA_GRID)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "rank", "targets", "quantize", "remat"), grid_params(LORA_GRID, LORA_COVERING)
)
def test_lora_grid_within_10_percent(model, rank, targets, quantize, remat):
    """Ranks, targets and quantization (``PAIRWISE``), the base in bfloat16 as ``jaxckpt train
    --lora`` stores it."""
    lora = nn.LoraConfig(rank=rank, targets=targets)
    config = nn.TransformerConfig.preset(model, lora=lora, quantize_base=quantize, param_dtype="bfloat16")
    w = make_workload(config, *GRID_MODELS[model])
    assert plan.predict(w, remat).total == pytest.approx(plan.measure(w, remat).peak, rel=0.10)


def test_workload_carries_the_new_dimensions():
    w = make_workload(LORA.replace(quantize_base="int8"), moments_dtype="bfloat16", offload=True)
    assert plan.Workload.from_dict(json.loads(json.dumps(w.to_dict()))) == w
    assert w.optimizer.moments_dtype == "bfloat16" and w.optimizer.offload
    master = make_workload(HALF, offload_master=True)
    assert master.has_master_weights and plan.Workload.from_dict(master.to_dict()) == master


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (dict(moments_dtype="float8"), r"OptimizerConfig: moments_dtype='float8' is not one of float32"),
        (dict(offload_master=True), r"offload_master=True needs fp32 master weights .* lora=True"),
    ],
)
def test_bad_new_fields_are_named(fields, match):
    with pytest.raises(ValueError, match=match):
        make_workload(LORA, **fields)


@pytest.mark.slow  # 2 s or more with the compile cache warm
def test_host_master_weights_are_priced_and_compiled():
    """The masters leave the device (predicted and compiled: ``tests/train/test_train_master.py``
    checks the accuracy on ``small``); the device holds their 16-bit copies."""
    w = make_workload(HALF, offload_master=True)
    on_device = plan.predict(make_workload(HALF), "full")
    on_host = plan.predict(w, "full")
    assert on_host.host == on_device.params and on_host.params == on_device.params // 2
    assert on_host.total < on_device.total
    assert plan.choice(w, "full").transfer_bytes == 2 * on_host.host  # read and written back once a step
    measured = plan.measure(w, "full")
    assert measured.peak < plan.measure(make_workload(HALF), "full").peak
    # the device's arguments: the optimizer state and the tokens, not the masters
    assert measured.argument == pytest.approx(on_host.optimizer + w.input_bytes, abs=64)


def test_offloaded_optimizer_state_leaves_the_device():
    """In host memory the optimizer state is out of the device's peak, measured and predicted
    (XLA:CPU counts it with the device's arguments: ``compile_report`` moves it out), and its
    traffic is priced at the host link. On ``HALF``: its on-device step is the one the master
    weights' test compiles."""
    w, host = make_workload(HALF), make_workload(HALF, offload=True)
    _, opt = plan.state_bytes(w)
    assert plan.measure(w, "full").peak - plan.measure(host, "full").peak == pytest.approx(opt, rel=0.02)
    predicted = plan.predict(host, "full")
    assert predicted.optimizer == 0 and predicted.host == opt
    assert plan.choice(host, "full").transfer_bytes == 2 * opt
    assert plan.choice(host, "full").seconds(plan.DEVICES["ascend-910"]) > plan.choice(w, "full").seconds(
        plan.DEVICES["ascend-910"]
    )


def test_frozen_weights_take_no_weight_gradient_flops():
    full, lora = (make_workload(c) for c in (CONFIG, LORA))
    graph = plan.layer_graph(full)
    assert plan.layer_graph(lora).frozen_flops > 0 == graph.frozen_flops
    assert plan.step_flops(lora) < plan.step_flops(full)


SPLIT = CONFIG.replace(n_layers=1, vocab_size=2048)
"""One layer and a large vocabulary: the logits, which micro-batches halve and remat does not,
dominate the step, so the half batch fits without remat where the whole batch does not fit
even under full remat. The planner then compiles three steps (each half-batch and
whole-batch full remat, the half batch without remat) instead of searching remat specs."""


@pytest.mark.slow
def test_the_batch_is_split_when_it_does_not_fit_whole():
    """Between the split batch's full-remat peak and the whole batch's: only micro-batches fit."""
    w = make_workload(SPLIT, 6, 65)
    split = w.replace(batch=3, micro_batches=2)
    budget = (plan.measure(split, "full").peak + plan.measure(w, "full").peak) // 2
    with pytest.raises(plan.BudgetError, match=r"What would fit: batch=3 micro_batches=2 .* at "):
        plan.plan_memory(w, budget)
    chosen = plan.plan_memory(w, budget, split_batch=True)
    assert chosen.workload == split and chosen.measured.peak <= budget
    assert chosen.to_dict()["micro_batches"] == 2


def test_cli_plans_lora_and_checks_one_preset(capsys):
    code = main([
        "plan", "--model", "tiny", "--batch", "3", "--seq", "33", "--budget", "64MiB", "--lora", "5",
        "--lora-targets", "q,v", "--quantize-base", "nf4", "--moments-dtype", "bfloat16", "--remat", "full",
        "--json",
    ])  # fmt: skip
    result = json.loads(capsys.readouterr().out)
    config = nn.TransformerConfig.preset(
        "tiny", lora=nn.LoraConfig(rank=5, targets="q,v"), quantize_base="nf4", param_dtype="bfloat16"
    )
    w = make_workload(config, 3, 33, moments_dtype="bfloat16")
    assert code == 0 and result["fits"] and result["remat"] == "full"
    assert result["measured_bytes"] == plan.measure(w, "full").peak
    assert result["predicted_bytes"] == plan.predict(w, "full").total


def test_cli_refuses_a_quantized_base_without_lora(capsys):
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "plan",
                "--model",
                "tiny",
                "--batch",
                "1",
                "--seq",
                "16",
                "--budget",
                "1GB",
                "--quantize-base",
                "nf4",
            ]
        )
    assert exc.value.code == 2
    assert "--quantize-base needs --lora R" in capsys.readouterr().err


SEVEN_B = ["plan", "--model", "llama2-7b", "--batch", "1", "--seq", "2048", "--device", "ascend-910"]
"""One sequence of 2048 tokens: full AdamW is over 100 GiB whatever the batch, while LoRA's
step without remat is predicted within the card, so the planner compiles that one spec (at
batch 8 it searched seven); each of the three runs compiles one 7B step."""


@pytest.mark.slow
def test_llama2_7b_fits_one_32gb_card_with_lora_and_qlora(capsys):
    """Full AdamW does not fit and says what would; LoRA r=16 is planned and its spec measured
    within the card; QLoRA's smallest peak is smaller still. Float16: the 910 has no bfloat16."""
    code = main([*SEVEN_B, "--remat", "full", "--json"])
    full = json.loads(capsys.readouterr().out)
    assert code == 1 and not full["fits"] and full["measured_bytes"] > 100 * 2**30
    assert "no bfloat16 on ascend-910: planned in float16" in full["notes"][0]
    code = main([*SEVEN_B, "--lora", "16", "--json"])
    lora = json.loads(capsys.readouterr().out)
    assert code == 0 and lora["chosen"]["measured_bytes"] <= 32 * 10**9
    (compiled,) = [a for a in lora["attempts"] if a["chosen"]]
    assert compiled["measured_bytes"] == lora["chosen"]["measured_bytes"]
    assert lora["config"]["dtype"] == lora["config"]["param_dtype"] == "float16"
    code = main([*SEVEN_B, "--lora", "16", "--quantize-base", "nf4", "--remat", "full", "--json"])
    qlora = json.loads(capsys.readouterr().out)
    assert code == 0 and qlora["measured_bytes"] < 0.7 * lora["rows"][1]["total_bytes"]  # LoRA's full remat
