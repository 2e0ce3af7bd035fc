"""The attention output and lse are tagged, so a remat policy can keep them.

Under ``save_only_these_names(Tag.ATTN_OUT, Tag.ATTN_LSE)`` the backward pass must
not rerun the attention forward: its jaxpr has no more loops than a plain
``jax.grad`` and strictly fewer than under ``nothing_saveable``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params
from tolerances import assert_close

import jaxckpt
from jaxckpt.remat import Tag

B, T, N, H, D = 2, 37, 3, 16, 24
LOOPS = ("while", "scan")
POLICIES = {
    "save_attn": jax.checkpoint_policies.save_only_these_names(Tag.ATTN_OUT, Tag.ATTN_LSE),
    "nothing": jax.checkpoint_policies.nothing_saveable,
}


def _model(x, w_qkv, w_out):
    """x -> q, k, v projection -> flash_attention -> output projection -> loss."""
    qkv = (x @ w_qkv).reshape(B, T, 3, N, H)
    out = jaxckpt.flash_attention(
        qkv[:, :, 0],
        qkv[:, :, 1],
        qkv[:, :, 2],
        is_causal=True,
        block_sizes=jaxckpt.BlockSizes(16, 8),
        implementation="blockwise",
    )
    return jnp.sum(jnp.tanh(out.reshape(B, T, N * H) @ w_out))


def _args():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
    w_qkv = jnp.asarray(rng.standard_normal((D, 3 * N * H)) / np.sqrt(D), jnp.float32)
    w_out = jnp.asarray(rng.standard_normal((N * H, D)) / np.sqrt(N * H), jnp.float32)
    return x, w_qkv, w_out


def _variants():
    return {"no_checkpoint": _model} | {
        name: jax.checkpoint(_model, policy=policy) for name, policy in POLICIES.items()
    }


def _count_loops(jaxpr) -> int:
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name in LOOPS
        for sub in jaxprs_in_params(eqn.params):
            count += _count_loops(sub)
    return count


def test_tag_names():
    assert str(Tag.ATTN_OUT) == "attn_out" and str(Tag.ATTN_LSE) == "attn_lse"


@pytest.mark.parametrize("policy", list(POLICIES))
def test_saved_residuals_are_the_tagged_activations(policy, capsys):
    jax.ad_checkpoint.print_saved_residuals(_variants()[policy], *_args())
    printed = capsys.readouterr().out
    named = {tag for tag in ("attn_out", "attn_lse") if f"named '{tag}'" in printed}
    assert named == ({"attn_out", "attn_lse"} if policy == "save_attn" else set()), printed


def test_saving_the_tags_skips_the_forward_recompute():
    loops = {
        name: _count_loops(jax.make_jaxpr(jax.grad(fn, argnums=(1, 2)))(*_args()).jaxpr)
        for name, fn in _variants().items()
    }
    assert loops["no_checkpoint"] >= 2, loops  # the forward and the backward kernel
    assert loops["save_attn"] == loops["no_checkpoint"] < loops["nothing"], loops


def _dot_flops(eqn) -> int:
    (contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    return 2 * int(np.prod(eqn.outvars[0].aval.shape)) * int(np.prod([lhs[d] for d in contract]))


def _loop_flops(jaxpr, in_loop: bool = False) -> int:
    """Matmul FLOPs of one trip through every loop body (the attention kernels' tile steps)."""
    flops = 0
    for eqn in jaxpr.eqns:
        if in_loop and eqn.primitive.name == "dot_general":
            flops += _dot_flops(eqn)
        inner = in_loop or eqn.primitive.name in LOOPS
        for sub in jaxprs_in_params(eqn.params):
            flops += _loop_flops(sub, inner)
    return flops


def test_saving_the_tags_saves_exactly_the_forward_flops():
    """Per tile step: save_attn costs what no remat costs; nothing_saveable adds a forward."""
    args = _args()
    step = {
        name: _loop_flops(jax.make_jaxpr(jax.grad(fn, argnums=(1, 2)))(*args).jaxpr)
        for name, fn in _variants().items()
    }
    forward = _loop_flops(jax.make_jaxpr(_model)(*args).jaxpr)
    assert forward > 0
    assert step["save_attn"] == step["no_checkpoint"], step
    assert step["nothing"] == step["no_checkpoint"] + forward, (step, forward)


@pytest.mark.slow
def test_gradients_are_the_same_under_every_policy():
    grads = {name: jax.jit(jax.grad(fn, argnums=(0, 1, 2)))(*_args()) for name, fn in _variants().items()}
    for name in POLICIES:
        for i, (got, want) in enumerate(zip(grads[name], grads["no_checkpoint"], strict=True)):
            assert_close(got, want, jnp.float32, "grad", f"{name} grad {i}")


def _pallas_model(x, w_qkv, w_out):
    qkv = (x @ w_qkv).reshape(B, T, 3, N, H)
    out = jaxckpt.flash_attention(*(qkv[:, :, i] for i in range(3)), is_causal=True, implementation="pallas")
    return jnp.sum(jnp.tanh(out.reshape(B, T, N * H) @ w_out))


@pytest.mark.parametrize("policy", list(POLICIES))
def test_pallas_saves_the_same_tagged_residuals(policy, capsys):
    """The Pallas kernel's out and lse are the tagged residuals too (that the compiled step
    then runs one forward kernel, not two, is in tests/attention/test_gpu_compile_pallas.py)."""
    jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(_pallas_model, policy=POLICIES[policy]), *_args())
    printed = capsys.readouterr().out
    named = {tag for tag in ("attn_out", "attn_lse") if f"named '{tag}'" in printed}
    assert named == ({"attn_out", "attn_lse"} if policy == "save_attn" else set()), printed
