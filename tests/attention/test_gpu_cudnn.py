"""The cuDNN route's named residuals and its O(T) row bookkeeping.

Compiled for an H100 without a GPU (``gpu_compile``): under ``save_attn`` and ``minimal`` the
train step's backward keeps cuDNN's output and softmax statistics (``Tag.ATTN_OUT`` /
``Tag.ATTN_LSE``) and runs no cuDNN forward, under ``full`` it runs it again; no ``[T, S]``
buffer is built. On the CPU: the rows that see a key, from the lengths, causal flag and
window, equal the full mask's, and the named-residual wrapper keeps a kernel's numbers.
"""

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_policies
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxckpt import nn, plan, train
from jaxckpt.attention import AttentionInputs, full_mask, normalize
from jaxckpt.attention._blockwise import blockwise_attention
from jaxckpt.attention._cudnn import cudnn_attention, named_residual_attention
from jaxckpt.attention._jax_nn import seen_rows
from jaxckpt.remat import Tag

FWD = re.compile(r'custom_call_target="__cudnn\$fmha\w*Softmax"')
BWD = re.compile(r'custom_call_target="__cudnn\$fmha\w*SoftmaxBackward"')


def _computations(text: str) -> dict[str, str]:
    """HLO computation name -> its body, from ``compiled.as_text()``."""
    found = re.findall(r"^(?:ENTRY )?%?([\w.\-]+) [^\n]*\{\n(.*?)^\}", text, re.M | re.S)
    return dict(found)


def _cudnn_calls_per_scan_body(text: str) -> list[tuple[int, int]]:
    """``(forward, backward)`` cuDNN attention calls of each while body holding any: a
    scanned layer stack's forward and backward loops, each body run once per layer.
    Checks that no call sits outside a while body (then the counts are per layer)."""
    bodies = set(re.findall(r"body=%?([\w.\-]+)", text))
    counts = {}
    for name, body in _computations(text).items():
        calls = (len(FWD.findall(body)), len(BWD.findall(body)))
        if any(calls):
            assert name in bodies, f"a cuDNN call outside the layer scan, in {name}"
            counts[name] = calls
    assert sum(f for f, _ in counts.values()) == len(FWD.findall(text))
    return sorted(counts.values())


@pytest.mark.gpu_compile
def test_train_step_keeps_cudnn_attention_out_of_the_recomputation():
    """The three presets' steps differ in what the backward recomputes, not in their kernels
    (the matmuls, norms, the loss and the optimizer): one test compiles the three, so the
    first compile builds the kernels and the other two reuse them from ``compile_step``'s
    kernel cache (``plan._targets.kernel_cache_options``). The HLO is the same."""
    cfg = nn.TransformerConfig.preset("tiny", n_layers=3, dtype="bfloat16")
    sgd = train.OptimizerConfig(name="sgd")
    workload = plan.Workload(cfg, batch=3, seq=48, optimizer=sgd, attention="cudnn")
    for remat, per_layer in [
        ("full", [(1, 0), (1, 1)]),  # the backward loop runs the forward again
        ("save_attn", [(0, 1), (1, 0)]),
        ("minimal", [(0, 1), (1, 0)]),
    ]:
        text = plan.compile_step(workload, remat, target="h100-80g").as_text()
        assert _cudnn_calls_per_scan_body(text) == per_layer, remat


def _cudnn_grad(t: int):
    s = NamedSharding(Mesh(plan.target_devices("h100-80g"), ("x",)), P())
    q = jax.ShapeDtypeStruct((2, t, 4, 64), jnp.bfloat16, sharding=s)
    lengths = jax.ShapeDtypeStruct((2,), jnp.int32, sharding=s)

    def loss(q, k, v, q_len, kv_len):
        p = normalize(q, k, v, is_causal=True, query_seq_lengths=q_len, key_value_seq_lengths=kv_len)
        return cudnn_attention(p, None)[0].astype(jnp.float32).sum()

    with plan.deviceless():
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, q, q, lengths, lengths).compile()


