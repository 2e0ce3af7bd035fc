"""The one place torch is imported: lazily, with an install hint when it is missing."""

import importlib
import os
from types import ModuleType

INSTALL_HINT = 'torch_bridge needs PyTorch: pip install -e ".[torch]" (pin torch==2.13.0 on CPU machines)'


def torch() -> ModuleType:
    """The ``torch`` module, imported on first use.

    ``TORCH_DEVICE_BACKEND_AUTOLOAD`` defaults to ``0`` first: an installed ``torch_npu``
    without Ascend CANN would otherwise make ``import torch`` itself fail.

    Raises:
        ImportError: when PyTorch is not installed, with the command that installs it.

    Example:
        >>> torch().tensor([1.0, 2.0]).sum().item()
        3.0
    """
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    try:
        return importlib.import_module("torch")
    except ImportError as err:
        raise ImportError(f"{INSTALL_HINT} ({err})") from err
