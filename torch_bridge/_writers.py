"""Writers that never leave a partial output: HF safetensors shards, torch files, swaps.

``write_safetensors`` writes the layout ``transformers`` writes (``model.safetensors``,
or numbered shards plus ``model.safetensors.index.json``), one shard in memory at a time.
``atomic_output`` gives a temporary path next to the destination and renames it into
place only when the whole output is written; a write that fails there (a full disk, a
quota, a file size limit) becomes one ``OutputWriteError`` naming the destination and the
file (``writing``) it was writing, with nothing partial left behind.
"""

import contextlib
import errno
import json
import math
import os
import secrets
import shutil
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from jaxckpt._sizes import parse_size
from torch_bridge._dlpack import numpy_to_tensor
from torch_bridge._file_readers import SAFETENSORS_DTYPES
from torch_bridge._torch import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})
"""The ``errno`` values that say the destination's file system refused the output (a full
disk, a quota, ``RLIMIT_FSIZE``, a read-only mount), whatever file the error names."""


class OutputWriteError(OSError):
    """An output could not be written; the destination holds nothing partial.

    ``errno`` is the cause's (``errno.ENOSPC`` for a full disk); the message names the
    destination, the file or step being written and what is left there.

    Example:
        >>> err = OutputWriteError(errno.ENOSPC, "could not write 'out': No space left on device")
        >>> err.errno == errno.ENOSPC, str(err)
        (True, "could not write 'out': No space left on device")
    """

    def __str__(self) -> str:
        return str(self.strerror) if len(self.args) == 2 else super().__str__()


@contextlib.contextmanager
def writing(what: str) -> Iterator[None]:
    """Names ``what`` (a file, or a step such as ``"the orbax checkpoint"``) in the
    ``OutputWriteError`` that ``atomic_output`` makes of an ``OSError`` raised inside. The
    innermost ``writing`` wins; an error that names a file of the output needs none.

    Example:
        >>> try:
        ...     with writing("config.json"):
        ...         raise OSError(errno.ENOSPC, "No space left on device")
        ... except OSError as err:
        ...     err.writing
        'config.json'
    """
    try:
        yield
    except OSError as err:
        if getattr(err, "writing", None) is None:
            err.writing = what
        raise


def parse_shard_size(text_or_int: str | int) -> int:
    """Bytes per shard from ``"5GB"``, ``"500MB"``, ``"2GiB"`` or a number of bytes.

    Raises:
        ValueError: for text that is not a size, or a size that is not positive.

    Example:
        >>> parse_shard_size("5GB"), parse_shard_size("2GiB"), parse_shard_size(1024)
        (5000000000, 2147483648, 1024)
    """
    return parse_size(text_or_int, "max_shard_size")


def _plan_shards(sizes: Sequence[int], max_shard_size: int) -> list[list[int]]:
    """Greedy in order: a shard closes before the tensor that would overflow it."""
    shards: list[list[int]] = [[]]
    filled = 0
    for number, size in enumerate(sizes):
        if shards[-1] and filled + size > max_shard_size:
            shards.append([])
            filled = 0
        shards[-1].append(number)
        filled += size
    return shards


def _shard_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _check_write_args(directory: Path, keys: list[str], max_shard_size: int, metadata: dict) -> None:
    if not directory.is_dir():
        raise FileNotFoundError(f"write_safetensors: directory {directory} does not exist; create it first")
    stale = sorted(p.name for p in directory.glob("model*.safetensors*"))
    if stale:
        raise FileExistsError(
            f"{directory} already holds {stale}; write into an empty directory (atomic_output gives one)"
        )
    if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, int) or max_shard_size <= 0:
        raise ValueError(f"max_shard_size must be a positive number of bytes, got {max_shard_size!r}")
    if len(set(keys)) != len(keys):
        twice = sorted({key for key in keys if keys.count(key) > 1})
        raise ValueError(f"write_safetensors: tensor names {twice} appear more than once in specs")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise TypeError(f"safetensors metadata must map str to str, got {metadata!r}")
    if metadata.get("format", "pt") != "pt":
        raise ValueError(f'metadata["format"] must be "pt" (transformers requires it), got {metadata!r}')


