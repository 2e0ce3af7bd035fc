"""Writers that never leave a partial output: HF safetensors shards, torch files, swaps.

``write_safetensors`` writes the layout ``transformers`` writes (``model.safetensors``,
or numbered shards plus ``model.safetensors.index.json``), one shard in memory at a time;
``write_torch_file`` a ``.pt``. Both write through ``atomic_output`` (``_atomic.py``).
"""

import json
import math
import struct
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np

from jaxckpt._sizes import parse_size
from torch_bridge._atomic import atomic_output, writing
from torch_bridge._file_readers import SAFETENSORS_DTYPES
from torch_bridge.interop import numpy_to_tensor, torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


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
