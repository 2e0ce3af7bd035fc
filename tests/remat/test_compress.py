"""Compressed residuals (``RematSpec.compress``): the int8 / fp8 round trip, the spec's checks,
and the compressed remat of the block stack (an exact forward, gradients within a bound)."""

import dataclasses
import functools
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import remat_cases as rc
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxckpt import _tags, nn, remat, train
from jaxckpt.attention import _flash_vjp
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
    assert c.scales.shape == (n, x.size // d) and c.scales.dtype == jnp.float32  # groups-major
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
    assert c.values.dtype == jnp.int8 and c.scales.shape == (2, 6)  # [groups, rows]
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


# --- the compressed remat of the block stack ------------------------------------------------

SLOW_PRESETS = ("ratio_0.5", "dots", "offload_full")  # 2 to 5 s each, a compile apiece
CASES = [
    pytest.param(preset, fmt, marks=pytest.mark.slow)
    if preset in SLOW_PRESETS or (preset, fmt) == ("full", "int8")  # full with int8: 2.5 s warm
    else (preset, fmt)
    for preset in ("full", "save_attn", "minimal", *SLOW_PRESETS)
    for fmt in FORMATS
]
"""(preset, format) of the bound's test; the slow ones take 2 s or more with the cache warm."""
GRAD_BOUND = {"int8": 1e-2, "fp8": 4e-2}
"""The relative L2 error of the flattened gradient, compressed vs uncompressed, on ``rc``'s
tiny model (5 layers, d=30, B=3, T=13, fp32). Measured (XLA:CPU, the suite's flags):

| preset | int8 | fp8 |
|---|---|---|
| full | 3.0e-3 | 1.3e-2 |
| save_attn | 2.5e-3 | 1.1e-2 |
| minimal | 2.5e-3 | 1.1e-2 |
| ratio_0.5 | 3.1e-3 | 1.2e-2 |
| dots | 2.0e-3 | 8.8e-3 |
| offload_full | 3.0e-3 | 1.3e-2 |

The bounds leave about 3x of margin; a gradient taken at a wrong value (another
layer's input, a tag's value given to another placement) is off by O(1)."""


def _flat(tree) -> jax.Array:
    return jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in jax.tree.leaves(tree)])


def _relative_error(grads, reference) -> float:
    a, b = _flat(grads), _flat(reference)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@functools.cache
def _loss_and_grads(spec: RematSpec):
    return rc.loss_and_grads(rc.model(), spec, rc.tokens())


def _needs_pinned_host(spec: RematSpec):
    if spec.offload and not remat.has_pinned_host():
        pytest.skip(f"no pinned_host memory on {jax.devices()[0].platform}")


@pytest.mark.parametrize(("preset", "fmt"), CASES)
def test_the_forward_is_exact_and_the_gradients_within_the_bound(preset, fmt):
    base = remat.get(preset)
    _needs_pinned_host(base)
    spec = remat.compressed(base, fmt)
    assert spec.compress and Tag.LAYER_INPUT in spec.compress
    loss, grads = _loss_and_grads(spec)
    loss0, grads0 = _loss_and_grads(base)
    np.testing.assert_array_equal(loss, loss0)  # bit for bit: the forward uses the exact values
    error = _relative_error(grads, grads0)
    assert 0 < error <= GRAD_BOUND[fmt], f"{preset} {fmt}: relative gradient error {error:.2e}"


