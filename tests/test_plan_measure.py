"""``jaxckpt.plan.measure``: XLA's figures for the real train step, from abstract inputs."""

import pytest
from flax import nnx

from jaxckpt import nn, plan, train

CONFIG = nn.TransformerConfig.preset(
    "tiny", d_model=30, n_layers=3, n_heads=5, n_kv_heads=1, head_dim=6, ffn_dim=22
)


@pytest.mark.parametrize("remat", ["none", "full", "save_attn"])
def test_measure_matches_the_compiled_trainer(remat):
    report = plan.measure(CONFIG, batch=3, seq=17, remat=remat)
    trainer = train.Trainer(nn.Transformer(CONFIG, rngs=nnx.Rngs(0)), remat=remat)
    real = train.memory_report(trainer.compile((1, 3, 18)))
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


def test_optimizer_state_sizes():
    sizes = {
        name: plan.measure(CONFIG, batch=1, seq=8, remat="full", optimizer=name).optimizer
        for name in plan.OPTIMIZERS
    }
    assert sizes["sgd"] < sizes["adafactor"] < sizes["adamw"]


def test_llama2_7b_is_measured_without_allocating():
    config = nn.TransformerConfig.preset("llama2-7b", n_layers=2)  # the full 32 layers compile alike
    report = plan.measure(config, batch=1, seq=128, remat="full")
    params_per_layer = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096
    assert report.params == 4 * (2 * params_per_layer + 2 * 32000 * 4096 + 4096)  # fp32 params
    assert report.peak > 3 * report.params


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(devices=8), ValueError, "batch 1 must be a multiple of devices=8"),
        (dict(devices=0), ValueError, "devices must be a positive int"),
        (dict(optimizer="lion"), ValueError, "unknown optimizer 'lion'"),
        (dict(batch=0), ValueError, "batch must be a positive int"),
        (dict(seq=CONFIG.max_len + 1), ValueError, "max_len"),
        (dict(remat="nope"), ValueError, "unknown remat preset"),
    ],
)
def test_measure_rejects_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        plan.measure(CONFIG, **{**dict(batch=1, seq=8, remat="full"), **kwargs})
