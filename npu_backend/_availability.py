"""Is torch_npu usable here? Probes that are safe to call on any machine.

Without Ascend CANN, ``import torch_npu`` fails on ``libhccl.so`` (an ``ImportError``
or ``OSError``, sometimes a ``RuntimeError``), and an installed torch_npu makes even
``import torch`` fail unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``. So: look for the
package first, set that variable before torch is imported, and import inside a guard.
"""

import functools
import importlib
import importlib.metadata
import importlib.util
import os

GUARDED = (ImportError, OSError, RuntimeError)
"""What a broken torch_npu / CANN install raises on import."""


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def _probe() -> tuple[object | None, int, str | None]:
    """``(torch_npu module or None, device count, reason unavailable or None)``, once."""
    if importlib.util.find_spec("torch_npu") is None:
        return None, 0, "torch_npu is not installed (it needs an Ascend NPU with CANN; see the README)"
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    try:
        import torch  # noqa: F401  (torch_npu patches it)

        torch_npu = importlib.import_module("torch_npu")
    except GUARDED as err:
        return None, 0, f"import torch_npu failed: {type(err).__name__}: {err}"
    try:
        count = int(torch_npu.npu.device_count())
    except GUARDED as err:
        return torch_npu, 0, f"torch_npu imported but cannot count NPUs: {type(err).__name__}: {err}"
    if count == 0:
        return torch_npu, 0, "torch_npu imported but sees no NPU device"
    return torch_npu, count, None


def is_available() -> bool:
    """True when torch_npu imports and sees at least one NPU. Safe anywhere.

    Example:
        >>> import npu_backend
        >>> isinstance(npu_backend.is_available(), bool)
        True
    """
    return _probe()[2] is None


def unavailable() -> str | None:
    """None when the NPU route can run here, else the exact reason it cannot.

    Example:
        >>> import npu_backend
        >>> (npu_backend.unavailable() is None) == npu_backend.is_available()
        True
    """
    return _probe()[2]


def device_count() -> int:
    """How many NPUs torch_npu sees (0 when it is unavailable).

    Example:
        >>> import npu_backend
        >>> npu_backend.device_count() >= (1 if npu_backend.is_available() else 0)
        True
    """
    return _probe()[1]


def torch_npu_module():
    """The imported ``torch_npu`` module.

    Raises:
        RuntimeError: with the reason, when the backend is unavailable.
    """
    module, _, reason = _probe()
    if reason is not None:
        raise RuntimeError(f"the Ascend NPU backend is unavailable: {reason}")
    return module


def info() -> dict:
    """The versions found and the backend's state, or why it is unavailable.

    Returns:
        ``{"available", "reason", "device_count", "torch", "torch_npu", "cann",
        "TORCH_DEVICE_BACKEND_AUTOLOAD"}``; versions are None when not installed.

    Example:
        >>> import npu_backend
        >>> sorted(npu_backend.info())[:3]
        ['TORCH_DEVICE_BACKEND_AUTOLOAD', 'available', 'cann']
    """
    _, count, reason = _probe()
    return {
        "available": reason is None,
        "reason": reason,
        "device_count": count,
        "torch": _version("torch"),
        "torch_npu": _version("torch-npu") or _version("torch_npu"),
        "cann": os.environ.get("ASCEND_TOOLKIT_HOME"),
        "TORCH_DEVICE_BACKEND_AUTOLOAD": os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD"),
    }