@pytest.mark.gpu_compile
def test_cudnn_route_builds_no_t_by_s_buffer():
    temps = {}
    for t in (1024, 1536):
        compiled = _cudnn_grad(t)
        text = compiled.as_text()
        assert len(FWD.findall(text)) == 1 and len(BWD.findall(text)) == 1
        assert not re.findall(rf"\[[\d,]*{t},{t}[\d,]*\]", text), "a [T, S] shape in the compiled HLO"
        temps[t] = compiled.memory_analysis().temp_size_in_bytes
    # linear in T: a [2, 1, T, S] bool mask alone would add 2 * (1536**2 - 1.5 * 1024**2) bytes
    assert abs(temps[1536] - 1.5 * temps[1024]) < 0.05 * 2 * (1536**2 - 1.5 * 1024**2)


_B, _T, _S = 3, 7, 5


def _lengths(which: str):
    return {
        "none": {},
        "q": {"query_seq_lengths": jnp.array([7, 0, 3])},
        "kv": {"key_value_seq_lengths": jnp.array([5, 0, 2])},
        "both": {"query_seq_lengths": jnp.array([2, 7, 0]), "key_value_seq_lengths": jnp.array([0, 1, 5])},
    }[which]


@pytest.mark.parametrize(("t", "s"), [(_T, _S), (_S, _T), (6, 6)])
def test_rows_that_see_a_key_equal_the_full_masks(t, s):
    windows = [None, (0, 0), (2, 1), (1, 0), (0, 3), (9, 9)]
    for causal, window, lengths in itertools.product((False, True), windows, ("none", "q", "kv", "both")):
        q = jnp.zeros((_B, t, 2, 8))
        k = jnp.zeros((_B, s, 2, 8))
        p = normalize(q, k, k, is_causal=causal, local_window_size=window, **_lengths(lengths))
        want = np.broadcast_to(np.asarray(full_mask(p).any(-1)), (_B, 1, t))
        got = seen_rows(p)
        got = np.ones_like(want) if got is None else np.broadcast_to(np.asarray(got), want.shape)
        np.testing.assert_array_equal(got, want, err_msg=f"{causal=} {window=} {lengths=}")


def _stand_in(static, q, k, v, bias, arrays):
    """A kernel with its own custom VJP that keeps ``out`` and an fp32 ``[B, N, T]`` lse, as
    cuDNN's does: the blockwise one, so the wrapper's numbers can be checked on the CPU."""
    return blockwise_attention(AttentionInputs(q, k, v, bias, arrays, None, static, False))[0]


def test_named_residuals_keep_the_kernels_numbers():
    r = np.random.default_rng(0)
    q = jnp.asarray(r.standard_normal((_B, _T, 6, 8)), jnp.float32)
    k, v = (jnp.asarray(r.standard_normal((_B, _S, 3, 8)), jnp.float32) for _ in range(2))
    bias = jnp.asarray(r.standard_normal((1, 6, _T, _S)), jnp.float32)
    kw = {"is_causal": True, **_lengths("both")}

    def loss(attend):
        def f(q, k, v, bias):
            out, lse = attend(normalize(q, k, v, bias, **kw))
            return jnp.sum(out * out), (out, lse)

        return f

    named = loss(lambda p: named_residual_attention(_stand_in, p))
    policy = checkpoint_policies.save_only_these_names(Tag.ATTN_OUT, Tag.ATTN_LSE)
    runs = {
        "direct": loss(blockwise_attention),
        "named": named,
        "named, save_attn": jax.checkpoint(named, policy=policy),
    }
    got = {
        name: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, bias)
        for name, f in runs.items()
    }
    want = got.pop("direct")
    for name, result in got.items():
        for a, b in zip(jax.tree.leaves(result), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6, err_msg=name)
    (_, (out, lse)), _ = got["named"]
    assert not np.asarray(out[2]).any() and np.isneginf(np.asarray(lse[2])).all()  # q length 0
