"""Orbax checkpoints of a ``Trainer``'s model and optimizer state, crash-safe.

A step is the latest only when it is complete twice over: orbax has renamed its
temporary directory into place, and ``jaxckpt.json`` (written after it, through a
temporary file and a rename) lists it under ``"checkpoints"``. A run killed between the
two leaves a step that no reader takes, and that the next save of that step replaces.
Orbax's temporary directories left by a killed save are removed by the next save.
"""

import errno
import json
import os
import re
import shutil
import threading
import traceback
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxckpt.train._orbax_quiet import SaveReports, quiet_orbax_failures
from jaxckpt.train._orbax_threads import release_stranded_threads

META = "jaxckpt.json"

ADDED_STATE = ("loss_scaler",)
"""State that a newer jaxckpt keeps and older checkpoints lack (the optimizer's loss
scaler): restoring such a checkpoint keeps the target's initial values for it."""

MAX_TO_KEEP = 3
"""How many of a directory's newest checkpoints are kept (older ones are deleted)."""

TMP_DIR_SUFFIX = ".orbax-checkpoint-tmp"
"""What orbax appends to the name of a step's directory while it writes it."""

RECORDED = "checkpoints"
"""``jaxckpt.json``'s list of the complete steps (absent in checkpoints before it)."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, say); the previous one is intact.

    Example:
        >>> import errno
        >>> CheckpointWriteError(errno.ENOSPC, "no space").errno == errno.ENOSPC
        True
    """


def _ocp():
    """``orbax.checkpoint``, imported on first use: it is about 0.4 s of every ``import jaxckpt``
    otherwise, and most processes (the planner, the CLI's help, converters) never checkpoint."""
    import orbax.checkpoint

    return orbax.checkpoint


def _manager(directory: Path, max_to_keep: int | None = MAX_TO_KEEP, cleanup: bool = False):
    quiet_orbax_failures()  # a failure is raised as one line: no orbax thread tracebacks
    options = _ocp().CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=True, cleanup_tmp_directories=cleanup
    )
    return _ocp().CheckpointManager(directory.absolute(), options=options)


def latest_step(directory: str | os.PathLike) -> int | None:
    """The newest complete step in ``directory``, or None when it holds no checkpoint.

    Complete: orbax finished it and ``jaxckpt.json`` records it (a checkpoint written
    without that file counts when orbax finished it).

    Example:
        >>> import tempfile
        >>> latest_step(tempfile.mkdtemp()) is None
        True
    """
    directory = Path(directory)
    if not directory.is_dir():
        return None
    with _manager(directory) as manager:
        return _latest(manager, directory)


def _latest(manager, directory: Path) -> int | None:
    """The newest step orbax finished that ``jaxckpt.json`` records (all of them without it)."""
    steps = set(manager.all_steps())
    recorded = read_meta(directory).get(RECORDED)
    if recorded is not None:
        steps &= set(recorded)
    return max(steps, default=None)


