"""The analytic model (``plan.predict``, ``plan.layer_graph``) against XLA's compiled figures."""

import itertools

import jax.numpy as jnp
import plan_family_cases as pfc
import pytest
from flax import nnx
from pairwise_cover import grid_params

from jaxckpt import nn, plan, remat, train
from jaxckpt.plan._working_set import head_working_set
from jaxckpt.remat import Tag
from jaxckpt.remat._residuals import saved_residuals

CONFIGS = {
    "tiny": (nn.TransformerConfig.preset("tiny"), 2, 256),
    "small": (nn.TransformerConfig.preset("small"), 2, 512),
}
ON_CPU = [name for name, spec in remat.PRESETS.items() if not spec.offload]  # CPU has no pinned_host

FAMILIES = {name: pfc.family_config(name) for name in pfc.FAMILIES}
"""``plan_family_cases``' configs, in bf16 as the presets. The published models compute in
bf16; ``measure`` runs on XLA:CPU, which turns the bf16 residuals it stores into fp32 copies
for the backward pass (a bf16 Llama layer's slope measured 1.9x its residuals), so the grid
against ``measure`` runs these in fp32 and the bf16 residuals are checked against JAX's own
(``test_family_residuals_match_jax_saved_residuals``)."""
FAMILY_BATCH, FAMILY_SEQ = pfc.BATCH, pfc.SEQ


def make_workload(config, batch: int, seq: int, attention=None, **optimizer) -> plan.Workload:
    """The one place this module builds a ``Workload``; ``optimizer`` are ``train.OptimizerConfig``
    fields (AdamW by default)."""
    return plan.Workload(
        config, batch, seq, optimizer=train.OptimizerConfig(**optimizer), attention=attention
    )


def abstract_block(config) -> nn.Block:
    """A block of shapes alone: JAX's saved residuals are read from a trace, and an eager
    init would compile each of its random initialisers (a family's block: 18 compiles)."""
    return nnx.eval_shape(lambda: nn.Block(config, rngs=nnx.Rngs(0)))


def _error(config, batch, seq, preset, optimizer="adamw") -> float:
    workload = make_workload(config, batch, seq, name=optimizer)
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
    cfg = nn.TransformerConfig.preset("tiny")
    flash = plan.layer_graph(make_workload(cfg, 2, 64, attention="blockwise")).residual_bytes()
    scores = plan.layer_graph(make_workload(cfg, 2, 64, attention="reference")).residual_bytes() - flash
    assert scores >= 2 * 2 * cfg.n_heads * 64 * 64 * 4 - 2**16


def test_residual_bytes_match_jax_saved_residuals():
    """Without remat, the graph's residuals are the ones JAX's autodiff keeps for a block."""
    cfg = nn.TransformerConfig.preset("tiny", d_model=48, n_heads=3, n_kv_heads=1, ffn_dim=80)
    graphdef, state = nnx.split(abstract_block(cfg))
    x = jnp.ones((2, 40, cfg.d_model), cfg.compute_dtype)
    saved = saved_residuals(lambda x, s: nnx.merge(graphdef, s)(x), x, state)
    kept = [
        r.nbytes
        for r in saved
        if "from the argument s" not in r.src and "(promote_dtype" not in r.src and "_along_last" not in r.src
    ]
    graph = plan.layer_graph(make_workload(cfg, 2, 40))
    # JAX also lists the reshape of attn_out the output projection reads: the same buffer
    reshape_of_attn_out = graph.values["o"].nbytes
    assert graph.residual_bytes() == pytest.approx(sum(kept) - reshape_of_attn_out, rel=0.02)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_recompute_flops_fall_as_tags_are_saved(family):
    cfg = nn.TransformerConfig.preset("tiny" if family == "llama" else "gpt2", n_layers=1)
    graph = plan.layer_graph(make_workload(cfg, 1, 64))
    full = graph.recompute_flops(set())
    assert 0 < full <= graph.forward_flops()
    everything = {v.tag for v in graph.values.values() if v.tag}
    assert graph.recompute_flops(everything) < 0.01 * full  # only norms and activations remain
    for tag in everything:
        assert graph.recompute_flops({tag}) <= full


def test_a_saved_tag_nothing_reads_is_not_stored():
    graph = plan.layer_graph(make_workload(nn.TransformerConfig.preset("tiny"), 1, 32))
    assert graph.stored_bytes({Tag.MLP_DOWN}) == graph.stored_bytes(set())


