"""``jaxckpt.remat``: presets, specs, policies, ``describe``, and numbers unchanged by remat."""

import dataclasses
import functools

import jax
import pytest
import remat_cases as rc

from jaxckpt import remat
from jaxckpt.remat import PRESETS, RematSpec, Tag


def test_every_preset_is_a_spec_and_get_returns_it():
    expected = {"none", "full", "dots", "save_qkv", "save_attn", "minimal", "offload_qkv", "offload_minimal"}
    expected |= {"offload_full", "offload_full_save_attn"}
    assert expected | {"ratio_0.5", "ratio_0.25"} <= set(PRESETS)
    for name, spec in PRESETS.items():
        assert remat.get(name) is spec
        assert remat.get(spec) is spec
        assert callable(spec.policy())
    assert PRESETS["ratio_0.5"].layers_per_checkpoint == 2
    assert PRESETS["ratio_0.25"].layers_per_checkpoint == 4
    assert not PRESETS["none"].enabled


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown remat preset 'fulll'.*save_attn"):
        remat.get("fulll")
    with pytest.raises(TypeError, match="preset name or a RematSpec"):
        remat.get(3)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(save={"q_projj"}), "unknown tag"),
        (dict(save="q_proj"), "collection of tags"),
        (dict(save={Tag.Q_PROJ}, offload={Tag.Q_PROJ}), "both save and offload"),
        (dict(layers_per_checkpoint=0), "layers_per_checkpoint"),
        (dict(layers_per_checkpoint=True), "layers_per_checkpoint"),
    ],
)
def test_bad_spec_is_rejected(kwargs, match):
    with pytest.raises(ValueError if "collection" not in match else TypeError, match=match):
        RematSpec(**kwargs)


def test_spec_accepts_tag_strings():
    assert RematSpec(save=["attn_out"]).save == frozenset({Tag.ATTN_OUT})


def test_offload_without_pinned_host_raises(monkeypatch):
    monkeypatch.setattr("jaxckpt.remat._spec.has_pinned_host", lambda device=None: False)
    with pytest.raises(ValueError, match="pinned_host"):
        PRESETS["offload_qkv"].policy()
    PRESETS["save_qkv"].policy()  # no offload: no memory-space requirement


def test_tag_strings_are_unique():
    values = [t.value for t in Tag]
    assert len(values) == len(set(values))


@pytest.fixture(scope="module")
def none_tags():
    """Tags autodiff saves with no remat at all: the ones a backward pass needs."""
    return remat.describe(rc.model(), (rc.B, rc.T), "none").tags


@pytest.mark.parametrize("name", [n for n in PRESETS if n != "none"])
def test_describe_matches_the_spec(name, none_tags):
    spec = PRESETS[name]
    report = remat.describe(rc.model(), (rc.B, rc.T), name)
    kept = spec.saved_tags | spec.offload
    # Saved: every kept tag the backward pass needs at all (MLP_DOWN only feeds an add).
    assert (kept & none_tags) <= report.tags
    # Recomputed: nothing tagged outside the spec, except each segment's input.
    assert report.tags - kept <= {Tag.LAYER_INPUT}
    assert Tag.LAYER_INPUT in report.tags
    hosted = {r.tag for r in report.residuals if r.where == "host"}
    assert (spec.offload & none_tags) <= hosted <= spec.offload


def test_describe_counts_segments_and_bytes():
    report = remat.describe(rc.model(), (rc.B, rc.T), "ratio_0.5")  # 5 layers: 2 + 2 + 1
    assert [(r.tag, r.count) for r in report.residuals] == [(Tag.LAYER_INPUT, 2), (Tag.LAYER_INPUT, 1)]
    assert report.total_bytes() == 3 * rc.B * rc.T * rc.CONFIG.d_model * 4
    assert "layer_input" in str(report)
    lse = [
        r for r in remat.describe(rc.model(), (rc.B, rc.T), "save_attn").residuals if r.tag == Tag.ATTN_LSE
    ]
    assert lse[0].shape == (rc.B, rc.CONFIG.n_heads, rc.T) and lse[0].count == rc.CONFIG.n_layers


def test_describe_rejects_a_bad_batch():
    with pytest.raises(ValueError, match="batch must be"):
        remat.describe(rc.model(), (3,), "full")


@functools.cache
def _no_remat_loss_and_grads():
    return rc.loss_and_grads(rc.model(), PRESETS["none"], rc.tokens())


_SEGMENT_WITH_SAVES = RematSpec(save={Tag.ATTN_OUT, Tag.ATTN_LSE}, layers_per_checkpoint=3)
_FAST_PRESETS = {"full", "save_attn"}  # a policy that saves nothing and one that saves; the rest are slow


@pytest.mark.parametrize(
    "spec",
    [
        *(
            pytest.param(s, id=n, marks=[] if n in _FAST_PRESETS else [pytest.mark.slow])
            for n, s in PRESETS.items()
        ),
        pytest.param(_SEGMENT_WITH_SAVES, id="segment3_saves_attn", marks=pytest.mark.slow),
    ],
)
def test_remat_never_changes_the_numbers(spec):
    """Every preset (and a 3-layer segment with a save set) gives no-remat's loss and grads."""
    loss0, grads0 = _no_remat_loss_and_grads()
    loss, grads = rc.loss_and_grads(rc.model(), spec, rc.tokens())
    assert abs(float(loss - loss0)) <= 1e-6, spec
    assert rc.max_abs_diff(grads, grads0) <= 1e-6, spec


@pytest.mark.slow
def test_ratio_memory_falls_with_segment_length():
    """Deep and narrow (layer inputs dominate): n_layers / k + k layer inputs are held."""
    config = dataclasses.replace(
        rc.CONFIG, n_layers=16, d_model=64, n_heads=2, head_dim=32, ffn_dim=64, max_len=512
    )
    # Only the compiled memory is read: the model and tokens are abstract (``nnx.eval_shape``),
    # the same shapes and dtypes as the real ones, so no 16-layer init runs op by op.
    model = rc.nnx.eval_shape(lambda: rc.nn.Transformer(config, rngs=rc.nnx.Rngs(0)))
    toks = jax.eval_shape(lambda: rc.tokens(batch=8, seq=512))

    def temp(spec):
        graphdef, params, rest = rc.nnx.split(model, rc.nnx.Param, ...)
        lowered = rc._loss_and_grads.lower(graphdef, params, rest, spec, toks)
        return lowered.compile().memory_analysis().temp_size_in_bytes

    full, half, quarter = (temp(PRESETS[n]) for n in ("full", "ratio_0.5", "ratio_0.25"))
    layer_input = 8 * 512 * 64 * 4
    assert half < full and quarter < half
    assert full - quarter >= 3 * layer_input  # 16 + 1 -> 4 + 4 inputs: at least 3 inputs' worth


def test_policy_offloads_to_pinned_host():
    if not remat.has_pinned_host():
        pytest.skip("no pinned_host memory here")
    loss0, _ = rc.loss_and_grads(rc.model(), PRESETS["full"], rc.tokens())
    loss1, _ = rc.loss_and_grads(rc.model(), PRESETS["offload_minimal"], rc.tokens())
    assert float(loss0) == pytest.approx(float(loss1), abs=1e-6)
    assert jax.devices()[0].platform in {"cpu", "gpu", "tpu"}