def save_checkpoint(
    directory: str | os.PathLike, step: int, state: "nnx.State | dict", meta: dict | None = None
) -> Path:
    """Saves ``state`` (model + optimizer, or a pure dict of arrays) as step ``step``;
    returns the directory.

    Orbax writes each step to a temporary directory and renames it when complete, so
    an interrupted save never replaces a good checkpoint. ``meta`` (JSON) is written
    next to it, also through a temporary file and a rename, with the list of complete
    steps (``"checkpoints"``): a step becomes the latest only then. A step that exists
    but is not recorded (its run was killed before the metadata) is replaced; a recorded
    one is refused.

    Raises:
        CheckpointWriteError: the write failed (a full disk, say). The error is one line
            naming the directory, the step, the reason and the log file (``CHECKPOINT_LOG``, in
            ``directory``) that holds orbax's reports of the failure with their tracebacks;
            none of them reaches stderr (``_orbax_quiet``). The partial step is removed and
            the previous checkpoint stays the latest, intact.
        FileExistsError: ``step`` is already a complete checkpoint of ``directory``.

    Example:
        >>> import tempfile, jax.numpy as jnp
        >>> from flax import nnx
        >>> state = nnx.State({"w": nnx.Param(jnp.ones(3))})
        >>> d = tempfile.mkdtemp()
        >>> _ = save_checkpoint(d, 7, state, {"seed": 0})
        >>> latest_step(d), read_meta(d)["checkpoints"]
        (7, [7])
    """
    directory = Path(directory)
    tree = nnx.to_pure_dict(state) if isinstance(state, nnx.State) else state
    failure, threads_before = None, set(threading.enumerate())
    with SaveReports() as reports:  # orbax's reports of a failure: held, not printed
        # One manager, made by every process alike: each one makes the same orbax barriers (a
        # second manager made only where the directory already existed split them).
        with _manager(directory, cleanup=True) as manager:  # removes a killed save's temp dirs
            previous = _latest(manager, directory)
            if step in manager.all_steps():
                if step in read_meta(directory).get(RECORDED, ()):
                    raise FileExistsError(
                        f"{str(directory)!r} already holds a complete checkpoint, step {step}"
                    )
                manager.delete(step)  # a killed run's unrecorded step: not a checkpoint
            try:
                manager.save(step, args=_ocp().args.StandardSave(tree), force=True)
                manager.wait_until_finished()
                if meta is not None:
                    _record(manager, directory, step, meta)
            except (OSError, ValueError) as err:
                if not _is_write_error(err):
                    raise
                failure = err
        if failure is not None:  # the manager is closed: none of its threads writes any more
            release_stranded_threads(threads_before)  # else they would hold the process for 300 s
            _remove_temporaries(directory, step)  # give the space back now, not at the next save
            error = _write_error(directory, step, previous, failure)
            details = reports.write_log(directory, f"{error.strerror}\n{_traceback(failure)}")
            raise CheckpointWriteError(error.errno, f"{error.strerror}; {details}") from failure
        reports.release()
    return directory


def _traceback(err: Exception) -> str:
    return "".join(traceback.format_exception(err)).rstrip()


def _record(manager, directory: Path, step: int, meta: dict) -> None:
    """Writes ``jaxckpt.json`` with the complete steps: ``step`` becomes the latest."""
    try:
        _write_json(directory / META, {**meta, RECORDED: sorted(manager.all_steps())})
    except OSError:
        manager.delete(step)  # orbax finished it, but it is not recorded: not a checkpoint
        raise


def _remove_temporaries(directory: Path, step: int) -> None:
    """The temporary directories of a failed save of ``step`` (best effort: the disk may be full)."""
    for tmp in directory.glob(f"{step}{TMP_DIR_SUFFIX}*"):
        shutil.rmtree(tmp, ignore_errors=True)


OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")
"""How tensorstore (orbax's array writer) reports the errno of a failed write."""


def _is_write_error(err: Exception) -> bool:
    return isinstance(err, OSError) or OS_ERROR_CODE.search(str(err)) is not None


def _write_error(directory: Path, step: int, previous: int | None, err: Exception) -> CheckpointWriteError:
    """One line: the directory, the step, the reason, and what is left."""
    code = err.errno if isinstance(err, OSError) else int(OS_ERROR_CODE.search(str(err)).group(1))
    reason = os.strerror(code) if code else str(err).splitlines()[0]
    kept = "it holds no earlier one" if previous is None else f"the previous one, step {previous}, is intact"
    name = errno.errorcode.get(code, code)
    message = f"could not write checkpoint step {step} to {str(directory)!r}: {reason} ({name}); {kept}"
    return CheckpointWriteError(code or errno.EIO, message)


