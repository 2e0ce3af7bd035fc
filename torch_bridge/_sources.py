"""Streaming reads of PyTorch / Hugging Face checkpoints, one tensor at a time (the per-file
readers are ``_file_readers``).

``open_tensors`` finds the weight files of a checkpoint (a directory in any layout of
``WEIGHT_LAYOUTS``, or one ``.safetensors`` / ``.pt`` / ``.pth`` / ``.bin`` file), reads
every name, shape and dtype from the headers alone, and returns a ``TensorSource`` that
reads tensors on demand. torch files are memory-mapped (the legacy non-zip format cannot be).
"""

import difflib
import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from torch_bridge._file_readers import FileReader, reader_of

WEIGHT_LAYOUTS = (
    "model.safetensors",
    "model.safetensors.index.json (sharded safetensors)",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json (sharded .bin)",
)
_LAYOUT_FILES = tuple(layout.split()[0] for layout in WEIGHT_LAYOUTS)
FILE_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")
GGUF_HINT = (
    "GGUF is llama.cpp's format, often quantized, which torch_bridge does not read; convert it to a "
    "Hugging Face directory first: transformers.AutoModelForCausalLM.from_pretrained(directory, "
    "gguf_file=NAME).save_pretrained(OUT) (needs the gguf package), then pass OUT"
)


@dataclass(frozen=True)
class _Meta:
    file: int
    shape: tuple[int, ...]
    dtype: np.dtype
    nbytes: int


