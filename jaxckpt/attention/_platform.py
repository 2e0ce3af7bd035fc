"""Which backend attention is traced for: this process's, or a compile target's.

``flash_attention(implementation=None)`` and the cuDNN route ask ``platform()``. It is
``jax.default_backend()``, unless a compile for another backend is being traced under
``compiling_for`` (``jaxckpt.plan`` compiles for GPU targets on a CPU-only machine).
"""

import contextlib
import contextvars

import jax

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "jaxckpt_attention_platform", default=None
)

PLATFORMS = ("cpu", "gpu", "tpu")
"""The values ``compiling_for`` takes (``jax.default_backend()``'s names)."""


def platform() -> str:
    """The backend being traced for: ``"gpu"``, ``"cpu"``, ``"tpu"`` (or a plugin's name).

    Example:
        >>> from jaxckpt.attention import compiling_for, platform
        >>> with compiling_for("gpu"):
        ...     platform()
        'gpu'
    """
    target = _TARGET.get()
    if target is not None:
        return target
    backend = jax.default_backend()
    return "gpu" if backend == "cuda" else backend


@contextlib.contextmanager
def compiling_for(target: str):
    """Traces attention for backend ``target`` while the block runs (lowering for a device
    this process does not have, e.g. an H100 compile target on a CPU machine).

    Raises:
        ValueError: when ``target`` is not one of ``PLATFORMS``.

    Example:
        >>> from jaxckpt.attention import compiling_for, implementations
        >>> with compiling_for("gpu"):
        ...     implementations()["cudnn"].unavailable() is None
        True
    """
    if target not in PLATFORMS:
        raise ValueError(
            f"target={target!r} is not a platform attention can be traced for; valid: {PLATFORMS}"
        )
    token = _TARGET.set(target)
    try:
        yield
    finally:
        _TARGET.reset(token)
