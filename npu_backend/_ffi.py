"""The XLA FFI route: jaxckpt attention as a custom call into C++, with a custom VJP.

The C++ library (``npu_backend/ffi``) holds two XLA FFI handlers, forward and
backward, over a small kernel interface (``ffi/kernel.h``) with two
implementations: a FlashAttention-2 CPU kernel in plain loops, always built,
and an Ascend kernel over ``aclnnFlashAttentionScore`` /
``aclnnFlashAttentionScoreGrad``, built only when CANN is installed.

Only the CPU route runs. Running the Ascend kernel from JAX would need a JAX
PJRT backend for the NPU, which hands the handler an ``aclrtStream`` and device
buffers; none is public today. With one, the handlers
``JaxckptNpuAttentionFwdAscend`` / ``JaxckptNpuAttentionBwdAscend`` (compiled
with ``-DJAXCKPT_WITH_ASCEND``) would be registered the way :func:`register`
registers the CPU ones, with that backend's platform name. Until then the NPU
route of ``npu_backend`` is ``torch_npu.npu_fusion_attention``.

The library is built on first use (see :mod:`npu_backend.ffi.build`) and needs a
C++ compiler; :func:`unavailable` says why the route cannot run, if it cannot.
"""

import ctypes
import dataclasses
import functools
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxckpt.attention import AttentionInputs, normalize
from npu_backend.ffi import build as _build

FORWARD_TARGET = "jaxckpt_npu_attention_fwd"
BACKWARD_TARGET = "jaxckpt_npu_attention_bwd"
SUPPORTED_FEATURES = frozenset({"causal", "window"})
"""The features of ``jaxckpt.attention.FEATURES`` that this route handles."""
VMAP_METHODS = ("broadcast_all", "sequential", "sequential_unrolled")
"""The ``vmap_method`` values :func:`ffi_attention` accepts (see its docstring)."""

_lock = threading.Lock()
_state: dict = {"lib": None, "registered": False}


def library_path() -> Path:
    """Where the shared library is (or will be) built.

    Example:
        >>> from npu_backend._ffi import library_path
        >>> library_path().name
        'libjaxckpt_npu_ffi.so'
    """
    return _build.library_path()


def build(force: bool = False) -> Path:
    """Builds the library if it is missing or out of date (or if ``force``).

    Args:
        force: recompile even when the library is up to date.

    Returns:
        The path of the library.

    Raises:
        npu_backend.ffi.build.BuildError: no C++ compiler, or compilation failed.

    Example:
        >>> from npu_backend._ffi import build
        >>> build().exists()
        True
    """
    return _build.build(force=force)


def _load() -> ctypes.CDLL:
    with _lock:
        if _state["lib"] is None:
            _state["lib"] = ctypes.cdll.LoadLibrary(str(build()))
        return _state["lib"]


def unavailable() -> str | None:
    """None when the library is built (or buildable) and loads; else the reason it is not.

    Builds the library if needed, so the first call may take a few seconds.

    Example:
        >>> from npu_backend._ffi import unavailable
        >>> unavailable() is None
        True
    """
    try:
        _load()
    except (_build.BuildError, OSError) as e:
        return f"the npu_backend FFI library is unavailable: {e}"
    return None


def register() -> None:
    """Loads the library and registers its forward and backward handlers on the CPU platform.

    Idempotent and thread-safe; :func:`ffi_attention` calls it.

    Raises:
        RuntimeError: the library cannot be built or loaded (the reason of
            :func:`unavailable`).

    Example:
        >>> from npu_backend._ffi import register
        >>> register()
    """
    reason = unavailable()
    if reason is not None:
        raise RuntimeError(reason)
    lib = _load()
    with _lock:
        if _state["registered"]:
            return
        for name, symbol in (
            (FORWARD_TARGET, lib.JaxckptNpuAttentionFwd),
            (BACKWARD_TARGET, lib.JaxckptNpuAttentionBwd),
        ):
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(symbol), platform="cpu")
        _state["registered"] = True