def test_the_mechanism_is_exact_when_the_storage_is(monkeypatch):
    """With a lossless storage (quantize and dequantize the identity) the compressed remat's
    gradients are the uncompressed spec's, up to XLA's fusion rounding (measured 0 to 3e-8):
    each tag's saved value goes to its own placement, the backward runs at the right input,
    and the integer inputs (positions, segment ids) pass through without a cotangent."""
    import jaxckpt.nn._compressed_remat as compressed_remat

    monkeypatch.setattr(compressed_remat, "quantize", lambda x, *args, **kwargs: x)
    monkeypatch.setattr(compressed_remat, "dequantize", lambda x: x)
    model = rc.model()
    tokens = rc.tokens()[:, :-1]
    positions = jnp.tile(jnp.arange(rc.T) % 7, (rc.B, 1))  # two packed documents a row
    segment_ids = (jnp.arange(rc.T) >= 7).astype(jnp.int32)[None].repeat(rc.B, 0)

    @functools.partial(jax.jit, static_argnums=0)
    def loss_and_grads(spec, params):
        def loss(params):
            m = nnx.merge(graphdef, params, rest)
            logits = m(tokens, positions=positions, segment_ids=segment_ids, remat=spec)
            return jnp.mean(jnp.square(logits.astype(jnp.float32)))

        return jax.value_and_grad(loss)(params)

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    base = RematSpec(save=remat.get("minimal").save | {Tag.NORM_OUT})  # norm_out: two placements a layer
    # a group of 7 makes the spec (a static argument) differ from any traced before the patch
    spec = dataclasses.replace(remat.compressed(base, "int8"), compress_group=7)
    (loss, grads), (loss0, grads0) = loss_and_grads(spec, params), loss_and_grads(base, params)
    np.testing.assert_array_equal(loss, loss0)
    assert _relative_error(grads, grads0) <= 1e-6


def _matmuls(spec: RematSpec) -> int:
    """The dot ops of the compiled step of ``_loss_and_grads(spec)`` (the same program)."""
    graphdef, params, rest = nnx.split(rc.model(), nnx.Param, ...)
    compiled = rc._loss_and_grads.lower(graphdef, params, rest, spec, rc.tokens()).compile()
    return len(re.findall(r" dot\(", compiled.as_text()))


def test_a_kept_attention_output_keeps_the_attention_forward_out_of_the_backward():
    """Under ``save_attn`` the backward pass reads the stored attention output (and lse)
    instead of running the attention forward again: the output's matmul (P @ V) is gone
    from the compiled step, as under the uncompressed ``save_attn``, and its other
    matmuls are the uncompressed spec's too (XLA drops the values the stored ones replace)."""
    attn = _matmuls(remat.compressed("save_attn", "int8"))
    assert attn == _matmuls(remat.get("save_attn"))
    assert attn == _matmuls(remat.compressed("full", "int8")) - 1 == _matmuls(remat.get("full")) - 1
    assert _matmuls(remat.compressed("minimal", "int8")) == _matmuls(remat.get("minimal"))


def test_the_tag_helper_leaves_the_uncompressed_program_as_it_was(monkeypatch):
    """With no compressed remat active, ``tag`` is ``checkpoint_name``: the jaxpr of a loss
    and its gradient under ``full`` is the one with ``checkpoint_name`` at every tag."""
    graphdef, params, rest = nnx.split(rc.model(), nnx.Param, ...)

    def jaxpr() -> str:
        fn = lambda p: train.next_token_loss(nnx.merge(graphdef, p, rest), rc.tokens(), "full")
        return str(jax.make_jaxpr(jax.value_and_grad(fn))(params))

    with_helper = jaxpr()
    patched = [m for m in list(sys.modules.values()) if getattr(m, "tag", None) is _tags.tag]
    assert {"jaxckpt.nn._block", "jaxckpt.nn._mlp", "jaxckpt.attention._flash_vjp"} <= {
        m.__name__ for m in patched
    }
    for module in patched:
        monkeypatch.setattr(module, "tag", lambda x, name, record=True: checkpoint_name(x, name))
    monkeypatch.setattr(_flash_vjp, "record", lambda x, name: x)
    assert jaxpr() == with_helper
    assert "name=attn_out" in with_helper and "name=layer_input" in with_helper


def _trace_grads(config: nn.TransformerConfig, spec: RematSpec):
    model = rc.model(config)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    fn = lambda p: train.next_token_loss(nnx.merge(graphdef, p, rest), rc.tokens(), spec)
    return jax.eval_shape(jax.grad(fn), params)


