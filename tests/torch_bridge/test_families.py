"""The families people fine-tune, against transformers' own models (random init, odd sizes).

For each family of ``torch_models.FAMILIES``: the fp32 logits of the loaded model match
transformers' within ``LOGITS_ATOL`` with the same argmax; every weight format loads the
same parameters; ``save_hf`` gives transformers back the same model; and a few training
steps under ``full``, ``save_attn`` and ``minimal`` give identical losses (every family under
two presets or more, every feature under every preset: ``REMAT_COVERING``; the full cross
product with ``--grid``).
"""

import json
import os
import subprocess
import sys
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch_models as tm  # noqa: E402

import torch_bridge  # noqa: E402

pytestmark = pytest.mark.torch

LOGITS_ATOL = 1e-4
"""The issue's bound on |ours - transformers'| in fp32 (the tiny models' logits are a few units)."""

MAX_DIFF_FILE = "family_logit_diffs.json"
"""Where ``test_logits_match_transformers`` records each family's largest difference
(under pytest's cache directory, for the closing note's table)."""


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (torch model, its save_pretrained directory), built once per module."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for family in tm.FAMILIES:
        model = tm.tiny_family(family)
        out[family] = (model, tm.save(model, root / family, "safetensors"))
    return out


def _logits(model, ids) -> np.ndarray:
    return np.asarray(model(jnp.asarray(ids, jnp.int32))).astype(np.float32)


@pytest.mark.parametrize("family", tm.FAMILIES)
def test_logits_match_transformers(saved, family, request):
    torch_model, path = saved[family]
    model = torch_bridge.load_hf(path)
    ids = tm.tokens(length=13)
    ours, theirs = _logits(model, ids), tm.torch_logits(torch_model, ids)
    diff = float(np.abs(ours - theirs).max())
    if getattr(request.config, "cache", None) is not None:  # absent under -p no:cacheprovider
        request.config.cache.set(f"jaxckpt/{MAX_DIFF_FILE}/{family}", diff)
    assert diff <= LOGITS_ATOL, f"{family}: max |logits diff| {diff:.2e} > {LOGITS_ATOL}"
    np.testing.assert_array_equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize("fmt", [f for f in tm.FORMATS if f != "safetensors"])
@pytest.mark.parametrize("family", tm.FAMILIES)
def test_every_format_reads_the_same_parameters(saved, tmp_path, family, fmt):
    torch_model, path = saved[family]
    expected = torch_bridge.read_checkpoint(path)
    other = tm.save(torch_model, tmp_path / "ckpt", fmt)
    options = {"config": tmp_path / "ckpt" / "config.json"} if fmt == "pt" else {}
    found = torch_bridge.read_checkpoint(other, **options)
    assert found.config == expected.config
    flat = dict(jax.tree_util.tree_leaves_with_path(expected.params))
    for key, leaf in jax.tree_util.tree_leaves_with_path(found.params):
        np.testing.assert_array_equal(leaf, flat[key], err_msg=jax.tree_util.keystr(key))


@pytest.mark.parametrize("family", tm.FAMILIES)
def test_save_hf_gives_transformers_the_same_model(saved, tmp_path, family):
    torch_model, path = saved[family]
    out = torch_bridge.save_hf(torch_bridge.load_hf(path), tmp_path / "exported")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(reloaded) is type(torch_model)
    theirs = torch_model.state_dict()
    for key, tensor in reloaded.state_dict().items():
        torch.testing.assert_close(tensor, theirs[key], rtol=0, atol=0, msg=key)
    ids = tm.tokens(length=11, seed=3)
    np.testing.assert_array_equal(tm.torch_logits(reloaded, ids), tm.torch_logits(torch_model, ids))
    written = json.loads((out / "config.json").read_text())
    assert torch_bridge.config_from_hf(written) == torch_bridge.config_from_hf(path)


ROPE_VARIANTS = {  # Llama 3.x's other scalings (the grid's llama3 has rope_type llama3)
    "linear": dict(rope_type="linear", rope_theta=500.0, factor=4.0),
    "yarn": dict(rope_type="yarn", rope_theta=500.0, factor=4.0, original_max_position_embeddings=16),
    "yarn-mscale": dict(
        rope_type="yarn", rope_theta=500.0, factor=3.0, mscale=0.7, mscale_all_dim=0.5, beta_fast=16.0
    )
    | dict(beta_slow=2.0, original_max_position_embeddings=16),
}