@dataclasses.dataclass(frozen=True)
class _Config:
    """The static attributes of one call (hashable: a custom_vjp nondiff argument)."""

    scale: float
    is_causal: bool
    window: tuple[int, int] | None
    vmap_method: str

    def attrs(self) -> dict:
        left, right = self.window if self.window is not None else (-1, -1)
        return dict(
            scale=np.float32(self.scale),
            is_causal=bool(self.is_causal),
            window_left=np.int64(left),
            window_right=np.int64(right),
        )


def _forward_call(cfg: _Config, q, k, v):
    b, t, n, _ = q.shape
    types = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct((b, n, t), jnp.float32))
    return jax.ffi.ffi_call(FORWARD_TARGET, types, vmap_method=cfg.vmap_method)(q, k, v, **cfg.attrs())


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg: _Config, q, k, v):
    return _forward_call(cfg, q, k, v)


def _attention_fwd(cfg: _Config, q, k, v):
    out, lse = _forward_call(cfg, q, k, v)
    return (out, lse), (q, k, v, out, lse)


def _attention_bwd(cfg: _Config, res, cotangents):
    q, k, v, out, lse = res
    d_out, _ = cotangents  # lse is stop_gradient-ed by every caller: its cotangent is zero
    types = tuple(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (q, k, v))
    call = jax.ffi.ffi_call(BACKWARD_TARGET, types, vmap_method=cfg.vmap_method)
    dq, dk, dv = call(q, k, v, out, lse, d_out.astype(jnp.float32), **cfg.attrs())
    return dq, dk, dv


_attention.defvjp(_attention_fwd, _attention_bwd)


def _check_vmap_method(vmap_method) -> str:
    if vmap_method not in VMAP_METHODS:
        raise ValueError(
            f"vmap_method must be one of {VMAP_METHODS}; got {vmap_method=}. "
            "'expand_dims' is not supported: the C++ side needs every leading axis at full size."
        )
    return vmap_method


def _run(p: AttentionInputs, vmap_method: str) -> tuple[jax.Array, jax.Array]:
    """(out [B,T,N,H] in the input dtype, lse [B,N,T] fp32, not differentiated)."""
    register()
    st = p.static
    cfg = _Config(st.scale, st.mask.is_causal, st.mask.window, _check_vmap_method(vmap_method))
    q, k, v = (x.astype(jnp.float32) for x in (p.query, p.key, p.value))
    out, lse = _attention(cfg, q, k, v)
    return out.astype(p.query.dtype), jax.lax.stop_gradient(lse)