def test_state_bytes_per_dtype_and_optimizer():
    cfg = nn.TransformerConfig.preset("tiny")
    w = make_workload(cfg, 1, 8)
    params, adamw = plan.state_bytes(w)
    half, _ = plan.state_bytes(w.replace(config=cfg.replace(param_dtype="bfloat16")))
    assert half == params // 2
    assert adamw == pytest.approx(2 * params, rel=0.01)
    sgd, adafactor = (plan.state_bytes(make_workload(cfg, 1, 8, name=o))[1] for o in ("sgd", "adafactor"))
    assert adafactor < sgd < adamw  # factored statistics; SGD's momentum (jaxckpt train's 0.9)
    assert sgd == pytest.approx(params, rel=0.01)
    bf16_moments = plan.state_bytes(make_workload(cfg, 1, 8, moments_dtype="bfloat16"))[1]
    assert bf16_moments == pytest.approx(params, rel=0.01)  # both AdamW moments in 2 bytes


def test_korthikanti_flash_drops_the_quadratic_term():
    cfg = nn.TransformerConfig.preset("gpt2")
    s, b, h, a = 1024, 2, cfg.d_model, cfg.n_heads
    standard = plan.korthikanti_bytes(cfg, b, s, flash=False)
    assert standard - plan.korthikanti_bytes(cfg, b, s, flash=True) == 5 * a * s * s * b
    assert standard == s * b * h * (34 + 5 * a * s // h)


def test_predict_rejects_bad_input():
    cfg = nn.TransformerConfig.preset("tiny")
    with pytest.raises(ValueError, match="auto"):
        plan.predict(make_workload(cfg, 1, 8), "auto")
    with pytest.raises(TypeError, match=r"predict: workload must be a plan\.Workload"):
        plan.predict(cfg, "full")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "attention"), [("gpt2", "blockwise"), ("gpt2", "reference"), ("tiny", "blockwise")]
)
def test_per_layer_residuals_without_remat_match_the_measured_slope(family, attention):
    """One more layer adds what ``residual_bytes`` says (Korthikanti's formula is the baseline;
    it counts 16-bit tensors and dropout masks, so it sits far below an fp32 model)."""
    cfg = nn.TransformerConfig.preset(family, n_layers=2, vocab_size=512)
    two, three = (
        plan.measure(make_workload(cfg.replace(n_layers=n), 2, 128, attention), "none").activations
        for n in (2, 3)
    )
    per_layer = plan.layer_graph(make_workload(cfg, 2, 128, attention)).residual_bytes()
    assert per_layer == pytest.approx(three - two, rel=0.05)


NEW_OPS = ("qwen3", "gemma2", "gemma3", "phi3", "smollm3")
"""The families whose layers have ops plain LLaMA's have not (q/k norm, post norms, GeGLU,
partial rotary, NoPE): every preset of the grid. The others (tied heads, q/k/v biases, a
window) change no residual of a LLaMA layer, whose presets ``test_prediction_within_10_percent``
covers: ``full`` for them."""
GRID_PRESETS = ("none", "full", "save_attn", "minimal")
FAMILY_GRID = [(f, p) for f in FAMILIES for p in GRID_PRESETS if f in NEW_OPS or p == "full"]
"""The full grid (``pytest --grid``)."""


def new_ops(config: nn.TransformerConfig) -> set[str]:
    """The ops of ``config``'s layers that a plain LLaMA layer has not (read off its fields)."""
    ops = {
        "q/k norm": config.qk_norm,
        "post norms": config.post_norms,
        "GeGLU": config.activation.startswith("geglu"),
        "soft caps": config.attention_softcap is not None or config.logits_softcap is not None,
        "partial rotary": config.rotary_fraction < 1,
        "NoPE": any(kind.endswith("_nope") for kind in config.layer_pattern),
    }
    return {op for op, present in ops.items() if present}


FAMILY_COVERING = [(f, p) for f, p in FAMILY_GRID if f != "qwen3" or p == "full"]
"""What ``make test`` runs of ``FAMILY_GRID``: every family under ``full``, and every new op
under every preset (the pairs of values of (op, preset)); Gemma 3 carries Qwen 3's one new op,
q/k norm, through the presets (``test_the_family_covering_meets_every_op_under_every_preset``),
so Qwen 3's other three presets run under ``--grid``."""


def test_the_family_covering_meets_every_op_under_every_preset():
    assert {f for f in FAMILIES if new_ops(FAMILIES[f])} == set(NEW_OPS)
    met = {(op, p) for f, p in FAMILY_COVERING for op in new_ops(FAMILIES[f])}
    every_op = set().union(*(new_ops(FAMILIES[f]) for f in NEW_OPS))
    assert met == {(op, p) for op in every_op for p in GRID_PRESETS}
    assert {f for f, p in FAMILY_COVERING if p == "full"} == set(FAMILIES)
    assert set(FAMILY_COVERING) <= set(FAMILY_GRID)