@pytest.mark.parametrize("variant", ROPE_VARIANTS)
def test_llama_with_every_rope_scaling_matches_transformers(tmp_path, variant):
    config = tm._family_config("llama3")
    config.rope_parameters = ROPE_VARIANTS[variant]
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    torch_model = tm._randomized(transformers.LlamaForCausalLM(config), torch.float32)
    torch_model.save_pretrained(tmp_path / "src")
    model = torch_bridge.load_hf(tmp_path / "src")
    assert model.config.rope_scaling.kind == ROPE_VARIANTS[variant]["rope_type"]
    ids = tm.tokens(length=13)
    assert np.abs(_logits(model, ids) - tm.torch_logits(torch_model, ids)).max() <= LOGITS_ATOL


def test_qwen2_with_its_window_on_in_the_upper_layers_matches_transformers(tmp_path):
    config = tm._family_config("qwen2")
    config.use_sliding_window, config.sliding_window, config.max_window_layers = True, 4, 1
    config.layer_types = ["full_attention"] + ["sliding_attention"] * (config.num_hidden_layers - 1)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    torch_model = tm._randomized(transformers.Qwen2ForCausalLM(config), torch.float32)
    torch_model.save_pretrained(tmp_path / "src")
    model = torch_bridge.load_hf(tmp_path / "src")
    assert model.config.layer_pattern == ("full", "sliding", "sliding") and model.config.sliding_window == 4
    ids = tm.tokens(length=13)
    assert np.abs(_logits(model, ids) - tm.torch_logits(torch_model, ids)).max() <= LOGITS_ATOL


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])  # the released key layout, and transformers 5's
def test_the_text_model_of_a_multimodal_gemma3_loads(tmp_path, fmt):
    torch_model = tm.tiny_gemma3_multimodal()
    path = tm.save(torch_model, tmp_path / "ckpt", fmt)
    options = {"config": tmp_path / "ckpt" / "config.json"} if fmt == "pt" else {}
    converted = torch_bridge.read_checkpoint(path, **options)
    assert converted.config.family == "gemma3" and any(
        "only its language model" in n for n in converted.report.notes
    )
    assert any(key.startswith(("vision_tower", "model.vision_tower")) for key in converted.report.ignored)
    ids = tm.tokens(length=13) % (tm.VOCAB - 3)  # no image tokens
    ours, theirs = _logits(converted.model(), ids), tm.torch_logits(torch_model, ids)
    assert np.abs(ours - theirs).max() <= LOGITS_ATOL


REMAT_CHILD = Path(__file__).resolve().parents[1] / "_support" / "remat_losses_child.py"
REMAT_PRESETS = ("full", "save_attn", "minimal")

FAMILY_FEATURES = {  # what each family of torch_models brings into the block (its comments)
    "llama3": {"llama3_rope", "tied_head"},
    "smollm2": {"tied_head"},
    "qwen2": {"qkv_bias", "untied_head"},
    "qwen3": {"qk_norm", "wide_heads", "untied_head"},  # wide: head_dim != hidden / heads
    "mistral": {"sliding_window", "wide_heads", "untied_head"},
    "gemma2": {"layer_pattern", "softcaps", "sandwich_norm", "wide_heads", "tied_head"},
    "gemma3": {
        "layer_pattern",
        "qk_norm",
        "sandwich_norm",
        "rope_per_kind",
        "linear_rope",
        "wide_heads",
        "tied_head",
    },
    "phi3": {"fused_projections", "partial_rotary", "longrope", "sliding_window", "untied_head"},
    "smollm3": {"nope_layers", "tied_head"},
}

REMAT_COVERING = {family: REMAT_PRESETS for family in tm.FAMILIES} | {
    # each feature of these three families meets every preset in another family
    "smollm2": ("full", "save_attn"),
    "qwen3": ("full", "minimal"),
    "mistral": ("save_attn", "minimal"),
}
"""The (family, preset) runs of ``make test``: every family under two presets or more, and
every pair (feature, preset) in some run; ``--grid`` adds ``REMAT_GRID``."""