def _read_index(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        if not all(isinstance(shard, str) for shard in weight_map.values()):
            raise TypeError
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{index} is not valid JSON ({err}); download or write it again") from None
    except (KeyError, TypeError, AttributeError):
        raise ValueError(f'{index} needs a "weight_map" object mapping each tensor to a shard file') from None
    for key, shard in weight_map.items():
        if not (index.parent / shard).is_file():
            raise FileNotFoundError(
                f"{index} puts tensor {key!r} in shard {shard!r}, but {index.parent / shard} does "
                "not exist; download the missing shard"
            )
    return weight_map


def _is_gguf(path: Path) -> bool:
    """A GGUF file: by its suffix, or its magic bytes ``GGUF`` at offset 0 (whatever its name)."""
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _weight_files(path: Path) -> tuple[list[Path], Path | None, dict[str, str]]:
    """The weight files of ``path`` in storage order, the index naming them, its weight_map."""
    if path.is_file() and _is_gguf(path):
        raise ValueError(f"{path}: a GGUF file; {GGUF_HINT}")
    if path.is_file():
        if path.suffix not in FILE_SUFFIXES:
            raise ValueError(f"{path}: cannot tell its format; expected a file ending in {FILE_SUFFIXES}")
        return [path], None, {}
    if not path.is_dir():
        raise FileNotFoundError(f"{path} does not exist")
    for name in _LAYOUT_FILES:
        if (path / name).is_file():
            if not name.endswith(".index.json"):
                return [path / name], None, {}
            weight_map = _read_index(path / name)
            return [path / shard for shard in sorted(set(weight_map.values()))], path / name, weight_map
    gguf = sorted(p.name for p in path.glob("*.gguf"))
    if gguf:
        raise ValueError(f"{path} holds GGUF files ({', '.join(gguf)}) and no other weights; {GGUF_HINT}")
    raise FileNotFoundError(
        f"{path} holds no weights: looked for {', '.join(WEIGHT_LAYOUTS)}; "
        "pass the checkpoint directory or one weight file"
    )


def _scan(files: list[Path]) -> dict[str, _Meta]:
    metas: dict[str, _Meta] = {}
    for number, file in enumerate(files):
        for key, shape, dtype, nbytes in reader_of(file).rows(file):
            if key in metas:
                raise ValueError(
                    f"tensor {key!r} is stored twice: in {files[metas[key].file]} and in {file}; "
                    "remove one copy"
                )
            metas[key] = _Meta(number, shape, dtype, nbytes)
    return metas


def _check_index(index: Path, weight_map: dict[str, str], files: list[Path], metas: dict[str, _Meta]) -> None:
    for key, shard in weight_map.items():
        where = files[metas[key].file] if key in metas else None
        if where != index.parent / shard:
            found = f"it is in {where}" if where else "no shard holds it"
            raise ValueError(
                f"{index} puts tensor {key!r} in {index.parent / shard}, but {found}; "
                "the index and the shards disagree, download them again"
            )


class TensorSource:
    """The tensors of a checkpoint, read one at a time (see ``open_tensors``).

    Names, shapes, dtypes and sizes come from the headers; ``source[key]`` and
    ``items()`` read data. At most one file is kept open for ``source[key]``; ``close()``
    (or leaving a ``with`` block) releases it. A closed source reopens files on demand.

    Example:
        >>> import tempfile, safetensors.numpy
        >>> d = Path(tempfile.mkdtemp())
        >>> safetensors.numpy.save_file({"b": np.zeros(7, np.int64), "w": np.ones((3, 5))},
        ...                             str(d / "model.safetensors"))
        >>> with open_tensors(d) as src:
        ...     src.keys(), src.shape("w"), src.dtype("b"), src.nbytes(), "w" in src, len(src)
        (['b', 'w'], (3, 5), dtype('int64'), 176, True, 2)
        >>> [(k, v.sum().item()) for k, v in open_tensors(d).items()]
        [('b', 0), ('w', 15.0)]
    """

    def __init__(self, files: list[Path], metas: dict[str, _Meta]):
        self.files, self._metas = tuple(files), metas
        self._open: tuple[int, FileReader] | None = None

    def keys(self) -> list[str]:
        """Every tensor name, file by file in storage order."""
        return list(self._metas)

    def __contains__(self, key: object) -> bool:
        return key in self._metas

    def __len__(self) -> int:
        return len(self._metas)

    def __iter__(self) -> Iterator[str]:
        return iter(self._metas)

    def _meta(self, key: str) -> _Meta:
        if key not in self._metas:
            close = difflib.get_close_matches(key, self._metas, n=3) if isinstance(key, str) else []
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            where = self.files[0] if len(self.files) == 1 else [str(f) for f in self.files]
            raise KeyError(f"no tensor {key!r} in {where}{hint}")
        return self._metas[key]

    def shape(self, key: str) -> tuple[int, ...]:
        """The shape of tensor ``key`` (no data read)."""
        return self._meta(key).shape

    def dtype(self, key: str) -> np.dtype:
        """The numpy dtype of tensor ``key`` (bf16 is ``ml_dtypes.bfloat16``; no data read)."""
        return self._meta(key).dtype

    def file_of(self, key: str) -> Path:
        """The weight file that holds tensor ``key``."""
        return self.files[self._meta(key).file]

    def nbytes(self) -> int:
        """The total size of all tensors in bytes, from the headers."""
        return sum(meta.nbytes for meta in self._metas.values())

    def __getitem__(self, key: str) -> np.ndarray:
        """Read one tensor, keeping its file open for the next read from the same file."""
        number = self._meta(key).file
        if self._open is None or self._open[0] != number:
            self.close()
            self._open = (number, reader_of(self.files[number])(self.files[number]))
        return self._open[1].get(key)

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        """Every ``(name, array)`` in storage order; one file open at a time, each opened once."""
        for number, keys in itertools.groupby(self._metas, lambda key: self._metas[key].file):
            reader = reader_of(self.files[number])(self.files[number])
            try:
                for key in keys:
                    yield key, reader.get(key)
            finally:
                reader.close()

    def close(self) -> None:
        """Release the file kept open by ``source[key]``."""
        if self._open is not None:
            self._open[1].close()
            self._open = None

    def __enter__(self) -> "TensorSource":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TensorSource({len(self)} tensors in {[str(f) for f in self.files]})"


def open_tensors(path: str | os.PathLike) -> TensorSource:
    """Open the weights of a checkpoint directory or file for streaming.

    Args:
        path: a directory in one of the ``WEIGHT_LAYOUTS`` (safetensors preferred when
            both exist), or one ``.safetensors``, ``.pt``, ``.pth`` or ``.bin`` file. A
            torch file may hold a state_dict, or one under the key ``"state_dict"`` or
            ``"model"``.

    Returns:
        A ``TensorSource``; every header has been read and checked, no tensor data.

    Raises:
        FileNotFoundError: no such path, no weights in the directory, or a missing shard.
        ValueError: a corrupt or truncated file, a bad index, a tensor stored twice, an
            index that disagrees with its shards, or a torch file that is not a state_dict.

    Example:
        >>> import tempfile, torch
        >>> f = Path(tempfile.mkdtemp()) / "ckpt.pt"
        >>> torch.save({"state_dict": {"w": torch.ones(3, 5, dtype=torch.bfloat16)}}, f)
        >>> src = open_tensors(f)
        >>> src.keys(), src.dtype("w"), src["w"].shape
        (['w'], dtype(bfloat16), (3, 5))
    """
    files, index, weight_map = _weight_files(Path(path))
    metas = _scan(files)
    if index is not None:
        _check_index(index, weight_map, files, metas)
    return TensorSource(files, metas)


def find_config(path: str | os.PathLike) -> Path | None:
    """The ``config.json`` of a checkpoint directory; None for a file or when absent.

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp())
        >>> find_config(d) is None, (d / "config.json").write_text("{}"), find_config(d).name
        (True, 2, 'config.json')
    """
    config = Path(path) / "config.json"
    return config if Path(path).is_dir() and config.is_file() else None
