"""``jax.nn.dot_product_attention`` (XLA and cuDNN) wrapped to the jaxckpt contract.

Two differences from calling jax.nn directly: segment ids become a mask (the
whole :func:`visible` predicate, evaluated by the reference's ``full_mask``), and
a query row that sees no key returns 0 (jax.nn returns the mean of V there).
"""

import jax
import jax.numpy as jnp

from jaxckpt.attention._platform import platform
from jaxckpt.attention._reference import full_mask
from jaxckpt.attention._validate import AttentionInputs

JAX_NN_FEATURES = frozenset({"bias", "mask", "causal", "lengths", "window", "segments"})


def jax_nn_attention(p: AttentionInputs, block_sizes, *, implementation: str):
    """Runs jax.nn's ``implementation`` on canonical inputs -> ``(out, lse [B, N, T])``."""
    del block_sizes
    st, a = p.static, p.arrays
    q, k, v = p.query, p.key, p.value
    vis = full_mask(p)  # [B|1, N|1, T, S]
    if q.dtype == jnp.float16 and platform() == "cpu":
        # XLA:CPU has no F16_F16_F32 dot algorithm, which jax.nn requests for float16
        # and which its gradient fails on; compute in float32 and round the output.
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    # jax.nn computes its logits in float32 (float64 for float64 inputs) and adds the bias to
    # them: cast the bias to that dtype here (exact), so that its gradient needs no implicit
    # promotion either. jax.nn's forward calls jnp.promote_types(bf16, f32) itself, which
    # strict promotion refuses, hence the context.
    logits_dtype = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    bias = None if p.bias is None else p.bias.astype(logits_dtype)
    with jax.numpy_dtype_promotion("standard"):
        out, lse = jax.nn.dot_product_attention(
            q,
            k,
            v,
            bias,
            a.mask if a.q_segments is None else vis,
            scale=st.scale,
            is_causal=st.mask.is_causal,
            query_seq_lengths=a.q_lengths,
            key_value_seq_lengths=a.kv_lengths,
            local_window_size=st.mask.window,
            implementation=implementation,
            return_residual=True,
        )
    seen = vis.any(-1)  # [B|1, N|1, T]
    out = jnp.where(jnp.swapaxes(seen, 1, 2)[..., None], out, 0).astype(p.query.dtype)
    lse = jnp.where(seen, jnp.swapaxes(lse, 1, 2).astype(jnp.float32), -jnp.inf)
    return out, lse


def cudnn_unavailable() -> str | None:
    """None on a GPU backend (or compiling for a GPU target), else why cuDNN attention cannot run."""
    backend = platform()
    return (
        None
        if backend == "gpu"
        else f"cuDNN needs a GPU backend or GPU compile target; this one is {backend!r}."
    )


def cudnn_fits(p: AttentionInputs) -> bool:
    """Whether cuDNN flash attention accepts this call (used by ``implementation=None``)."""
    h = p.query.shape[-1]
    window = p.static.mask.window
    window_ok = window is None or (window[1] == 0 or p.static.mask.is_causal)
    return (
        cudnn_unavailable() is None
        and p.query.dtype in (jnp.bfloat16, jnp.float16)
        and h <= 128
        and h % 8 == 0
        and window_ok
    )
