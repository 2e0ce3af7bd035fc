"""Crossing between JAX and torch: the torch import, DLPack array exchange, ``call_torch``.

Call path: ``_torch`` imports torch once (without device-backend autoload); ``_dlpack``
moves arrays between the two (``to_jax``, ``to_torch``, dtype maps); ``call_torch``
(``_call_torch``) runs a torch function inside a JAX program as a host callback.
"""

from torch_bridge.interop._call_torch import call_torch
from torch_bridge.interop._dlpack import numpy_dtype, numpy_to_tensor, tensor_to_numpy, to_jax, to_torch
from torch_bridge.interop._torch import torch

__all__ = ["call_torch", "numpy_dtype", "numpy_to_tensor", "tensor_to_numpy", "to_jax", "to_torch", "torch"]
