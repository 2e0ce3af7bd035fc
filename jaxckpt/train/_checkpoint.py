"""Orbax checkpoints of a ``Trainer``'s model and optimizer state."""

import json
import os
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from flax import nnx

META = "jaxckpt.json"

ADDED_STATE = ("loss_scaler",)
"""State that a newer jaxckpt keeps and older checkpoints lack (the optimizer's loss
scaler): restoring such a checkpoint keeps the target's initial values for it."""

MAX_TO_KEEP = 3
"""How many of a directory's newest checkpoints are kept (older ones are deleted)."""


def _manager(directory: Path, max_to_keep: int | None = MAX_TO_KEEP) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
    return ocp.CheckpointManager(directory.absolute(), options=options)


def latest_step(directory: str | os.PathLike) -> int | None:
    """The newest saved step in ``directory``, or None when it holds no checkpoint.

    Example:
        >>> import tempfile
        >>> latest_step(tempfile.mkdtemp()) is None
        True
    """
    directory = Path(directory)
    if not directory.is_dir():
        return None
    with _manager(directory) as manager:
        return manager.latest_step()


def save_checkpoint(
    directory: str | os.PathLike, step: int, state: "nnx.State | dict", meta: dict | None = None
) -> Path:
    """Saves ``state`` (model + optimizer, or a pure dict of arrays) as step ``step``;
    returns the directory.

    Orbax writes each step to a temporary directory and renames it when complete, so
    an interrupted save never replaces a good checkpoint. ``meta`` (JSON) is written
    next to it, also through a temporary file and a rename.

    Example:
        >>> import tempfile, jax.numpy as jnp
        >>> from flax import nnx
        >>> state = nnx.State({"w": nnx.Param(jnp.ones(3))})
        >>> d = tempfile.mkdtemp()
        >>> _ = save_checkpoint(d, 7, state, {"seed": 0})
        >>> latest_step(d)
        7
    """
    directory = Path(directory)
    with _manager(directory) as manager:
        tree = nnx.to_pure_dict(state) if isinstance(state, nnx.State) else state
        manager.save(step, args=ocp.args.StandardSave(tree), force=True)
        manager.wait_until_finished()
    if meta is not None:
        tmp = directory / f".{META}.tmp"
        tmp.write_text(json.dumps(meta, indent=2))
        tmp.replace(directory / META)
    return directory


def restore_checkpoint(
    directory: str | os.PathLike, like: nnx.State, step: int | None = None
) -> tuple[int, nnx.State]:
    """Restores step ``step`` (default: the latest) into a state shaped like ``like``.

    Returns:
        ``(step, state)``.

    Raises:
        FileNotFoundError: when ``directory`` holds no checkpoint.

    Example:
        >>> import tempfile, jax.numpy as jnp
        >>> from flax import nnx
        >>> state = nnx.State({"w": nnx.Param(jnp.arange(3.0))})
        >>> d = save_checkpoint(tempfile.mkdtemp(), 5, state)
        >>> step, restored = restore_checkpoint(d, state)
        >>> step, restored["w"][...].tolist()
        (5, [0.0, 1.0, 2.0])
    """
    directory = Path(directory)
    step = latest_step(directory) if step is None else step
    if step is None:
        raise FileNotFoundError(
            f"no checkpoint in {str(directory)!r}; train without resume=True to create one"
        )
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, nnx.to_pure_dict(like))
    with _manager(directory) as manager:
        try:
            restored = manager.restore(step, args=ocp.args.StandardRestore(abstract))
        except ValueError:
            older = _without(abstract, ADDED_STATE)
            if older == abstract:
                raise
            restored = manager.restore(step, args=ocp.args.StandardRestore(older))
    state = jax.tree.map(lambda x: x, like)
    nnx.replace_by_pure_dict(state, restored)
    return step, state


def _without(tree: dict, names: tuple[str, ...]) -> dict:
    """``tree`` without its subtrees under any key in ``names``, at any depth."""
    if not isinstance(tree, dict):
        return tree
    return {k: _without(v, names) for k, v in tree.items() if k not in names}


def read_meta(directory: str | os.PathLike) -> dict:
    """The JSON written next to the checkpoints (empty when absent).

    Example:
        >>> import tempfile, jax.numpy as jnp
        >>> d = save_checkpoint(tempfile.mkdtemp(), 0, {"w": jnp.ones(2)}, {"seed": 3})
        >>> read_meta(d)
        {'seed': 3}
    """
    path = Path(directory) / META
    return json.loads(path.read_text()) if path.exists() else {}