def _write_json(path: Path, value: dict) -> None:
    """``value`` as JSON at ``path``, through a temporary file and a rename (no torn file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(value, indent=2))
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


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
    abstract = jax.tree.map(_ocp().utils.to_shape_dtype_struct, nnx.to_pure_dict(like))
    with _manager(directory) as manager:
        try:
            try:
                restored = manager.restore(step, args=_ocp().args.StandardRestore(abstract))
            except ValueError:
                older = _without(abstract, ADDED_STATE)
                if older == abstract:
                    raise
                restored = manager.restore(step, args=_ocp().args.StandardRestore(older))
        except Exception as err:  # orbax and tensorstore raise many types on a damaged checkpoint
            raise ValueError(
                f"could not restore checkpoint step {step} from {str(directory)!r}: {_one_line(err)}"
            ) from err
    _check_shapes(abstract, restored, f"checkpoint step {step} in {str(directory)!r}")
    state = jax.tree.map(lambda x: x, like)
    nnx.replace_by_pure_dict(state, restored)
    return step, state


def _without(tree: dict, names: tuple[str, ...]) -> dict:
    """``tree`` without its subtrees under any key in ``names``, at any depth."""
    if not isinstance(tree, dict):
        return tree
    return {k: _without(v, names) for k, v in tree.items() if k not in names}


def _check_shapes(abstract: dict, restored: dict, where: str) -> None:
    """orbax checks the stored shape of a jax array against the target's, not of an array saved
    from numpy (``jaxckpt convert``'s): it comes back in its stored shape. Refuse that here."""
    want = {jax.tree_util.keystr(p): np.shape(a) for p, a in jax.tree_util.tree_leaves_with_path(abstract)}
    found = {jax.tree_util.keystr(p): np.shape(a) for p, a in jax.tree_util.tree_leaves_with_path(restored)}
    bad = [f"{k} is {found[k]}, not {shape}" for k, shape in want.items() if found.get(k, shape) != shape]
    if bad:
        raise ValueError(
            f"{where} does not fit the model: {len(bad)} array(s) of another shape: {', '.join(bad[:3])}"
        )


def _one_line(err: Exception) -> str:
    """``Type: first line`` of ``err``, without tensorstore's spec dump."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0].split(' [tensorstore_spec')[0] if lines else ''}"


META_FIELDS = {"config": dict, "param_dtypes": dict, "arch": str, "kind": str, RECORDED: list}
META_FIELDS |= {"hf_fields": (dict, type(None)), "optimizer": (dict, type(None))}
"""The ``jaxckpt.json`` fields jaxckpt reads, and their JSON types."""


def read_meta(directory: str | os.PathLike) -> dict:
    """The JSON written next to the checkpoints (empty when absent).

    Raises:
        ValueError: one line naming the file, when it is not a JSON object or a field of
            ``META_FIELDS`` has another type.

    Example:
        >>> import tempfile, jax.numpy as jnp
        >>> d = save_checkpoint(tempfile.mkdtemp(), 0, {"w": jnp.ones(2)}, {"seed": 3})
        >>> read_meta(d)
        {'seed': 3, 'checkpoints': [0]}
    """
    path = Path(directory) / META
    if not path.exists():
        return {}
    try:
        meta = json.loads(path.read_bytes().decode("utf-8"))
    except (ValueError, RecursionError) as err:  # not UTF-8, not JSON, nested too deep
        raise ValueError(f"{path}: not readable JSON ({_one_line(err)})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: expected a JSON object, got a JSON {type(meta).__name__}")
    for field, kind in META_FIELDS.items():  # (quoted: the CLI rewrites a bare name= as a flag)
        if field in meta and not isinstance(meta[field], kind):
            raise ValueError(f"{path}: field {field!r} holds {meta[field]!r:.60}, of the wrong type")
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in meta.get(RECORDED, ())):
        raise ValueError(f"{path}: field {RECORDED!r} holds {meta[RECORDED]!r:.60}, not step numbers")
    return meta