@pytest.mark.slow
@pytest.mark.parametrize(("family", "preset"), grid_params(FAMILY_GRID, FAMILY_COVERING))
def test_every_family_predicts_within_10_percent(family, preset):
    config = FAMILIES[family].replace(dtype="float32")
    assert abs(_error(config, FAMILY_BATCH, FAMILY_SEQ, preset)) <= 0.10


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_family_residuals_match_jax_saved_residuals(family, dtype):
    """For each kind of layer of each family, without remat the graph keeps what JAX's
    autodiff keeps: the residuals, and the weights cast to a 16-bit compute dtype."""
    config = FAMILIES[family].replace(dtype=dtype)
    graphdef, state = nnx.split(abstract_block(config))
    x = jnp.ones((2, 40, config.d_model), config.compute_dtype)
    for kind in dict.fromkeys(config.layer_kinds):
        saved = saved_residuals(lambda x, s, kind=kind: nnx.merge(graphdef, s)(x, kind), x, state)
        casts = sum(r.nbytes for r in saved if "(promote_dtype" in r.src)
        kept = sum(
            r.nbytes
            for r in saved
            if not any(src in r.src for src in ("from the argument s", "(promote_dtype", "_along_last"))
        )
        graph = plan.layer_graph(make_workload(config, 2, 40), kind)
        # JAX also lists the reshape of attn_out the output projection reads: the same buffer;
        # Gemma's norms keep their (1 + w), a few hundred bytes
        assert graph.residual_bytes() + graph.values["o"].nbytes == pytest.approx(kept, rel=0.005), kind
        assert casts == (graph.weights if dtype == "bfloat16" else 0)


def test_layer_kinds_share_one_graph():
    """The stack's graph: the bytes of its largest kind, the FLOPs of its mean layer."""
    config = FAMILIES["gemma3"].replace(layer_pattern=("sliding_nope", "sliding", "full"), n_layers=6)
    workload = make_workload(config, 2, 1536)
    stack = plan.layer_graph(workload)
    kinds = {kind: plan.layer_graph(workload, kind) for kind in config.layer_kinds}
    total = sum(kinds[kind].forward_flops() for kind in config.layer_kinds)
    assert config.n_layers * stack.forward_flops() == pytest.approx(total, rel=1e-6)
    assert stack.residual_bytes() == max(g.residual_bytes() for g in kinds.values())
    full, local, nope = (kinds[nn.LAYER_KINDS[name]] for name in ("full", "sliding", "sliding_nope"))
    assert "rope" not in {op.name for op in nope.ops} and "rope" in {op.name for op in local.ops}
    attention = lambda g: next(op.flops for op in g.ops if op.name == "attention")
    visible = sum(min(600, t + 1) for t in range(1536)) / sum(t + 1 for t in range(1536))
    assert attention(local) == attention(nope) == pytest.approx(visible * attention(full), rel=1e-6)


def test_new_ops_carry_their_flops():
    llama = plan.layer_graph(make_workload(FAMILIES["llama3"], 2, 512))
    qwen3 = plan.layer_graph(make_workload(FAMILIES["qwen3"], 2, 512))
    names = lambda g, tags=frozenset(): {op.name for op in g.recompute(g.tagged(tags) | {"x"})}
    assert {"q_norm", "k_norm"} <= names(qwen3)
    saved_qk = names(qwen3, {Tag.Q_PROJ, Tag.K_PROJ})  # the flash backward reads q and k normed and rotated
    assert {"q_norm", "k_norm", "rope"} <= saved_qk and not {"q_proj", "k_proj"} & saved_qk
    assert qwen3.recompute_flops(set()) > llama.recompute_flops(set())
    gemma = FAMILIES["gemma2"]
    capped, uncapped = (
        plan.layer_graph(make_workload(gemma.replace(attention_softcap=cap), 2, 512), nn.LAYER_KINDS["full"])
        for cap in (50.0, None)
    )
    assert capped.forward_flops() > uncapped.forward_flops()
    assert {"post_norm1", "post_norm2"} <= {op.name for op in capped.ops}
    assert Tag.MLP_DOWN in {capped.values[name].tag for name in capped.reads}  # the post norm reads it
    rope = lambda cfg: next(
        op.flops for op in plan.layer_graph(make_workload(cfg, 2, 512)).ops if op.name == "rope"
    )
    phi3 = FAMILIES["phi3"]
    assert rope(phi3) * phi3.head_dim == rope(phi3.replace(rotary_fraction=1.0)) * phi3.rotary_dim


@pytest.mark.parametrize(("dtype", "added"), [("float32", 8), ("bfloat16", 0)])
def test_logit_soft_cap_adds_two_fp32_buffers_unless_16_bit(dtype, added):
    config = FAMILIES["gemma2"].replace(dtype=dtype)
    workload = make_workload(config, 2, 64)
    uncapped = workload.replace(config=config.replace(logits_softcap=None))
    extra = head_working_set(workload) - head_working_set(uncapped)
    assert extra == added * 2 * 64 * config.vocab_size
