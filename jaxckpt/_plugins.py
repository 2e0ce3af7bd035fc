"""Packages that extend jaxckpt without jaxckpt importing them: Python entry points.

``jaxckpt`` never imports ``torch_bridge`` (a higher layer). That package declares, in
``pyproject.toml``, the ``jaxckpt convert`` subcommand (group ``jaxckpt.cli``) and the
reader of Hugging Face directories for ``--init-from`` (group ``jaxckpt.model_sources``);
``npu_backend`` registers its attention implementations when the ``jaxckpt`` command
loads group ``jaxckpt.attention``.
"""

import importlib.metadata

CLI = "jaxckpt.cli"
MODEL_SOURCES = "jaxckpt.model_sources"
ATTENTION = "jaxckpt.attention"


def plugins(group: str) -> dict[str, importlib.metadata.EntryPoint]:
    """The entry points of ``group``, by name (not loaded).

    Example:
        >>> "convert" in plugins(CLI)
        True
    """
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=group)}


def plugin(group: str, name: str):
    """The object entry point ``name`` of ``group`` refers to, loaded.

    Raises:
        LookupError: when no installed package provides it (reinstall with ``pip install -e .``).
    """
    found = plugins(group)
    if name not in found:
        raise LookupError(
            f"no {group!r} plugin named {name!r} is installed (found: {', '.join(found) or 'none'}); "
            'reinstall jaxckpt with pip install -e ".[torch]"'
        )
    return found[name].load()


def load_attention_plugins() -> dict[str, str]:
    """Imports every ``jaxckpt.attention`` plugin (each registers implementations).

    Returns:
        ``{name: why it failed}`` for the plugins that could not be imported.
    """
    failed = {}
    for name, entry in plugins(ATTENTION).items():
        try:
            entry.load()
        except (ImportError, OSError, RuntimeError) as err:
            failed[name] = f"{type(err).__name__}: {err}"
    return failed
