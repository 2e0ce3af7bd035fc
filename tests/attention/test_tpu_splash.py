"""``implementation="splash"``: JAX's Splash attention kernel.

Compiled by XLA:TPU for TPU targets without a TPU (``tpu_compile``; skipped without
libtpu): forward and backward for every target, what the HLO holds (the Splash
``tpu_custom_call`` kernels by name, no ``[T, S]`` buffer), named residuals under
``save_attn``, the sharded train step (the kernel inside ``jax.shard_map``), and the
fall back to blockwise for what the kernel lacks. Nothing here ran on a TPU.

Off a TPU the same kernels run in the Pallas interpreter: the correctness tests compare
them with ``attention_reference``, forward and gradients, in float32 (no libtpu needed).
"""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import Case, build, device, evaluate, seen_rows
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tolerances import assert_close

import jaxckpt
from jaxckpt import nn, plan
from jaxckpt.attention import normalize, resolve_implementation
from jaxckpt.remat import Tag

tpu_compile = pytest.mark.tpu_compile
TARGETS = ("tpu-v5e", "tpu-v5p", "tpu-v6e", "tpu-v4")
KERNEL = re.compile(r"%(splash_[a-z_]+?)(?:\.\d+)? = [^\n]*custom_call_target=\"tpu_custom_call\"")


def kernel_counts(hlo: str) -> collections.Counter:
    """The Splash ``tpu_custom_call`` kernels of a compiled TPU HLO text, by kernel name."""
    return collections.Counter(KERNEL.findall(hlo))


def _sd(target: str, shape, dtype=jnp.bfloat16):
    mesh = Mesh(np.array(plan.target_devices(target, 1)), ("x",))
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))


def _compile(target: str, fn, *args):
    with plan.deviceless(target):
        return jax.jit(fn).lower(*args).compile()


# --- every supported feature, compiled for every TPU target ------------------------------------

B, T, S, N, H = 1, 256, 384, 4, 128  # T != S: a [T, S] shape would show as "256,384"


def _all_features(q, k, v, q_ids, kv_ids, q_len, kv_len):
    out = jaxckpt.flash_attention(
        q,
        k,
        v,
        is_causal=True,
        local_window_size=(100, 0),
        segment_ids=(q_ids, kv_ids),
        query_seq_lengths=q_len,
        key_value_seq_lengths=kv_len,
        logits_soft_cap=30.0,
        implementation="splash",
    )
    return jnp.sum(out.astype(jnp.float32))


def _compile_all_features(target: str, k_heads: int):
    sd = lambda shape, dtype=jnp.bfloat16: _sd(target, shape, dtype)
    args = (
        sd((B, T, N, H)),
        sd((B, S, k_heads, H)),
        sd((B, S, k_heads, H)),
        sd((B, T), jnp.int32),
        sd((B, S), jnp.int32),
        sd((B,), jnp.int32),
        sd((B,), jnp.int32),
    )
    return _compile(target, jax.value_and_grad(_all_features, argnums=(0, 1, 2)), *args)


@tpu_compile
@pytest.mark.slow
@pytest.mark.parametrize(("target", "k_heads"), [(t, 2) for t in TARGETS] + [("tpu-v5e", 1)])
def test_every_feature_compiles_forward_and_backward(target, k_heads):
    """GQA (K=2) on every target, MQA (K=1) on one: causal + window + segment ids + lengths
    + soft cap, bf16; three kernels (forward with residuals, dQ, dK/dV), no [T, S] buffer."""
    compiled = _compile_all_features(target, k_heads)
    kind = "mqa" if k_heads == 1 else "mha"
    assert kernel_counts(compiled.as_text()) == {
        f"splash_{kind}_fwd_segmented_residuals": 1,
        f"splash_{kind}_dq_segmented_no_residuals": 1,
        f"splash_{kind}_dkv_segmented_no_residuals": 1,
    }
    loss, grads = compiled.out_info
    assert loss.shape == ()
    assert [g.shape for g in grads] == [(B, T, N, H), (B, S, k_heads, H), (B, S, k_heads, H)]
    assert [g.dtype for g in grads] == [jnp.bfloat16] * 3
    assert not re.search(rf"\[[\d,]*{T},{S}[\d,]*\]", compiled.as_text()), "a [T, S] buffer in the HLO"


