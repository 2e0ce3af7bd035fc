"""The Pallas kernel compiles, forward and backward, for an H100 (sm_90a) through Triton,
with the real XLA:GPU compiler and no GPU (the ``gpu-aot`` extra; skipped without it).

Each compile is checked for what it became: the four Triton kernels (forward, delta,
dK/dV, dQ) as ``__gpu$xla.gpu.triton`` custom calls, and no ``[B, N, T, S]`` buffer
unless a bias gradient is asked for.
"""

import collections
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import plan
from jaxckpt.plan._targets import kernel_cache_options
from jaxckpt.remat import Tag

pytestmark = pytest.mark.gpu_compile

KERNELS = ("jaxckpt_flash_fwd", "jaxckpt_flash_bwd_delta", "jaxckpt_flash_bwd_dkdv", "jaxckpt_flash_bwd_dq")


def _sd(shape, dtype):
    return jax.ShapeDtypeStruct(
        shape, dtype, sharding=NamedSharding(Mesh(plan.target_devices("h100-80g"), ("x",)), P())
    )


def kernel_counts(hlo: str) -> collections.Counter:
    """Triton kernels of a compiled HLO text, by their ``pallas_call`` name."""
    assert hlo.count('custom_call_target="__gpu$xla.gpu.triton"') >= 1, "no Triton custom call"
    return collections.Counter(re.findall(r'name = \\?"(jaxckpt_flash_\w+)', hlo))


def _compile(fn, *args, options=None):
    with plan.deviceless():
        return jax.jit(fn).lower(*args).compile(options)


SHAPES = [  # B, T, S, N, K, H, features
    (2, 300, 300, 8, 2, 128, "all"),  # odd T and S, GQA, every feature, a differentiated bias
    (1, 1024, 1024, 8, 8, 64, "causal"),
    (3, 40, 56, 4, 1, 256, "window"),  # MQA, the largest head dim
]


def _kwargs(features: str, b: int, t: int, s: int, n: int, dtype):
    if features == "causal":
        return {"is_causal": True}, ()
    if features == "window":
        return {"local_window_size": (7, 5)}, ()
    kwargs = dict(is_causal=True, local_window_size=(50, 3), logits_soft_cap=30.0, dropout_rate=0.1)
    return kwargs, (_sd((1, n, t, s), dtype), _sd((b,), jnp.int32), _sd((b,), jnp.int32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"T{s[1]}S{s[2]}H{s[5]}-{s[6]}" for s in SHAPES])
def test_fwd_and_bwd_compile_for_sm90_through_triton(shape, dtype):
    b, t, s, n, k, h, features = shape
    kwargs, extra = _kwargs(features, b, t, s, n, dtype)

    def loss(q, kk, v, *arrays):
        more = {}
        if arrays:
            bias, q_len, kv_len = arrays
            more = dict(bias=bias, query_seq_lengths=q_len, key_value_seq_lengths=kv_len)
            more["dropout_rng"] = jax.random.key(0)
        out = jaxckpt.flash_attention(q, kk, v, implementation="pallas", **kwargs, **more)
        return jnp.sum(out.astype(jnp.float32))

    argnums = (0, 1, 2, 3) if extra else (0, 1, 2)
    compiled = _compile(
        jax.grad(loss, argnums=argnums),
        _sd((b, t, n, h), dtype),
        _sd((b, s, k, h), dtype),
        _sd((b, s, k, h), dtype),
        *extra,
    )
    hlo = compiled.as_text()
    assert kernel_counts(hlo) == dict.fromkeys(KERNELS, 1)
    assert [o.shape for o in compiled.out_info] == [
        (b, t, n, h),
        (b, s, k, h),
        (b, s, k, h),
        *([(1, n, t, s)] if extra else []),
    ]
    scores = re.compile(rf"f32\[{b},{n},\d+,\d+\]")
    assert bool(scores.search(hlo)) == bool(extra), "a [B, N, T, S] buffer only for the bias gradient"


def _model(x, w_qkv, w_out, *, implementation="pallas", **kwargs):
    b, t, _ = x.shape
    qkv = (x @ w_qkv).reshape(b, t, 3, 4, 64)
    out = jaxckpt.flash_attention(*(qkv[:, :, i] for i in range(3)), implementation=implementation, **kwargs)
    return jnp.sum(jnp.tanh(out.reshape(b, t, 256) @ w_out).astype(jnp.float32))


def test_saved_tags_keep_the_forward_kernel_out_of_the_recompute():
    """Under ``save_attn`` (Tag.ATTN_OUT, Tag.ATTN_LSE saved) the backward reruns no forward.

    The three policies' steps hold the same kernels (the four Triton kernels, of the same
    shapes, and the same matmuls), so one test compiles them through one kernel cache: the
    first compile builds the kernels, the other two reuse them."""
    policies = {
        "save_attn": jax.checkpoint_policies.save_only_these_names(Tag.ATTN_OUT, Tag.ATTN_LSE),
        "nothing": jax.checkpoint_policies.nothing_saveable,
    }
    args = (_sd((2, 256, 96), jnp.bfloat16), _sd((96, 768), jnp.bfloat16), _sd((256, 96), jnp.bfloat16))
    options = kernel_cache_options("h100-80g")  # XLA:GPU's kernel cache: the Triton and ptxas work is shared
    for policy, forwards in [(None, 1), ("save_attn", 1), ("nothing", 2)]:
        fn = _model if policy is None else jax.checkpoint(_model, policy=policies[policy])
        compiled = _compile(jax.value_and_grad(fn, argnums=(1, 2)), *args, options=options)
        counts = kernel_counts(compiled.as_text())
        assert counts["jaxckpt_flash_fwd"] == forwards, (policy, counts)
        assert counts["jaxckpt_flash_bwd_dkdv"] == counts["jaxckpt_flash_bwd_dq"] == 1, (policy, counts)


def test_auto_sends_what_cudnn_lacks_to_the_triton_kernel():
    """``implementation=None`` for a GPU: a soft cap (Gemma 2) becomes the Pallas kernel."""
    args = (_sd((2, 128, 96), jnp.bfloat16), _sd((96, 768), jnp.bfloat16), _sd((256, 96), jnp.bfloat16))
    capped = _compile(lambda *a: _model(*a, implementation=None, logits_soft_cap=20.0, is_causal=True), *args)
    assert kernel_counts(capped.as_text())["jaxckpt_flash_fwd"] == 1
    plain = _compile(lambda *a: _model(*a, implementation=None, is_causal=True), *args).as_text()
    assert "__cudnn$fmhaSoftmax" in plain and "xla.gpu.triton" not in plain


def test_the_triton_kernel_compiles_inside_shard_map_with_check_vma():
    """Tensor parallel over heads: each of 2 devices runs the kernel on its heads."""
    mesh = Mesh(plan.target_devices("h100-80g", 2), ("tp",))
    sd = lambda s: jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    spec = P(None, None, "tp")
    attend = lambda q, k, v: jaxckpt.flash_attention(q, k, v, is_causal=True, implementation="pallas")
    sharded = jax.shard_map(attend, mesh=mesh, in_specs=spec, out_specs=spec)
    loss = lambda q, k, v: sharded(q, k, v).astype(jnp.float32).sum()
    compiled = _compile(
        jax.grad(loss, argnums=(0, 1, 2)), sd((2, 256, 4, 64)), sd((2, 256, 2, 64)), sd((2, 256, 2, 64))
    )
    assert kernel_counts(compiled.as_text()) == dict.fromkeys(KERNELS, 1)
