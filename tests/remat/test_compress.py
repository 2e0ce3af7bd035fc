"""Compressed residuals (``RematSpec.compress``): the int8 / fp8 round trip, the spec's checks,
and the compressed remat of the block stack (an exact forward, gradients within a bound)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxckpt import remat
from jaxckpt.remat import FORMATS, RematSpec, Tag

# --- the round trip -------------------------------------------------------------------------


def _within_bound(x: jax.Array, fmt: str, group: int) -> None:
    """Every element of the round trip within ``error_bound(fmt)`` of its group's absmax, plus
    the float32 arithmetic (1e-6 relative) and the cast back to ``x``'s dtype."""
    c = remat.quantize(x, fmt, group)
    assert c.values.shape == x.shape and c.dtype == x.dtype
    y = remat.dequantize(c)
    assert y.shape == x.shape and y.dtype == x.dtype
    x32, y32 = np.asarray(x, np.float32), np.asarray(y, np.float32)
    d = x.shape[-1]
    n = -(-d // group)
    assert c.scales.shape == (*x.shape[:-1], n) and c.scales.dtype == jnp.float32
    pad = np.pad(np.abs(x32), [(0, 0)] * (x.ndim - 1) + [(0, n * group - d)])
    absmax = np.repeat(pad.reshape(*x.shape[:-1], n, group).max(-1), group, axis=-1)[..., :d]
    bound = remat.error_bound(fmt)
    cast = float(jnp.finfo(x.dtype).eps) / 2 * np.abs(y32)  # rounding to x's dtype
    allowed = (bound.element * np.abs(x32) + bound.absmax * absmax) * (1 + 1e-6) + cast + 1e-30
    err = np.abs(y32 - x32)
    assert np.all(err <= allowed), f"{fmt}: worst excess {np.max(err - allowed)}"
    return err, err / allowed


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_round_trip_is_within_the_bound_per_group(fmt, dtype):
    # 200 features in groups of 128: the last group is 72 wide; each group its own magnitude
    key = jax.random.key(3)
    x = jax.random.normal(key, (3, 5, 200)) * jnp.logspace(-4, 3, 200)[None, None]
    x = x.at[1, 2, 128:].set(0.0).astype(dtype)  # an all-zero group
    err, used = _within_bound(x, fmt, 128)
    assert np.all(err[1, 2, 128:] == 0)
    assert np.max(used) > 0.4, "the bound is tight: the worst error uses a good part of it"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("group", [1, 7, 128, 1000])
def test_odd_feature_sizes_and_groups(fmt, group):
    x = jax.random.uniform(jax.random.key(group), (7, 13), minval=-3.0, maxval=5.0)
    _within_bound(x, fmt, group)
    c = remat.quantize(x, fmt, group)
    assert (
        c.nbytes
        == remat.compressed_bytes((7, 13), jnp.float32, fmt, group)
        == 7 * 13 + 7 * -(-13 // group) * 4
    )


def test_the_formats_store_one_byte_a_value_and_the_scales():
    c = remat.quantize(jnp.ones((2, 3, 200), jnp.bfloat16), "int8")
    assert c.values.dtype == jnp.int8 and c.scales.shape == (2, 3, 2)
    assert remat.quantize(jnp.ones((4,)), "fp8").values.dtype == jnp.float8_e4m3fn
    assert remat.compressed_bytes((2, 3, 200), jnp.bfloat16, "fp8") == 1200 + 12 * 4
    # a Compressed is a pytree: its arrays are leaves, the rest is static
    leaves, treedef = jax.tree.flatten(c)
    assert len(leaves) == 2 and jax.tree.unflatten(treedef, leaves) == c


def test_int8_is_symmetric_and_clipped():
    x = jnp.array([[-2.0, 2.0, 1.0, -1.0]])
    c = remat.quantize(x, "int8")
    assert c.values.tolist() == [[-127, 127, 64, -64]]  # 63.5 rounds to even
    assert float(c.scales[0, 0]) == np.float32(2.0) / np.float32(127.0)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_non_finite_values_are_refused_eagerly_and_turn_their_group_to_nan_under_jit(fmt, bad):
    x = jnp.ones((2, 9)).at[1, 4].set(bad).at[1, 6].set(bad)
    with pytest.raises(ValueError, match=rf"quantize\('{fmt}'\): x holds 2 non-finite value\(s\)"):
        remat.quantize(x, fmt, 4)
    y = jax.jit(lambda x: remat.dequantize(remat.quantize(x, fmt, 4)))(x)
    assert np.all(np.isnan(y[1, 4:8])), "the group holding it is NaN"
    np.testing.assert_array_equal(np.isnan(y).sum(), 4)  # and only that group
    np.testing.assert_allclose(y[0], 1.0)


def test_the_quantizer_checks_its_arguments():
    with pytest.raises(ValueError, match="format must be one of int8, fp8; got 'int4'"):
        remat.quantize(jnp.ones(3), "int4")
    with pytest.raises(ValueError, match="group must be a positive int, got 0"):
        remat.quantize(jnp.ones(3), "int8", 0)
    with pytest.raises(ValueError, match="only floating activations can be compressed; got int32"):
        remat.quantize(jnp.ones(3, jnp.int32), "int8")
    with pytest.raises(ValueError, match="needs a feature axis"):
        remat.quantize(jnp.float32(1.0), "fp8")


# --- the spec -------------------------------------------------------------------------------


def test_the_spec_normalises_compress_to_a_hashable_mapping():
    spec = RematSpec(save={Tag.ATTN_OUT}, compress={"attn_out": "fp8", Tag.LAYER_INPUT: "int8"})
    assert spec.compress == {Tag.ATTN_OUT: "fp8", Tag.LAYER_INPUT: "int8"}
    assert all(type(t) is Tag for t in spec.compress)
    same = RematSpec(save={"attn_out"}, compress={Tag.LAYER_INPUT: "int8", Tag.ATTN_OUT: "fp8"})
    assert spec == same and hash(spec) == hash(same) and spec.compress_group == 128
    assert spec != RematSpec(save={Tag.ATTN_OUT}) and not RematSpec().compress
    assert {spec: 1}[same] == 1  # a static argument of jit
    with pytest.raises(TypeError):
        spec.compress[Tag.MLP_UP] = "int8"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"compress": {"bogus": "int8"}}, "RematSpec.compress: unknown tag(s) ['bogus']"),
        (
            {"compress": {"layer_input": "int4"}},
            "RematSpec.compress: tag 'layer_input': unknown format 'int4'; valid formats: int8, fp8",
        ),
        (
            {"save": {Tag.ATTN_LSE}, "compress": {Tag.ATTN_LSE: "int8"}},
            "RematSpec.compress: tag 'attn_lse' cannot be compressed: it is the attention's float32",
        ),
        (
            {"compress": {Tag.MLP_UP: "fp8"}},
            "RematSpec.compress: tag 'mlp_up' is recomputed, not kept; add it to save or offload",
        ),
        (
            {"enabled": False, "compress": {Tag.LAYER_INPUT: "int8"}},
            "RematSpec.compress: tag 'layer_input': a disabled spec",
        ),
        (
            {"save_dots": True, "compress": {Tag.LINEAR_OUT: "int8"}},
            "RematSpec.compress: tag 'linear_out': under save_dots jax's dots policy keeps the matmul",
        ),
        (
            {"save": {Tag.MLP_UP}, "layers_per_checkpoint": 2, "compress": {Tag.MLP_UP: "int8"}},
            "RematSpec.compress: tag 'mlp_up' is kept inside a remat segment of layers_per_checkpoint=2",
        ),
        ({"compress_group": 0}, "RematSpec.compress_group must be an int >= 1, got 0"),
    ],
    ids=["unknown_tag", "unknown_format", "lse", "recomputed", "disabled", "dots", "in_segment", "group"],
)
def test_the_spec_refuses_what_it_cannot_compress(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        RematSpec(**kwargs)


def test_compress_takes_a_mapping():
    with pytest.raises(TypeError, match=r"RematSpec\.compress takes a mapping tag -> format"):
        RematSpec(compress="int8")


def test_compressed_compresses_every_kept_tag_that_can_be():
    assert remat.compressed("full", "int8").compress == {Tag.LAYER_INPUT: "int8"}
    attn = remat.compressed("save_attn", "fp8")
    assert attn.compress == {Tag.LAYER_INPUT: "fp8", Tag.ATTN_OUT: "fp8"}  # the lse stays exact
    assert attn.save == remat.get("save_attn").save
    offload = remat.compressed("offload_qkv", "int8")
    assert set(offload.compress) == {Tag.LAYER_INPUT, Tag.Q_PROJ, Tag.K_PROJ, Tag.V_PROJ}
    assert remat.compressed("ratio_0.25", "int8").compress == {Tag.LAYER_INPUT: "int8"}
    assert remat.compressed("dots", "int8").compress == {Tag.LAYER_INPUT: "int8"}
    narrowed = remat.compressed("minimal", "fp8", tags=[Tag.MLP_UP, "q_proj"])
    assert narrowed.compress == {Tag.MLP_UP: "fp8", Tag.Q_PROJ: "fp8"}
    # a second call adds to the first, the named tags taking the new format
    both = remat.compressed(narrowed, "int8", tags=["attn_out", "q_proj"])
    assert both.compress == {Tag.MLP_UP: "fp8", Tag.Q_PROJ: "int8", Tag.ATTN_OUT: "int8"}


def test_compressed_refuses_tags_the_spec_does_not_keep():
    with pytest.raises(ValueError, match="tag 'attn_out' is recomputed, not kept; add it to save or offload"):
        remat.compressed("full", "int8", tags=["attn_out"])
    with pytest.raises(ValueError, match="tag 'attn_lse' cannot be compressed"):
        remat.compressed("save_attn", "int8", tags=[Tag.ATTN_LSE])
    with pytest.raises(ValueError, match=r"remat\.compressed: a disabled spec"):
        remat.compressed("none", "fp8")
    with pytest.raises(ValueError, match="unknown format 'int2'"):
        remat.compressed("full", "int2")
    with pytest.raises(TypeError, match="got the string 'attn_out'"):
        remat.compressed("save_attn", "int8", tags="attn_out")