def ffi_attention(
    query,
    key,
    value,
    *,
    scale=None,
    is_causal=False,
    local_window_size=None,
    return_residual=False,
    vmap_method="broadcast_all",
):
    """Attention through the XLA FFI custom call (CPU), differentiable.

    Arguments mean what they mean in ``jaxckpt.flash_attention`` and
    ``jax.nn.dot_product_attention``: layout ``BTNH`` (query ``[B, T, N, H]``,
    key/value ``[B, S, K, H]``, or all three without ``B``), GQA when K divides
    N, top-left causal alignment when T != S, ``local_window_size=(left, right)``
    keeps keys ``q - left <= k <= q + right``. A query row that sees no key
    returns 0 and gets zero gradients.

    The C++ kernel computes in float32: bfloat16/float16 inputs are cast to
    float32 for the call, and the output is cast back to the input dtype (so are
    the gradients). The forward keeps ``(q, k, v, out, lse)``; the backward is a
    second custom call that recomputes the probabilities from ``lse``.

    Under ``jax.vmap`` the custom calls batch by ``vmap_method``:
    ``"broadcast_all"`` (default) gives the C++ handlers every input with the
    vmapped axis in front at full size, and the handlers fold every axis before
    ``[T, N, H]`` into the batch B, so a vmapped call is one custom call.
    ``"sequential"`` / ``"sequential_unrolled"`` loop over the vmapped axis
    instead. ``"expand_dims"`` is refused (unbatched operands would keep a size-1
    axis the handlers do not broadcast).

    Running this route on an Ascend NPU needs a JAX PJRT backend for the NPU
    (none is public today); only the CPU implementation runs.

    Args:
        query: ``[B, T, N, H]`` floating array.
        key: ``[B, S, K, H]``, same dtype.
        value: ``[B, S, K, H]``, same dtype.
        scale: logits scale; default ``1 / sqrt(H)``.
        is_causal: top-left causal mask (a Python bool).
        local_window_size: ``int`` or ``(left, right)`` sliding window, or None.
        return_residual: also return the fp32 log-sum-exp, ``[B, T, N]`` (not
            differentiated), as ``jaxckpt.flash_attention`` does.
        vmap_method: how the custom calls batch under ``jax.vmap`` (see above).

    Returns:
        ``out`` with the shape and dtype of ``query``; with ``return_residual``,
        ``(out, lse)``.

    Raises:
        ValueError: a shape, window or scale is wrong, or an unknown ``vmap_method``.
        TypeError: a dtype is wrong, or ``is_causal`` is not a bool.
        RuntimeError: the C++ library cannot be built or loaded.

    Example:
        >>> import jax
        >>> from npu_backend._ffi import ffi_attention
        >>> q = jax.random.normal(jax.random.key(0), (2, 5, 3, 8))
        >>> ffi_attention(q, q, q, is_causal=True).shape
        (2, 5, 3, 8)
    """
    if not isinstance(is_causal, bool | np.bool_):
        raise TypeError(f"is_causal must be a Python bool; got {is_causal=} ({type(is_causal).__name__}).")
    _check_vmap_method(vmap_method)
    p = normalize(query, key, value, scale=scale, is_causal=is_causal, local_window_size=local_window_size)
    out, lse = _run(p, vmap_method)
    lse = jnp.swapaxes(lse, 1, 2)  # [B, T, N], as jaxckpt.flash_attention returns it
    if p.unbatched:
        out, lse = out[0], lse[0]
    return (out, lse) if return_residual else out


def ffi_attention_normalized(inputs: AttentionInputs, block_sizes=None) -> tuple[jax.Array, jax.Array]:
    """The FFI route on canonical inputs: the ``fn`` of ``jaxckpt.attention.register_implementation``.

    Register it with ``supports=SUPPORTED_FEATURES`` and ``unavailable=unavailable``.

    Args:
        inputs: the result of ``jaxckpt.attention.normalize``; may use only
            ``is_causal`` and ``local_window_size`` among the optional features.
        block_sizes: ignored (the C++ kernel picks its own key block).

    Returns:
        ``(out [B, T, N, H] in the input dtype, lse [B, N, T] float32)``.

    Raises:
        NotImplementedError: ``inputs`` uses a feature outside :data:`SUPPORTED_FEATURES`.

    Example:
        >>> import jax
        >>> from jaxckpt.attention import normalize
        >>> from npu_backend._ffi import ffi_attention_normalized
        >>> q = jax.random.normal(jax.random.key(0), (1, 5, 3, 8))
        >>> out, lse = ffi_attention_normalized(normalize(q, q, q, is_causal=True))
        >>> out.shape, lse.shape
        ((1, 5, 3, 8), (1, 3, 5))
    """
    del block_sizes
    st, a = inputs.static, inputs.arrays
    used = {
        "bias": inputs.bias is not None,
        "mask": a.mask is not None,
        "lengths": a.q_lengths is not None or a.kv_lengths is not None,
        "segments": a.q_segments is not None,
        "softcap": st.logits_soft_cap is not None,
        "dropout": st.dropout_rate > 0,
    }
    unsupported = sorted(name for name, on in used.items() if on)
    if unsupported:
        raise NotImplementedError(
            f"the FFI attention route supports only {sorted(SUPPORTED_FEATURES)}; "
            f"these inputs use {unsupported}."
        )
    return _run(inputs, "broadcast_all")
