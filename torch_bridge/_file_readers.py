"""The per-format readers of ``_sources``: one safetensors or torch weight file, its rows
(name, shape, dtype, bytes) from the header alone, and its tensors one at a time.
"""

import json
import math
import os
import zipfile
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import safetensors

from torch_bridge.interop import numpy_dtype, tensor_to_numpy, torch

SAFETENSORS_DTYPES = {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16,
    "U32": np.uint32, "I32": np.int32, "U64": np.uint64, "I64": np.int64, "F16": np.float16,
    "BF16": ml_dtypes.bfloat16, "F32": np.float32, "F64": np.float64, "C64": np.complex64,
}  # fmt: skip


def _corrupt(path: Path, reason: str, kind: str = "safetensors") -> ValueError:
    hint = "It may be truncated or corrupt; download or save it again."
    return ValueError(f"{path} is not a valid {kind} file: {reason}. {hint}")


def _read_st_header(path: Path) -> tuple[dict, int]:
    """The JSON header of a safetensors file and the number of data bytes after it."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise _corrupt(path, f"it has {size} bytes, fewer than the 8-byte header length")
        length = int.from_bytes(head, "little")
        if length > size - 8:
            raise _corrupt(path, f"the header claims {length} bytes but only {size - 8} follow")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _corrupt(path, f"its header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise _corrupt(path, f"its header is a JSON {type(header).__name__}, not an object")
    return header, size - 8 - length


def _safetensors_rows(path: Path) -> list[tuple[str, tuple[int, ...], np.dtype, int]]:
    header, data_size = _read_st_header(path)
    rows = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            dims = (*shape, begin, end)
            if not (isinstance(dtype, str) and all(isinstance(d, int) and d >= 0 for d in dims)):
                raise TypeError
        except (TypeError, KeyError, ValueError):
            raise _corrupt(path, f"the header entry of tensor {key!r} is malformed: {info!r}") from None
        if dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: tensor {key!r} has dtype {dtype}, which numpy cannot hold")
        np_dtype = np.dtype(SAFETENSORS_DTYPES[dtype])
        if end - begin != math.prod(shape) * np_dtype.itemsize:
            raise _corrupt(path, f"tensor {key!r} spans bytes {begin}..{end}, not {shape} of {dtype}")
        if end > data_size:
            raise _corrupt(path, f"tensor {key!r} ends at data byte {end} but the file has {data_size}")
        rows.append((begin, (key, shape, np_dtype, end - begin)))
    return [row for _, row in sorted(rows, key=lambda r: r[0])]


class _SafetensorsReader:
    rows = staticmethod(_safetensors_rows)

    def __init__(self, path: Path):
        self.path = path
        try:
            self._file = safetensors.safe_open(str(path), framework="np")
        except safetensors.SafetensorError as err:
            raise _corrupt(path, str(err)) from err

    def get(self, key: str) -> np.ndarray:
        try:
            return self._file.get_tensor(key)
        except safetensors.SafetensorError as err:
            raise ValueError(f"{self.path}: cannot read tensor {key!r} ({err})") from err

    def close(self) -> None:
        self._file.__exit__(None, None, None)


def is_zip(path: Path) -> bool:
    """Whether ``path`` is a zip file (one whose end record is damaged is not)."""
    try:
        return zipfile.is_zipfile(path)
    except zipfile.BadZipFile:  # is_zipfile raises it for an end record claiming several disks
        return False


def _torch_load(path: Path) -> Any:
    mmap = is_zip(path)
    # torch can only mmap the zip format (torch >= 1.6). The legacy format (and a file too
    # damaged to be recognised as zip) is loaded whole with mmap=False.
    try:
        return torch().load(path, mmap=mmap, weights_only=True, map_location="cpu")
    except Exception as err:  # torch raises RuntimeError, EOFError, KeyError, UnpicklingError...
        raise _corrupt(path, f"torch.load failed ({_first_line(err)})", "PyTorch") from err


def _first_line(err: Exception) -> str:
    """``Type: message`` on one line: torch's weights-only unpickler explains its policy on
    several lines around the one that says what failed."""
    text = str(err)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1].split("Check the documentation", 1)[0]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else 'no message'}"


def _state_dict(obj: Any, path: Path) -> dict:
    """The flat ``{name: tensor}`` dict in what ``torch.load`` returned (maybe nested)."""
    is_tensor, found = torch().is_tensor, obj
    if isinstance(obj, dict) and not any(map(is_tensor, obj.values())):
        found = next((obj[k] for k in ("state_dict", "model") if isinstance(obj.get(k), dict)), obj)
    if not isinstance(found, dict) or (found and not any(map(is_tensor, found.values()))):
        top = f"a dict with top-level keys {list(obj)[:20]}" if isinstance(obj, dict) else None
        raise ValueError(
            f"{path} holds {top or 'a ' + type(obj).__name__}; expected a state_dict (a dict of "
            "tensors), or one stored under the key 'state_dict' or 'model'"
        )
    for key, value in found.items():
        if not is_tensor(value):
            raise ValueError(
                f"{path}: state_dict entry {key!r} is a {type(value).__name__}, not a tensor; "
                "save a flat {name: tensor} dict such as model.state_dict()"
            )
    return found


def _numpy_dtype(tensor: Any, key: str, path: Path) -> np.dtype:
    dtype = numpy_dtype(tensor.dtype)
    if dtype is None:
        name = str(tensor.dtype).removeprefix("torch.")
        raise ValueError(f"{path}: tensor {key!r} has dtype torch.{name}, which numpy cannot hold")
    return dtype


def _to_numpy(tensor: Any, key: str, path: Path) -> np.ndarray:
    """A numpy view of a CPU tensor (a copy only when it is not contiguous)."""
    _numpy_dtype(tensor, key, path)
    return tensor_to_numpy(tensor.contiguous())


def _torch_rows(path: Path) -> list[tuple[str, tuple[int, ...], np.dtype, int]]:
    state = _state_dict(_torch_load(path), path)
    return [
        (key, tuple(t.shape), _numpy_dtype(t, key, path), t.numel() * t.element_size())
        for key, t in state.items()
    ]


class _TorchReader:
    rows = staticmethod(_torch_rows)

    def __init__(self, path: Path):
        self.path, self._state = path, _state_dict(_torch_load(path), path)

    def get(self, key: str) -> np.ndarray:
        return _to_numpy(self._state[key], key, self.path)

    def close(self) -> None:
        self._state = {}  # the mmap goes when the last tensor (or array viewing it) does


def reader_of(path: Path) -> type["FileReader"]:
    """The reader class of a weight file, by its suffix."""
    return _SafetensorsReader if path.suffix == ".safetensors" else _TorchReader


FileReader = _SafetensorsReader | _TorchReader
"""An open weight file: ``get(key)`` reads one tensor, ``close()`` lets it go."""
