"""The XLA FFI route: jaxckpt attention as a custom call into C++, with a custom VJP.

It is ``jaxckpt.flash_attention(..., implementation="npu_ffi")`` (causal and window
only); :func:`ffi_attention_normalized` is the function registered under that name.

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

from jaxckpt.attention import AttentionInputs, features_used
from npu_backend.ffi import build as _build

FORWARD_TARGET = "jaxckpt_npu_attention_fwd"
BACKWARD_TARGET = "jaxckpt_npu_attention_bwd"
SUPPORTED_FEATURES = frozenset({"causal", "window"})
"""The features of ``jaxckpt.attention.FEATURES`` that this route handles."""
VMAP_METHODS = ("broadcast_all", "sequential", "sequential_unrolled")
"""The ``vmap_method`` values :func:`ffi_attention_normalized` accepts (see its docstring)."""

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


def missing() -> str | None:
    """Cheap (never compiles): None when the library is built or a compiler can build it.

    This is the registry's availability probe for ``implementation="npu_ffi"``.

    Example:
        >>> from npu_backend._ffi import missing
        >>> missing() is None
        True
    """
    if library_path().exists() or _build.find_compiler() is not None:
        return None
    return "the FFI library is not built and no C++ compiler (g++) is found; run make ffi"


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

    Idempotent and thread-safe; :func:`ffi_attention_normalized` calls it.

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
    cfg = _Config(st.scale, st.mask.is_causal, st.mask.window, vmap_method)
    q, k, v = (x.astype(jnp.float32) for x in (p.query, p.key, p.value))
    out, lse = _attention(cfg, q, k, v)
    return out.astype(p.query.dtype), jax.lax.stop_gradient(lse)


def ffi_attention_normalized(
    inputs: AttentionInputs, block_sizes=None, *, vmap_method: str = "broadcast_all"
) -> tuple[jax.Array, jax.Array]:
    """The FFI route on canonical inputs: the ``fn`` registered as ``implementation="npu_ffi"``.

    Reached through ``jaxckpt.flash_attention(..., implementation="npu_ffi")``, whose
    arguments mean what they mean there and in ``jax.nn.dot_product_attention``. The
    C++ kernel computes in float32: bfloat16/float16 inputs are cast to float32 for the
    call, and the output (and the gradients) are cast back to the input dtype. The
    forward keeps ``(q, k, v, out, lse)``; the backward is a second custom call that
    recomputes the probabilities from ``lse``.

    Under ``jax.vmap`` the custom calls batch by ``vmap_method``: ``"broadcast_all"``
    (the default, and what ``flash_attention`` uses) gives the C++ handlers every input
    with the vmapped axis in front at full size, and the handlers fold every axis before
    ``[T, N, H]`` into the batch B, so a vmapped call is one custom call.
    ``"sequential"`` / ``"sequential_unrolled"`` loop over the vmapped axis instead.
    ``"expand_dims"`` is refused (unbatched operands would keep a size-1 axis the
    handlers do not broadcast).

    Args:
        inputs: the result of ``jaxckpt.attention.normalize``; may use only
            ``is_causal`` and ``local_window_size`` among the optional features.
        block_sizes: ignored (the C++ kernel picks its own key block).
        vmap_method: how the custom calls batch under ``jax.vmap`` (see above).

    Returns:
        ``(out [B, T, N, H] in the input dtype, lse [B, N, T] float32)``; the lse is
        not differentiated.

    Raises:
        NotImplementedError: ``inputs`` uses a feature outside :data:`SUPPORTED_FEATURES`.
        ValueError: an unknown ``vmap_method``.
        RuntimeError: the C++ library cannot be built or loaded.

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
    unsupported = sorted(features_used(inputs) - SUPPORTED_FEATURES)
    if unsupported:
        raise NotImplementedError(
            f"the FFI attention route supports only {sorted(SUPPORTED_FEATURES)}; "
            f"these inputs use {unsupported}."
        )
    return _run(inputs, _check_vmap_method(vmap_method))
