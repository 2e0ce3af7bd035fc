"""Argument checks shared by every layer (this module imports nothing from jaxckpt)."""


def require_positive_int(name: str, value, where: str = "") -> None:
    """Raises ``ValueError("{where}{name}={value!r} must be a positive int")`` unless
    ``value`` is an ``int`` (not a ``bool``) of at least 1.

    The message names the argument as ``name=value``: the command line rewrites that
    into its flag (``jaxckpt.cli``), so ``name`` must be the Python argument's name.

    Example:
        >>> require_positive_int("steps", 3)
        >>> require_positive_int("steps", 0)
        Traceback (most recent call last):
        ...
        ValueError: steps=0 must be a positive int
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}{name}={value!r} must be a positive int")
