"""Zero-copy conversion between ``torch.Tensor`` and ``jax.Array`` through DLPack.

Both directions share memory whenever DLPack and the receiving framework allow it.
Writes through one side are visible on the other, so treat a converted array as a
view: do not modify the tensor while JAX still uses the array (JAX assumes its
buffers are immutable).

When a copy cannot be avoided (measured with jax 0.10.2 and torch 2.13.0 on CPU):

* ``torch -> jax`` on CPU copies when the tensor's data pointer is not 64-byte
  aligned: JAX's CPU client needs 64-byte alignment to alias a buffer. A tensor that
  torch allocated is aligned; a view that starts inside another buffer (``t[1:]`` of a
  float32 tensor) usually is not, nor is ``torch.from_numpy`` of a numpy-allocated
  array (numpy aligns to 16 bytes).
* Tensors whose strides are neither contiguous nor a permutation of a dense layout
  (``t[::2]``, ``t[:, :3]``, ``expand`` broadcasts) are made contiguous first (a copy).
  A dense permutation (``t.T``, ``t.permute(...)``) passes as is: JAX keeps the
  transposed layout and does not copy.
* 64-bit tensors (float64, int64, uint64, complex128) become 32-bit arrays (a copy)
  unless ``jax_enable_x64`` is on, as everywhere else in JAX.
* Tensors with the conjugate or negative bit set are resolved first (a copy).
"""

import functools

import jax
import numpy as np

from torch_bridge.interop._torch import torch

__all__ = [
    "DLPACK_DTYPES",
    "numpy_dtype",
    "numpy_to_tensor",
    "tensor_to_numpy",
    "to_jax",
    "to_torch",
    "torch_dtype",
]

# One table serves both directions: dtype names that DLPack carries between torch and JAX.
# Left out: sub-byte types (int4, uint4, int2, float4_e2m1fn), complex32, float8_e3m4,
# float8_e4m3b11fnuz, quantized and bit types; one side or the other rejects them.
DLPACK_DTYPES = frozenset(
    {
        "bool",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "int8",
        "int16",
        "int32",
        "int64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex64",
        "complex128",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    }
)

# dtypes that numpy lacks (ml_dtypes provides them): reinterpret through a same-width int.
_NUMPY_VIEW_AS = {"bfloat16": "int16"} | {n: "uint8" for n in DLPACK_DTYPES if n.startswith("float8")}


_th = functools.cache(torch)  # these functions run in every host callback: skip the import machinery


@functools.cache
def _torch_to_numpy_dtypes() -> dict:
    """``{torch.bfloat16: dtype(bfloat16), ...}`` over ``DLPACK_DTYPES``."""
    return {getattr(_th(), n): np.dtype(jax.numpy.dtype(n)) for n in DLPACK_DTYPES}


@functools.cache
def _numpy_to_torch_dtypes() -> dict:
    return {v: k for k, v in _torch_to_numpy_dtypes().items()}


@functools.cache
def _numpy_views() -> dict:
    """``{torch.bfloat16: (torch.int16, dtype(bfloat16)), ...}`` for dtypes numpy lacks."""
    th = _th()
    return {getattr(th, n): (getattr(th, v), np.dtype(jax.numpy.dtype(n))) for n, v in _NUMPY_VIEW_AS.items()}


def torch_dtype(dtype):
    """The torch dtype of a numpy/JAX dtype, or None when DLPack cannot carry it.

    Example:
        >>> import jax.numpy as jnp
        >>> torch_dtype(jnp.bfloat16)
        torch.bfloat16
    """
    return _numpy_to_torch_dtypes().get(np.dtype(dtype))


def numpy_dtype(dtype) -> "np.dtype | None":
    """The numpy (``ml_dtypes``) dtype of a torch dtype, or None when DLPack cannot carry it.

    Example:
        >>> import torch
        >>> numpy_dtype(torch.bfloat16)
        dtype(bfloat16)
    """
    return _torch_to_numpy_dtypes().get(dtype)


def numpy_to_tensor(array: np.ndarray):
    """A CPU ``torch.Tensor`` sharing ``array``'s memory, bfloat16 and float8 too (the
    inverse of ``tensor_to_numpy``; ``torch.from_numpy`` rejects dtypes numpy lacks).

    Raises:
        TypeError: if ``array.dtype`` is not in ``DLPACK_DTYPES``.

    Example:
        >>> import ml_dtypes
        >>> numpy_to_tensor(np.ones(2, ml_dtypes.bfloat16))
        tensor([1., 1.], dtype=torch.bfloat16)
    """
    dtype = torch_dtype(array.dtype)
    if dtype is None:
        raise TypeError(f"numpy_to_tensor: array.dtype={array.dtype} has no torch equivalent")
    view = _numpy_views().get(dtype)
    if view is None:
        return _th().from_numpy(array)
    return _th().from_numpy(array.view(_NUMPY_VIEW_AS[str(array.dtype)])).view(dtype)


