"""The category of every warning jaxckpt issues (this module imports nothing from jaxckpt).

Warnings are for what goes on but deserves a look (a config field jaxckpt does not know,
say); errors are for what cannot go on. The test suite turns this category into errors
(``filterwarnings`` in ``pyproject.toml``), so no test passes while the library warns.
"""


class JaxckptWarning(UserWarning):
    """A warning from jaxckpt, torch_bridge or npu_backend.

    Silence it like any warning, e.g. ``warnings.simplefilter("ignore", JaxckptWarning)``.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warnings.warn("config field 'foo' is not known; it is ignored", JaxckptWarning)
        >>> caught[0].category.__name__
        'JaxckptWarning'
    """