REMAT_GRID = {family: REMAT_PRESETS for family, presets in REMAT_COVERING.items() if presets != REMAT_PRESETS}
"""The runs of ``--grid`` (marker ``grid``): the families ``REMAT_COVERING`` leaves a preset out
of, under every preset; with it, the full cross product family x preset."""


def _training_losses(saved, tmp_path, runs: dict) -> dict:
    """``{family: {preset: [loss, ...]}}``: three steps of each ``runs`` family under each of
    its presets, in one child process with XLA's default fusion code generator
    (``remat_losses_child.py`` says why)."""
    spec = {
        "checkpoints": {family: str(saved[family][1]) for family in runs},
        "batch": np.random.default_rng(1).integers(0, tm.VOCAB, (1, 2, 10)).tolist(),  # [M, B, T + 1]
        "remat": {family: list(presets) for family, presets in runs.items()},
        "steps": 3,
    }
    (tmp_path / "in.json").write_text(json.dumps(spec))
    flags = os.environ.get("XLA_FLAGS", "").replace("--xla_cpu_use_fusion_emitters=false", "")
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    args = [sys.executable, str(REMAT_CHILD), str(tmp_path / "in.json"), str(tmp_path / "out.json")]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((tmp_path / "out.json").read_text())


def _assert_identical_and_training(results: dict, runs: dict) -> None:
    assert sorted(results) == sorted(runs)
    for family, losses in results.items():
        assert sorted(losses) == sorted(runs[family]), (family, sorted(losses))
        first, *others = (losses[preset] for preset in runs[family])
        assert all(other == first for other in others), (family, losses)
        assert first[-1] < first[0], (family, losses)  # it trains


@pytest.mark.slow
def test_training_steps_are_identical_under_every_remat(saved, tmp_path):
    """Every family, three steps under two or three presets (``REMAT_COVERING``): the losses
    are bit-identical."""
    _assert_identical_and_training(_training_losses(saved, tmp_path, REMAT_COVERING), REMAT_COVERING)


@pytest.mark.slow
@pytest.mark.grid
def test_training_steps_are_identical_under_every_remat_full_grid(saved, tmp_path):
    """The full cross product's runs beyond ``REMAT_COVERING`` (``REMAT_GRID``)."""
    _assert_identical_and_training(_training_losses(saved, tmp_path, REMAT_GRID), REMAT_GRID)


def test_the_remat_covering_meets_every_family_preset_and_feature_preset_pair():
    assert set(FAMILY_FEATURES) == set(REMAT_COVERING) == set(tm.FAMILIES)
    for presets in REMAT_COVERING.values():
        assert len(presets) >= 2 and set(presets) <= set(REMAT_PRESETS), presets
    met = {
        (feature, preset)
        for family, presets in REMAT_COVERING.items()
        for feature in FAMILY_FEATURES[family]
        for preset in presets
    }
    for family, features in FAMILY_FEATURES.items():  # the features a config shows, as its config has them
        config = tm._family_config(family)
        assert ("tied_head" in features) == config.tie_word_embeddings != ("untied_head" in features), family
        head_dim = getattr(config, "head_dim", None)
        wide = head_dim not in (None, config.hidden_size // config.num_attention_heads)
        assert ("wide_heads" in features) == wide, family
    features = set().union(*FAMILY_FEATURES.values())
    assert met == {(feature, preset) for feature in features for preset in REMAT_PRESETS}
    runs = {
        (family, preset)
        for grid in (REMAT_COVERING, REMAT_GRID)
        for family in grid
        for preset in grid[family]
    }
    assert runs == {(family, preset) for family in tm.FAMILIES for preset in REMAT_PRESETS}  # with --grid
    compared = {frozenset(pair) for presets in REMAT_COVERING.values() for pair in combinations(presets, 2)}
    assert compared == {frozenset(pair) for pair in combinations(REMAT_PRESETS, 2)}


def test_the_grid_covers_every_family_torch_bridge_reads():
    tiny = {tm.tiny_family(f).config.to_dict()["model_type"] for f in tm.FAMILIES}
    covered = {torch_bridge.architecture_of({"model_type": t}).name for t in tiny} | {
        "gpt2"
    }  # gpt2: elsewhere
    readable = {arch.name for arch in torch_bridge.ARCHITECTURES.values() if arch.model_type}
    assert readable <= covered, f"families without a tiny model here: {sorted(readable - covered)}"