def _is_dense(tensor) -> bool:
    """Whether the strides are a permutation of a compact row-major layout."""
    if tensor.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(tensor.stride(), tensor.shape, strict=True) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def to_jax(tensor) -> jax.Array:
    """A ``torch.Tensor`` as a ``jax.Array``, sharing its memory when possible.

    The tensor is detached when it requires grad; non-dense strides, unaligned CPU
    pointers and 64-bit dtypes without ``jax_enable_x64`` cost a copy (see the
    module docstring). The call itself costs about 40 µs on CPU (measured on a 2-core
    CPU; most of it is JAX's Python-side ``from_dlpack``).

    Args:
        tensor: a ``torch.Tensor`` on a device JAX can see (CPU, or CUDA with a CUDA
            jaxlib). Its dtype must be in ``DLPACK_DTYPES``.

    Returns:
        A ``jax.Array`` of the same shape and values, on the matching JAX device.

    Raises:
        TypeError: if ``tensor`` is not a ``torch.Tensor``, or its dtype cannot travel
            through DLPack.

    Example:
        >>> import torch
        >>> t = torch.arange(3.0)
        >>> a = to_jax(t)
        >>> a
        Array([0., 1., 2.], dtype=float32)
        >>> a.unsafe_buffer_pointer() == t.data_ptr()  # zero copy
        True
    """
    if not isinstance(tensor, _th().Tensor):
        raise TypeError(
            f"to_jax: tensor must be a torch.Tensor, got {type(tensor).__name__}. "
            "For numpy arrays use jnp.asarray."
        )
    if tensor.dtype not in _torch_to_numpy_dtypes():
        raise TypeError(
            f"to_jax: tensor.dtype={tensor.dtype} cannot travel through DLPack to JAX; "
            f"cast it first (e.g. tensor.float()). Supported: {sorted(DLPACK_DTYPES)}"
        )
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.is_conj() or tensor.is_neg():
        tensor = tensor.resolve_conj().resolve_neg()
    if not _is_dense(tensor):
        tensor = tensor.contiguous()
    return jax.dlpack.from_dlpack(tensor)


def to_torch(array):
    """A concrete ``jax.Array`` as a ``torch.Tensor``, sharing its memory (zero copy).

    JAX arrays are immutable: do not write into the returned tensor (``clone()`` it
    first if you must). The call costs about 7 µs on CPU (measured on a
    2-core CPU).

    Args:
        array: a concrete (not traced) ``jax.Array`` on a single device. Its dtype must
            be in ``DLPACK_DTYPES``. Inside ``jax.jit``, use ``call_torch`` instead.

    Returns:
        A ``torch.Tensor`` of the same shape, dtype and values, on the matching device.

    Raises:
        TypeError: if ``array`` is not a concrete ``jax.Array``, or its dtype cannot
            travel through DLPack.
        ValueError: if ``array`` spans more than one device.

    Example:
        >>> import jax.numpy as jnp
        >>> a = jnp.arange(3, dtype=jnp.bfloat16)
        >>> t = to_torch(a)
        >>> t
        tensor([0., 1., 2.], dtype=torch.bfloat16)
        >>> t.data_ptr() == a.unsafe_buffer_pointer()  # zero copy
        True
    """
    if isinstance(array, jax.core.Tracer):
        raise TypeError(
            "to_torch: array is a traced value (inside jax.jit, vmap or grad); torch needs "
            "concrete data. Wrap the torch code with torch_bridge.call_torch instead."
        )
    if not isinstance(array, jax.Array):
        raise TypeError(
            f"to_torch: array must be a jax.Array, got {type(array).__name__}. "
            "For numpy arrays use torch.from_numpy."
        )
    if array.dtype not in _numpy_to_torch_dtypes():
        raise TypeError(
            f"to_torch: array.dtype={array.dtype} cannot travel through DLPack to torch; "
            f"cast it first (e.g. array.astype(jnp.int8)). Supported: {sorted(DLPACK_DTYPES)}"
        )
    if len(array.sharding.device_set) != 1:
        raise ValueError(
            f"to_torch: array lives on {len(array.sharding.device_set)} devices; DLPack "
            "carries one buffer. Convert array.addressable_shards[i].data one at a time."
        )
    return _th().from_dlpack(array)


def tensor_to_numpy(tensor) -> np.ndarray:
    """A CPU ``torch.Tensor`` as a numpy array without a copy, bfloat16 and float8 too.

    ``Tensor.numpy()`` rejects dtypes numpy lacks; those are reinterpreted through a
    same-width integer and viewed back with the ``ml_dtypes`` dtype JAX uses. This is
    the cheap (~1-2 µs) way back to JAX inside a host callback, where ``to_jax`` would
    cost ~40 µs. Non-CPU tensors are moved to the CPU (a copy).

    Args:
        tensor: a ``torch.Tensor`` whose dtype is in ``DLPACK_DTYPES``.

    Returns:
        A numpy array that shares the tensor's memory (when it is on the CPU).

    Raises:
        TypeError: if ``tensor.dtype`` is not in ``DLPACK_DTYPES``.

    Example:
        >>> import torch
        >>> array = tensor_to_numpy(torch.ones(2, dtype=torch.bfloat16))
        >>> array.dtype.name, array.tolist()
        ('bfloat16', [1.0, 1.0])
    """
    if tensor.dtype not in _torch_to_numpy_dtypes():
        raise TypeError(f"tensor_to_numpy: tensor.dtype={tensor.dtype} has no JAX equivalent")
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if tensor.is_conj() or tensor.is_neg():
        tensor = tensor.resolve_conj().resolve_neg()
    view = _numpy_views().get(tensor.dtype)
    if view is None:
        return tensor.numpy()
    return tensor.view(view[0]).numpy().view(view[1])