def test_shard_map_with_check_vma_is_refused_with_the_fix():
    """Splash's pallas_call gives its outputs no varying-axes type, which check_vma=True
    rejects (forward and grad, checked compiling for TPU v5e); check_vma=False runs."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    spec = P(None, None, "x")
    attend = lambda q, k, v: jaxckpt.flash_attention(q, k, v, is_causal=True, implementation="splash")
    q = jnp.ones((1, 8, 2, 16))
    with pytest.raises(NotImplementedError, match="check_vma=False"):
        jax.eval_shape(jax.shard_map(attend, mesh=mesh, in_specs=spec, out_specs=spec), q, q, q)
    unchecked = jax.shard_map(attend, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
    assert jax.eval_shape(unchecked, q, q, q).shape == q.shape


# --- what the kernel lacks: refused by name, and blockwise under implementation=None -----------

UNSUPPORTED = {  # feature -> its arguments, arrays made by `sd(shape, dtype)`
    "bias": lambda sd, t, s: {"bias": sd((1, N, t, s), jnp.bfloat16)},
    "mask": lambda sd, t, s: {"mask": sd((1, 1, t, s), jnp.bool_)},
    "dropout": lambda sd, t, s: {"dropout_rate": 0.1, "dropout_rng": jax.random.key(0)},
}


@pytest.mark.parametrize("feature", sorted(UNSUPPORTED))
def test_unsupported_features_are_refused_by_name(feature):
    q, kv = jnp.ones((1, 8, N, 16)), jnp.ones((1, 8, 1, 16))
    extra = UNSUPPORTED[feature](jnp.ones, 8, 8)
    with pytest.raises(
        NotImplementedError, match=rf"implementation='splash' does not support \['{feature}'\]"
    ):
        jax.eval_shape(
            lambda q, kv: jaxckpt.flash_attention(q, kv, kv, implementation="splash", **extra), q, kv
        )


@tpu_compile
@pytest.mark.parametrize("feature", sorted(UNSUPPORTED))
def test_auto_on_a_tpu_sends_what_splash_lacks_to_blockwise(feature):
    sd = lambda shape, dtype=jnp.bfloat16: _sd("tpu-v5e", shape, dtype)
    extra = UNSUPPORTED[feature](sd, T, S)
    arrays = {n: x for n, x in extra.items() if isinstance(x, jax.ShapeDtypeStruct)}
    static = {n: x for n, x in extra.items() if n not in arrays}
    q, kv = sd((B, T, N, H)), sd((B, S, 2, H))
    with jaxckpt.attention.compiling_for("tpu"):
        p = normalize(jnp.zeros(q.shape), jnp.zeros(kv.shape), jnp.zeros(kv.shape), is_causal=True)
        assert resolve_implementation(p) == "splash"

    def attend(q, k, v, arrays):
        return jaxckpt.flash_attention(q, k, v, is_causal=True, **arrays, **static)

    text = _compile("tpu-v5e", attend, q, kv, kv, arrays).as_text()
    assert "tpu_custom_call" not in text, f"{feature}: implementation=None must be blockwise"


# --- named residuals: save_attn keeps the forward kernel out of the recomputation ---------------


def _model(x, w_qkv, w_out):
    b, t, _ = x.shape
    qkv = (x @ w_qkv).reshape(b, t, 3, 4, 128)
    out = jaxckpt.flash_attention(*(qkv[:, :, i] for i in range(3)), is_causal=True)  # auto: splash
    return jnp.sum(jnp.tanh(out.reshape(b, t, 512) @ w_out).astype(jnp.float32))


POLICIES = {
    "save_attn": jax.checkpoint_policies.save_only_these_names(Tag.ATTN_OUT, Tag.ATTN_LSE),
    "full": jax.checkpoint_policies.nothing_saveable,
}


@tpu_compile
@pytest.mark.slow
@pytest.mark.parametrize(("policy", "forwards"), [("save_attn", 1), ("full", 2)])
def test_saved_tags_keep_the_forward_kernel_out_of_the_recompute(policy, forwards):
    sd = lambda shape: _sd("tpu-v5e", shape)
    fn = jax.checkpoint(_model, policy=POLICIES[policy])
    compiled = _compile(
        "tpu-v5e", jax.value_and_grad(fn, argnums=(1, 2)), sd((2, 256, 96)), sd((96, 1536)), sd((512, 96))
    )
    assert kernel_counts(compiled.as_text()) == {
        "splash_mha_fwd_residuals": forwards,
        "splash_mha_dq_no_residuals": 1,
        "splash_mha_dkv_no_residuals": 1,
    }


@tpu_compile
@pytest.mark.slow
def test_sharded_train_step_runs_the_kernel_in_shard_map_with_saved_residuals():
    """The FSDP step of a tiny model on 4 v5e chips: implementation=None picks the kernel, the
    model runs it inside jax.shard_map (XLA cannot partition a Mosaic kernel) on each
    device's 2 of the 8 batch rows, and save_attn keeps it out of the recomputation. (One
    128-token kernel block: the claim is where the kernel runs, not its length; 256 tokens
    took 60% longer to compile.)"""
    cfg = nn.TransformerConfig.preset("tiny", n_layers=1)
    workload = plan.Workload(cfg, batch=8, seq=128, devices=4)
    text = plan.compile_step(workload, "save_attn", target="tpu-v5e").as_text()
    assert kernel_counts(text) == {
        "splash_mha_fwd_residuals": 1,
        "splash_mha_dq_no_residuals": 1,
        "splash_mha_dkv_no_residuals": 1,
    }
    (fwd,) = [line for line in text.splitlines() if re.search(r"%splash_mha_fwd_residuals(\.\d+)? = ", line)]
    operands = fwd.split("operand_layout_constraints=")[1]
    q_local = rf"\[2,{cfg.n_heads},128,{cfg.head_dim}\]"  # [B / 4, N, T, H]: each device's rows
    assert re.search(q_local, operands), operands


# --- correctness in the Pallas interpreter (no TPU, no libtpu) ---------------------------------


def _segments(b, length, cut, second):
    ids = np.zeros((b, length), np.int32)
    ids[:, cut:] = second
    return device(ids)


CASES = {  # name -> (Case, extra arrays, static): float32, each one or two 128-blocks
    "causal-gqa-padded": (Case(b=1, t=200, s=256, n=4, k=2, h=32), {}, {"is_causal": True}),
    "window-softcap-mqa": (
        Case(b=2, t=130, s=70, n=2, k=1, h=16),
        {},
        {"local_window_size": (5, 3), "logits_soft_cap": 3.0, "scale": 1.0},
    ),
    # query segment 7 has no keys: rows 50.. see nothing
    "segments-unmatched-causal": (
        Case(b=2, t=100, s=60, n=2, k=2, h=16),
        {"segment_ids": (_segments(2, 100, 50, 7), _segments(2, 60, 30, 3))},
        {"is_causal": True},
    ),
    "segments-lengths": (
        Case(b=2, t=100, s=60, n=2, k=1, h=16),
        {
            "segment_ids": (_segments(2, 100, 40, 3), _segments(2, 60, 20, 3)),
            "query_seq_lengths": device(np.array([80, 3], np.int32)),
            "key_value_seq_lengths": device(np.array([60, 0], np.int32)),
        },
        {},
    ),
    # T > S + left: rows past S + 3 see nothing
    "causal-window-t-past-s": (
        Case(b=1, t=140, s=60, n=2, k=1, h=16),
        {},
        {"is_causal": True, "local_window_size": (3, 0)},
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_interpreted_kernel_matches_the_reference(name):
    case, arrays, static = CASES[name]
    inp = build(case)._replace(arrays=arrays, static=static)
    blocks = jaxckpt.BlockSizes(128, 128)
    got = evaluate(jaxckpt.flash_attention, inp, implementation="splash", block_sizes=blocks)
    want = evaluate(jaxckpt.attention_reference, inp)
    assert_close(got.out, want.out, jnp.float32, "fwd", "out")
    assert_close(got.lse, want.lse, jnp.float32, "fwd", "lse")
    for grad in ("dq", "dk", "dv"):
        assert_close(got.grads[grad], want.grads[grad], jnp.float32, "grad", grad)
    empty = ~seen_rows(inp)  # [B, T, N]
    if name in ("segments-unmatched-causal", "segments-lengths", "causal-window-t-past-s"):
        assert empty.any(), "the case must empty some rows"
    for what, x in [("out", got.out), *got.grads.items()]:
        assert np.isfinite(x).all(), f"{what} has NaN/inf"
    assert np.all(got.lse[empty] == -np.inf) and np.isfinite(got.lse[~empty]).all()
    assert not np.any(got.out[empty]) and not np.any(got.grads["dq"][empty])
