"""The analytic model (``plan.predict``, ``plan.layer_graph``) against XLA's compiled figures."""

import itertools

import jax.numpy as jnp
import pytest
from flax import nnx

from jaxckpt import nn, plan, remat
from jaxckpt.remat import Tag
from jaxckpt.remat._residuals import saved_residuals

CONFIGS = {
    "tiny": (nn.TransformerConfig.preset("tiny"), 2, 256),
    "small": (nn.TransformerConfig.preset("small"), 2, 512),
}
ON_CPU = [name for name, spec in remat.PRESETS.items() if not spec.offload]  # CPU has no pinned_host


def _error(config, batch, seq, preset, optimizer="adamw") -> float:
    workload = plan.Workload(config, batch, seq, optimizer=optimizer)
    return plan.predict(workload, preset).total / plan.measure(workload, preset).peak - 1


@pytest.mark.slow
@pytest.mark.parametrize(("config", "preset"), list(itertools.product(CONFIGS, ON_CPU)))
def test_prediction_within_10_percent(config, preset):
    cfg, batch, seq = CONFIGS[config]
    assert abs(_error(cfg, batch, seq, preset)) <= 0.10


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adafactor"])
def test_prediction_for_other_optimizers(optimizer):
    cfg = nn.TransformerConfig.preset("gpt2", n_layers=2)
    assert abs(_error(cfg, 1, 128, "full", optimizer)) <= 0.10


def test_reference_attention_keeps_t_squared_per_layer():
    cfg = nn.TransformerConfig.preset("tiny", attention="reference")
    flash = plan.layer_graph(plan.Workload(cfg.replace(attention="blockwise"), 2, 64)).residual_bytes()
    scores = plan.layer_graph(plan.Workload(cfg, 2, 64)).residual_bytes() - flash
    assert scores >= 2 * 2 * cfg.n_heads * 64 * 64 * 4 - 2**16


def test_residual_bytes_match_jax_saved_residuals():
    """Without remat, the graph's residuals are the ones JAX's autodiff keeps for a block."""
    cfg = nn.TransformerConfig.preset("tiny", d_model=48, n_heads=3, n_kv_heads=1, ffn_dim=80)
    block = nn.Block(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(block)
    x = jnp.ones((2, 40, cfg.d_model), cfg.compute_dtype)
    saved = saved_residuals(lambda x, s: nnx.merge(graphdef, s)(x), x, state)
    kept = [
        r.nbytes
        for r in saved
        if "from the argument s" not in r.src and "(promote_dtype" not in r.src and "_along_last" not in r.src
    ]
    graph = plan.layer_graph(plan.Workload(cfg, 2, 40))
    # JAX also lists the reshape of attn_out the output projection reads: the same buffer
    reshape_of_attn_out = graph.values["o"].nbytes
    assert graph.residual_bytes() == pytest.approx(sum(kept) - reshape_of_attn_out, rel=0.02)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_recompute_flops_fall_as_tags_are_saved(family):
    cfg = nn.TransformerConfig.preset("tiny" if family == "llama" else "gpt2", n_layers=1)
    graph = plan.layer_graph(plan.Workload(cfg, 1, 64))
    full = graph.recompute_flops(set())
    assert 0 < full <= graph.forward_flops()
    everything = {v.tag for v in graph.values.values() if v.tag}
    assert graph.recompute_flops(everything) < 0.01 * full  # only norms and activations remain
    for tag in everything:
        assert graph.recompute_flops({tag}) <= full


def test_a_saved_tag_nothing_reads_is_not_stored():
    graph = plan.layer_graph(plan.Workload(nn.TransformerConfig.preset("tiny"), 1, 32))
    assert graph.stored_bytes({Tag.MLP_DOWN}) == graph.stored_bytes(set())


def test_state_bytes_per_dtype_and_optimizer():
    cfg = nn.TransformerConfig.preset("tiny")
    w = plan.Workload(cfg, 1, 8)
    params, adamw = plan.state_bytes(w)
    half, _ = plan.state_bytes(w.replace(config=cfg.replace(param_dtype="bfloat16")))
    assert half == params // 2
    assert adamw == pytest.approx(2 * params, rel=0.01)
    sgd, adafactor = (plan.state_bytes(w.replace(optimizer=o))[1] for o in ("sgd", "adafactor"))
    assert sgd < adafactor < adamw


def test_korthikanti_flash_drops_the_quadratic_term():
    cfg = nn.TransformerConfig.preset("gpt2")
    s, b, h, a = 1024, 2, cfg.d_model, cfg.n_heads
    standard = plan.korthikanti_bytes(cfg, b, s, flash=False)
    assert standard - plan.korthikanti_bytes(cfg, b, s, flash=True) == 5 * a * s * s * b
    assert standard == s * b * h * (34 + 5 * a * s // h)


def test_predict_rejects_bad_input():
    cfg = nn.TransformerConfig.preset("tiny")
    with pytest.raises(ValueError, match="auto"):
        plan.predict(plan.Workload(cfg, 1, 8), "auto")
    with pytest.raises(TypeError, match=r"predict: workload must be a plan\.Workload"):
        plan.predict(cfg, "full")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "attention"), [("gpt2", "blockwise"), ("gpt2", "reference"), ("tiny", "blockwise")]
)
def test_per_layer_residuals_without_remat_match_the_measured_slope(family, attention):
    """One more layer adds what ``residual_bytes`` says (Korthikanti's formula is the baseline;
    it counts 16-bit tensors and dropout masks, so it sits far below an fp32 model)."""
    cfg = nn.TransformerConfig.preset(family, n_layers=2, vocab_size=512, attention=attention)
    two, three = (
        plan.measure(plan.Workload(cfg.replace(n_layers=n), 2, 128), "none").activations for n in (2, 3)
    )
    per_layer = plan.layer_graph(plan.Workload(cfg, 2, 128)).residual_bytes()
    assert per_layer == pytest.approx(three - two, rel=0.05)
