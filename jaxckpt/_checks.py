"""Argument checks shared by every layer (this module imports nothing from jaxckpt)."""


def require_positive_int(name: str, value, where: str = "") -> None:
    """Raises ``ValueError("{where}{name} must be a positive int, got ...")`` unless
    ``value`` is an ``int`` (not a ``bool``) of at least 1.

    Example:
        >>> require_positive_int("steps", 3)
        >>> require_positive_int("steps", 0)
        Traceback (most recent call last):
        ...
        ValueError: steps must be a positive int, got 0
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}{name} must be a positive int, got {value!r}")