@pytest.mark.parametrize(
    "option, spec, tag",
    [
        ({"mlp_chunk": 5}, remat.compressed("minimal", "int8"), "mlp_up"),
        (
            {"layer_pattern": ("sliding", "full"), "sliding_window": 5},
            remat.compressed("save_attn", "fp8"),
            "attn_out",
        ),
    ],
    ids=["mlp_chunk", "attention_windows"],
)
def test_a_kept_tag_inside_a_loop_of_the_layer_is_refused_by_name(option, spec, tag):
    config = rc.CONFIG.replace(n_layers=2, **option)
    with pytest.raises(ValueError, match=f"compressed remat: the kept tag '{tag}' is placed inside a nested"):
        _trace_grads(config, spec)
    _trace_grads(config, remat.compressed("full", "int8"))  # the boundary alone is fine


def test_describe_shows_the_compressed_tags_and_their_bytes():
    spec = remat.compressed("save_attn", "int8")
    report = remat.describe(rc.model(), (rc.B, rc.T), spec)
    plain = remat.describe(rc.model(), (rc.B, rc.T), "save_attn")
    rows = {r.tag: r for r in report.residuals}
    assert [r.tag for r in report.residuals] == [r.tag for r in plain.residuals]
    x = rows[Tag.LAYER_INPUT]
    assert x.fmt == "int8" and x.nbytes == rc.B * rc.T * rc.CONFIG.d_model * 4
    assert x.stored_nbytes == remat.compressed_bytes(x.shape, x.dtype, "int8") == rc.B * rc.T * (30 + 4)
    assert rows[Tag.ATTN_LSE].fmt is None and rows[Tag.ATTN_LSE].stored_nbytes == rows[Tag.ATTN_LSE].nbytes
    assert report.uncompressed_bytes() == plain.total_bytes() > report.total_bytes()
    text = str(report)
    assert "stored MiB" in text and " int8 " in text and "MiB uncompressed)" in text
    assert "stored MiB" not in str(plain)  # the uncompressed table as it was


# --- compiled for XLA:GPU (deviceless) -------------------------------------------------------


@pytest.mark.slow  # one XLA:GPU compile, about 20 s
@pytest.mark.gpu_compile
def test_xla_gpu_moves_half_the_bytes_to_the_host_for_an_int8_boundary():
    """``offload_full`` with int8 boundaries, XLA:GPU (h100-80g, deviceless), bf16, B=3 T=662
    d=64, 3 layers: the host holds 405,272 bytes, the 3 compressed boundaries (one byte a
    value and a float32 scale a row of 64) and 128 bytes of alignment, 0.53x the 762,624 of
    the bf16 boundaries (``test_offload_boundary``); the device's temp is 7,025,328 bytes
    against 7,142,824."""
    from jaxckpt import plan
    from jaxckpt.plan._compile import compile_report

    bf16 = {"dtype": "bfloat16", "param_dtype": "bfloat16"}
    config = nn.TransformerConfig.preset(
        "tiny",
        d_model=64,
        n_heads=2,
        n_kv_heads=1,
        head_dim=32,
        ffn_dim=96,
        vocab_size=67,
        max_len=1024,
        **bf16,
    )
    batch, seq, n = 3, 662, 3  # test_offload_boundary's step
    workload = plan.Workload(config.replace(n_layers=n), batch, seq)
    spec = remat.compressed("offload_full", "int8")
    report = compile_report(workload, spec, plan.compile_target("h100-80g"))
    stored = remat.compressed_bytes((batch, seq, 64), jnp.bfloat16, "int8")
    assert 0 <= report.host_temp - n * stored <= 16 * 2**10  # XLA:GPU's buffer alignment
    assert report.host_temp <= 0.55 * n * batch * seq * 64 * 2  # the bf16 boundaries