def _fetch(get: Callable[[str], np.ndarray], key: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    array = np.asarray(get(key))
    if array.shape != tuple(shape) or array.dtype != np.dtype(dtype):
        raise ValueError(
            f"get({key!r}) returned shape {array.shape} dtype {array.dtype}, but specs promised "
            f"shape {tuple(shape)} dtype {np.dtype(dtype)}; make specs match the arrays"
        )
    return np.require(array, requirements="C")  # safetensors writes raw memory: C order only


_SAFETENSORS_NAMES = {np.dtype(t): name for name, t in SAFETENSORS_DTYPES.items()}


def _write_shard(path: Path, entries, get: Callable[[str], np.ndarray], metadata: dict[str, str]) -> None:
    """Writes one safetensors file, streaming: the header is computed from ``entries``
    ``(name, shape, dtype)`` alone, then each tensor is fetched, written and dropped, so
    only one tensor is in memory at a time (``safetensors.numpy.save_file`` needs them all).

    The layout is the format's: an 8-byte little-endian header length, the JSON header
    (padded with spaces to a multiple of 8), then the tensors' bytes back to back.
    """
    header: dict = {"__metadata__": metadata}
    offset = 0
    for key, shape, dtype in entries:
        if np.dtype(dtype) not in _SAFETENSORS_NAMES:
            raise ValueError(f"tensor {key!r} has dtype {np.dtype(dtype)}, which safetensors cannot store")
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        header[key] = {"dtype": _SAFETENSORS_NAMES[np.dtype(dtype)], "shape": list(shape)}
        header[key]["data_offsets"] = [offset, offset + nbytes]
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    try:
        with writing(path.name), open(path, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
            for key, shape, dtype in entries:
                f.write(_fetch(get, key, shape, dtype).reshape(-1).view(np.uint8).data)
    except BaseException:
        path.unlink(missing_ok=True)  # never leave a shard whose header promises missing data
        raise


def write_safetensors(
    directory: Path,
    specs: Sequence[tuple[str, tuple[int, ...], np.dtype]],
    get: Callable[[str], np.ndarray],
    *,
    max_shard_size: int,
    metadata: dict[str, str] | None = None,
) -> list[Path]:
    """Write tensors in the Hugging Face safetensors layout, one tensor in memory at a time.

    The shards are planned from ``specs`` alone (greedy in order; a tensor larger than
    ``max_shard_size`` gets a shard of its own), then each file is streamed: ``get`` is
    called for one tensor, its bytes written, and the array dropped before the next.

    Args:
        directory: an existing directory with no ``model*.safetensors*`` files in it.
        specs: ``(name, shape, dtype)`` of every tensor, in the order to store them.
        get: returns the array of one name; it must match its spec.
        max_shard_size: bytes per shard (see ``parse_shard_size``).
        metadata: extra safetensors header metadata; ``{"format": "pt"}`` is always set.

    Returns:
        The weight files written, in order: ``[directory / "model.safetensors"]``, or the
        numbered shards (``model.safetensors.index.json`` is then written beside them).

    Raises:
        FileNotFoundError: ``directory`` does not exist.
        FileExistsError: it already holds safetensors weights or an index.
        ValueError: duplicate names, a bad size, or an array that does not match its spec.

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp())
        >>> specs = [("a", (3, 5), np.dtype(np.float32)), ("b", (7,), np.dtype(np.float32))]
        >>> shapes = {name: shape for name, shape, _ in specs}
        >>> files = write_safetensors(d, specs, lambda k: np.ones(shapes[k], np.float32), max_shard_size=64)
        >>> [f.name for f in files], json.loads((d / INDEX_FILE).read_text())["metadata"]
        (['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors'], {'total_size': 88})
    """
    directory, metadata = Path(directory), dict(metadata or {})
    _check_write_args(directory, [spec[0] for spec in specs], max_shard_size, metadata)
    sizes = [math.prod(shape) * np.dtype(dtype).itemsize for _, shape, dtype in specs]
    shards = _plan_shards(sizes, max_shard_size)
    names, weight_map = _shard_names(len(shards)), {}
    for name, shard in zip(names, shards, strict=True):
        entries = [specs[i] for i in shard]
        _write_shard(directory / name, entries, get, {**metadata, "format": "pt"})
        weight_map.update({key: name for key, _, _ in entries})
    if len(names) > 1:
        index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
        text = json.dumps(index, indent=2, sort_keys=True) + "\n"  # as transformers writes it
        with writing(INDEX_FILE):
            (directory / INDEX_FILE).write_text(text, encoding="utf-8")
    return [directory / name for name in names]


def _to_torch(key: str, array: np.ndarray):
    """A torch tensor sharing memory with ``array`` (copied only if not C-order or read-only)."""
    array = np.require(np.asarray(array), requirements=["C", "W"])
    try:
        return numpy_to_tensor(array)
    except TypeError as err:
        raise ValueError(f"tensor {key!r} has dtype {array.dtype}, which torch cannot hold ({err})") from err


def write_torch_file(path: Path, tensors: Iterable[tuple[str, np.ndarray]]) -> Path:
    """Write ``(name, array)`` pairs as a torch state_dict with ``torch.save``, atomically.

    The data goes to a hidden temporary file beside ``path``, renamed over it at the end:
    a failure leaves any old file intact. ``torch.save`` needs the whole dict, so every
    tensor is in memory at once (shared with the given arrays where possible). It writes
    through a Python file, so that a full disk is an ``OutputWriteError`` with its ``errno``
    (``torch.save`` given a path reports one as a ``RuntimeError`` that names no cause).

    Raises:
        OutputWriteError: the disk filled (or another write failure, see ``atomic_output``).
        FileNotFoundError: the parent directory of ``path`` does not exist.
        IsADirectoryError: ``path`` is a directory.
        ValueError: a name given twice, or a dtype torch cannot hold.

    Example:
        >>> import tempfile, ml_dtypes, torch
        >>> f = write_torch_file(Path(tempfile.mkdtemp()) / "w.pt",
        ...                      [("w", np.ones((3, 5), ml_dtypes.bfloat16))])
        >>> torch.load(f)["w"].dtype
        torch.bfloat16
    """
    if Path(path).is_dir():
        raise IsADirectoryError(f"write_torch_file: {path} is a directory; pass the path of a .pt/.bin file")
    state = {}
    for key, array in tensors:
        if key in state:
            raise ValueError(f"write_torch_file({path}): tensor {key!r} given twice")
        state[key] = _to_torch(key, array)
    with atomic_output(path, force=True, is_dir=False) as tmp, writing(Path(path).name), open(tmp, "wb") as f:
        recorded = _Recorded(f)
        try:
            torch().save(state, recorded)
        except RuntimeError:
            if recorded.error is not None:
                raise recorded.error from None  # the OSError torch.save turned into a RuntimeError
            raise
    return Path(path)


class _Recorded:
    """A file that keeps the first ``OSError`` of its ``write`` (``torch.save`` raises a
    ``RuntimeError`` in its place, without the ``errno``)."""

    def __init__(self, file):
        self._file, self.error = file, None

    def write(self, data) -> int:
        try:
            return self._file.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def __getattr__(self, name: str):
        return getattr(self._file, name)


def _sibling(destination: Path, kind: str) -> Path:
    """A hidden, unused name next to ``destination``."""
    while True:
        candidate = destination.with_name(f".{destination.name}.{kind}-{secrets.token_hex(4)}")
        if not os.path.lexists(candidate):
            return candidate


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _refuse_existing(destination: Path, force: bool) -> None:
    if not force and os.path.lexists(destination):
        raise FileExistsError(
            f"{destination} already exists; pass force=True to replace it, or choose another path"
        )


def _swap_in(new: Path, destination: Path) -> None:
    """Rename ``new`` onto ``destination``; an old one is moved away first, deleted last."""
    if not os.path.lexists(destination):
        os.rename(new, destination)
    elif not new.is_dir() and (destination.is_symlink() or not destination.is_dir()):
        os.replace(new, destination)  # a file over a file: one atomic step
    else:
        old = _sibling(destination, "old")
        os.rename(destination, old)
        try:
            os.rename(new, destination)
        except BaseException as err:
            try:
                os.rename(old, destination)
            except OSError as again:
                again.left = f"the existing {destination.name} is at {old}: it could not be moved back"
                raise again from err
            raise
        _remove(old)


@contextlib.contextmanager
def atomic_output(
    destination: str | os.PathLike, *, force: bool = False, is_dir: bool = True
) -> Iterator[Path]:
    """A temporary path next to ``destination``, renamed onto it when the block succeeds.

    The temporary path is hidden (``.{name}.tmp-XXXXXXXX``) in the same directory, so the
    final rename never crosses file systems. For ``is_dir=True`` it is created as an empty
    directory; for a file the caller creates it. If the block raises, the temporary output
    is removed and the exception propagates: ``destination`` never holds partial output.
    With ``force`` an existing destination is replaced (a directory is renamed away, the
    new one renamed in, then the old one deleted, so one of them is always there).

    A write the file system refuses (an ``OSError`` whose ``errno`` is in ``WRITE_ERRNOS``:
    a full disk, say; or any ``OSError`` naming a file of the output) becomes one
    ``OutputWriteError``: it names the destination, the file or step (``writing``) being
    written, and what is left there (nothing, or the old destination, unchanged).

    Raises:
        FileNotFoundError: the parent directory of ``destination`` does not exist, or a
            block with ``is_dir=False`` wrote nothing.
        FileExistsError: ``destination`` exists and ``force`` is False (checked on entry,
            before anything is written, and again before the rename).
        OutputWriteError: the output could not be written (see above).

    Example:
        >>> import tempfile
        >>> out = Path(tempfile.mkdtemp()) / "converted"
        >>> with atomic_output(out) as tmp:
        ...     _ = (tmp / "config.json").write_text("{}")
        >>> sorted(p.name for p in out.iterdir())
        ['config.json']
        >>> try:
        ...     with atomic_output(out.with_name("full")) as tmp, writing("config.json"):
        ...         raise OSError(errno.ENOSPC, "No space left on device")  # the disk filled
        ... except OutputWriteError as err:
        ...     print(str(err).split(": ", 1)[1])
        No space left on device (ENOSPC) while writing config.json; nothing is left there
        >>> sorted(p.name for p in out.parent.iterdir())
        ['converted']
    """
    target = Path(os.path.abspath(destination))
    if not target.parent.is_dir():
        raise FileNotFoundError(
            f"cannot write {target}: its parent directory {target.parent} does not exist; create it first"
        )
    _refuse_existing(target, force)
    existed = os.path.lexists(target)
    tmp = _sibling(target, "tmp")
    try:
        if is_dir:
            with writing(f"its temporary directory {tmp.name}"):
                tmp.mkdir()
        yield tmp
        if not os.path.lexists(tmp):
            raise FileNotFoundError(f"nothing was written to {tmp}, so {target} was not created")
        _refuse_existing(target, force)
        with writing(f"the rename of {tmp.name} onto it"):
            _swap_in(tmp, target)
    except OSError as err:
        _remove(tmp)
        if not _is_write_failure(err, tmp, target):
            raise
        raise _write_failure(err, tmp, target, existed) from err
    except BaseException:
        _remove(tmp)
        raise


def _is_write_failure(err: OSError, tmp: Path, target: Path) -> bool:
    """Whether ``err`` is the output's file system refusing a write (not, say, a missing source)."""
    if isinstance(err, OutputWriteError | FileExistsError) or err.errno is None:
        return False
    return err.errno in WRITE_ERRNOS or _inside(err.filename, tmp, target) is not None


def _inside(filename, tmp: Path, target: Path) -> str | None:
    """``filename`` relative to the output (``tmp`` stands for ``target``), or None outside it."""
    if not isinstance(filename, str | os.PathLike):
        return None
    path = Path(os.path.abspath(filename))
    for root in (tmp, target):
        if path == root or root in path.parents:
            return str(path.relative_to(root)) if path != root else target.name
    return None


def _write_failure(err: OSError, tmp: Path, target: Path, existed: bool) -> OutputWriteError:
    """One line: the destination, the reason, the file or step being written, what is left."""
    what = getattr(err, "writing", None) or _inside(err.filename, tmp, target) or "it"
    reason = os.strerror(err.errno)
    name = errno.errorcode.get(err.errno, str(err.errno))
    left = f"the existing {target.name} is unchanged" if existed else "nothing is left there"
    left = getattr(err, "left", left)
    message = f"could not write {str(target)!r}: {reason} ({name}) while writing {what}; {left}"
    return OutputWriteError(err.errno, message)
