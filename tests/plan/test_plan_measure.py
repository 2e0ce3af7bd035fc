"""``jaxckpt.plan.measure``: XLA's figures for the real train step, from abstract inputs."""

import jax
import pytest
from flax import nnx

from jaxckpt import nn, plan, remat, train
from jaxckpt.plan import _measure
from jaxckpt.plan._compile import train_step_and_args
from jaxckpt.plan._sharded import compile_in_subprocess

CONFIG = nn.TransformerConfig.preset(
    "tiny", d_model=30, n_layers=3, n_heads=5, n_kv_heads=1, head_dim=6, ffn_dim=22
)
BATCH, SEQ = 3, 17
"""The step the trainer comparison compiles; the optimizer sizes are read at the same shape,
so AdamW's step is compiled once for both."""


def make_workload(
    config=CONFIG, batch: int = BATCH, seq: int = SEQ, devices: int = 1, **optimizer
) -> plan.Workload:
    """The one place this module builds a ``Workload``; ``optimizer`` are ``train.OptimizerConfig``
    fields (AdamW by default)."""
    return plan.Workload(config, batch, seq, optimizer=train.OptimizerConfig(**optimizer), devices=devices)


@pytest.mark.slow  # each case 2 s or more with the compile cache warm
@pytest.mark.parametrize("remat", ["none", "full", "save_attn"])
def test_measure_matches_the_compiled_trainer(remat):
    report = plan.measure(make_workload(), remat=remat)
    trainer = train.Trainer(nn.Transformer(CONFIG, rngs=nnx.Rngs(0)), remat=remat)
    real = train.memory_report(trainer.compile((1, BATCH, SEQ + 1)))
    assert (report.argument, report.output, report.temp, report.alias) == (
        real.argument,
        real.output,
        real.temp,
        real.alias,
    )
    params = plan.tree_bytes(nnx.state(trainer.model, nnx.Param))
    assert report.params == report.grads == params
    assert report.optimizer == pytest.approx(2 * params, rel=0.01)  # AdamW: mu and nu (+ counters)
    assert report.argument >= report.params + report.optimizer
    assert report.activations == report.temp - report.grads
    assert report.peak == report.argument + report.output + report.temp - report.alias


@pytest.mark.slow
def test_measure_is_measure_fn_of_the_train_step():
    """``measure`` is ``measure_fn`` over the step ``train_step_and_args`` builds, labelled with
    the state's sizes (the ``full`` step is the one the test above compiles)."""
    workload = make_workload()
    step, args = train_step_and_args(workload, "full")
    report, direct = plan.measure(workload, remat="full"), plan.measure_fn(step, *args)
    figures = ("argument", "output", "temp", "alias", "peak", "measured_on", "flops")
    assert {f: getattr(report, f) for f in figures} == {f: getattr(direct, f) for f in figures}
    assert direct.params is None and report.params == plan.state_bytes(workload)[0]


@pytest.mark.slow
def test_optimizer_state_sizes():
    sizes = {name: plan.measure(make_workload(name=name), remat="full").optimizer for name in plan.OPTIMIZERS}
    # SGD keeps jaxckpt train's momentum; Adafactor factors no dimension this small (optax: < 128)
    assert max(sizes["sgd"], sizes["adafactor"]) < 0.6 * sizes["adamw"]


@pytest.mark.slow
def test_llama2_7b_is_measured_without_allocating():
    config = nn.TransformerConfig.preset("llama2-7b", n_layers=2)  # the full 32 layers compile alike
    report = plan.measure(make_workload(config, batch=1, seq=128), remat="full")
    params_per_layer = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096
    assert report.params == 4 * (2 * params_per_layer + 2 * 32000 * 4096 + 4096)  # fp32 params
    assert report.peak > 3 * report.params


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(devices=8), ValueError, "Workload: batch=1 must be a multiple of devices=8"),
        (dict(devices=0), ValueError, "Workload: devices=0 must be a positive int"),
        (dict(name="lion"), ValueError, "OptimizerConfig: name='lion' is not one of adamw"),
        (dict(batch=0), ValueError, "Workload: batch=0 must be a positive int"),
        (dict(seq=CONFIG.max_len + 1), ValueError, "exceeds the model's config.max_len"),
    ],
)
def test_workload_rejects_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        make_workload(**{**dict(batch=1, seq=8), **kwargs})


@pytest.mark.parametrize(
    "workload, remat, error, match",
    [
        (make_workload(batch=1, seq=8), "nope", ValueError, "unknown remat preset"),
        (CONFIG, "full", TypeError, "measure: workload must be a plan.Workload, got TransformerConfig"),
    ],
)
def test_measure_rejects_bad_input(workload, remat, error, match):
    with pytest.raises(error, match=match):
        plan.measure(workload, remat)


def test_measure_goes_to_a_subprocess_for_more_devices_than_this_process_has(monkeypatch):
    asked = []
    stub = lambda w, spec: asked.append((w, spec)) or "report"
    monkeypatch.setattr(_measure, "compile_in_subprocess", stub)
    many = make_workload(batch=2 * len(jax.devices()), seq=8, devices=2 * len(jax.devices()))
    assert plan.measure(many, "full") == "report"
    assert asked == [(many, remat.get("full"))]


@pytest.mark.slow
def test_the_subprocess_compile_gives_the_in_process_figures():
    """The worker (``python -m jaxckpt.plan._sharded``) compiles the same FSDP step: a fresh
    process with 2 simulated CPU devices reports what this 8-device process measures."""
    workload = make_workload(batch=4, seq=16, devices=2)
    spec = remat.get("save_attn")
    assert compile_in_subprocess(workload, spec) == plan.measure(workload, spec)
