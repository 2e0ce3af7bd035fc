"""The fuzzed readers of weights and their config: safetensors, torch's ``.bin``/``.pt``,
``config.json`` and an orbax checkpoint as ``jaxckpt convert`` writes it (see ``fuzz_mutations``
for how a case runs, ``fuzz_cases`` for every reader)."""

import contextlib
import io
import json
import random
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
from fuzz_mutations import (
    PRISTINE,
    Mutation,
    Reader,
    binary,
    flip,
    not_object,
    replace,
    set_field,
    tensors,
    truncate,
)

LLAMA_CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 301, "hidden_size": 25,
    "intermediate_size": 37, "num_hidden_layers": 3, "num_attention_heads": 5, "num_key_value_heads": 1,
    "head_dim": 6, "max_position_embeddings": 64, "rms_norm_eps": 1e-05, "hidden_act": "silu",
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "bos_token_id": 1,
    "rope_parameters": {"rope_theta": 500.0, "rope_type": "default"},
}  # fmt: skip
"""The config.json of ``torch_models.tiny_llama`` (the fields its reader reads, and ids)."""

SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
SIZES += ("num_key_value_heads", "head_dim", "max_position_embeddings")
KINDS = dict.fromkeys(SIZES, "size") | {"rms_norm_eps": "number", "rope_parameters.rope_theta": "number"}
KINDS |= {"rope_theta": "number", "hidden_act": "str", "model_type": "str", "rope_parameters": "object"}
KINDS |= dict.fromkeys(("tie_word_embeddings", "attention_bias", "mlp_bias"), "bool")
"""The config.json fields a LLaMA config is read by, and their kind (this file's own list)."""

WRONG = {
    "size": ("25", 2.5, [25], {"n": 25}, True, 1e30),
    "number": ("1e-5", [1e-5], {"eps": 1}, True, None, float("nan"), float("inf")),
    "str": (5, ["silu"], None, True, {"name": "silu"}),
    "bool": ("false", "true", 0, 1, [False], None),
    "object": (5, "default", [1, 2], True),
}
"""Per kind, values of the wrong type (or not finite): each must be refused."""

BAD_SIZES = (0, -1, -8, -(2**40))


# ---------------------------------------------------------------- safetensors


def _build_safetensors(d: Path) -> None:
    import safetensors.numpy

    rng = np.random.default_rng(0)
    arrays = {"a.weight": rng.standard_normal((3, 5)).astype(np.float32), "b.bias": np.arange(7)}
    arrays |= {
        "c.half": rng.standard_normal((2, 3)).astype(np.float16),
        "d.u8": np.arange(11, dtype=np.uint8),
    }
    safetensors.numpy.save_file(arrays, str(d / "model.safetensors"), metadata={"format": "pt"})


def _read_tensors(path: Path) -> dict:
    from torch_bridge import open_tensors

    with open_tensors(path) as source:
        return tensors(source.items())


def _st_header(data: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _st_bytes(header, body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + body


def _header_length(rng: random.Random, old: bytes) -> bytes:
    n = int.from_bytes(old[:8], "little")
    choices = [0, 1, 7, n - 1, n + 1, n + 8, len(old) - 7, len(old), 2**63, 2**64 - 1, rng.randrange(2**32)]
    new = rng.choice([c for c in choices if c != n])
    return new.to_bytes(8, "little") + old[8:]


def _entry_mutations(info: dict) -> list:
    begin, end = info["data_offsets"]
    shape = list(info["shape"])
    bigger = [*shape[:-1], shape[-1] + 1] if shape else [2]
    resized = "U8" if info["dtype"] not in ("U8", "I8", "BOOL") else "F64"  # another item size
    return [
        ("dtype", "F33"), ("dtype", 5), ("dtype", None), ("dtype", resized),
        ("shape", [-1]), ("shape", ["3"]), ("shape", bigger), ("shape", 5), ("shape", [2**62, 2**62]),
        ("data_offsets", [end, begin]), ("data_offsets", [begin, end + 10**6]), ("data_offsets", [0]),
        ("data_offsets", "0-8"), ("data_offsets", [begin, end, end]), ("data_offsets", [-1, end]),
        ("data_offsets", [begin + 1, end + 1]), ("data_offsets", [float(begin), float(end)]),
    ]  # fmt: skip


def _header_json(rng: random.Random, old: bytes) -> bytes:
    header, body = _st_header(old)
    key = rng.choice([k for k in header if k != "__metadata__"])
    choice = rng.randrange(4)
    if choice == 0:  # one field of one entry set to a wrong value
        field, value = rng.choice(_entry_mutations(header[key]))
        header[key] = {**header[key], field: value}
    elif choice == 1:  # one field missing
        gone = rng.choice(list(header[key]))
        header[key] = {k: v for k, v in header[key].items() if k != gone}
    elif choice == 2:  # the entry is not an object, or the header is not one
        header[key] = rng.choice([[1, 2], 5, "F32", None])
        header = header if rng.random() < 0.7 else list(header.items())
    else:  # the __metadata__ of the wrong type
        header["__metadata__"] = rng.choice([5, ["format", "pt"], {"format": 5}])
    return _st_bytes(header, body)


def _offsets(rng: random.Random, old: bytes) -> bytes:
    """Out of range, overlapping, with a gap, or past the end."""
    header, body = _st_header(old)
    keys = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    a, b = rng.sample(keys, 2)
    (a0, a1), (b0, b1) = header[a]["data_offsets"], header[b]["data_offsets"]
    choice = rng.randrange(4)
    if choice == 0:  # b overlaps a
        header[b]["data_offsets"] = [a0, a0 + b1 - b0]
    elif choice == 1:  # past the end of the data
        header[b]["data_offsets"] = [len(body) + b0, len(body) + b1]
    elif choice == 2:  # every tensor moved: a gap at the start and the last one past the end
        shift = rng.randrange(1, 64)
        for k in keys:
            header[k]["data_offsets"] = [o + shift for o in header[k]["data_offsets"]]
    else:  # the two swapped when of different sizes, or a gap left at the end
        if a1 - a0 != b1 - b0:
            header[a]["data_offsets"], header[b]["data_offsets"] = [b0, b0 + a1 - a0], [a0, a0 + b1 - b0]
        else:
            body += bytes(rng.randrange(1, 9))
    return _st_bytes(header, body)


def _st_reference(path: Path) -> dict:
    import safetensors.numpy

    return tensors(safetensors.numpy.load((path / "model.safetensors").read_bytes()).items())


def _data_start(data: bytes) -> int:
    return 8 + int.from_bytes(data[:8], "little")


ST = "model.safetensors"
SAFETENSORS = Reader(
    "safetensors",
    _build_safetensors,
    lambda d: _read_tensors(d / ST),
    _st_reference,
    {
        "header_length": replace(ST, _header_length, "header length"),
        "header_json": replace(ST, _header_json, "header"),
        "offsets": replace(ST, _offsets, "offsets"),
        "truncate": truncate(ST),
        "flip": flip(ST),
        "flip_data": flip(ST, start=_data_start),
    },
)


# ---------------------------------------------------------------- .bin / .pt (torch's zip)


def _build_bin(d: Path) -> None:
    import torch

    torch.manual_seed(0)
    state = {"a.weight": torch.randn(3, 5), "b.bias": torch.arange(7), "c.half": torch.randn(2, 3).half()}
    torch.save(state, d / "pytorch_model.bin")


def _bin_reference(d: Path) -> dict:
    import torch

    from torch_bridge._file_readers import _to_numpy, is_zip

    # as torch_bridge loads it: torch can mmap only its zip format (and then checks no CRC)
    state = torch.load(d / BIN, weights_only=True, map_location="cpu", mmap=is_zip(d / BIN))
    return tensors((k, _to_numpy(v, k, d)) for k, v in state.items())


BIN = "pytorch_model.bin"
TORCH_BIN = Reader(
    "bin/pt",
    _build_bin,
    lambda d: _read_tensors(d / BIN),
    _bin_reference,
    {"truncate": truncate(BIN), "flip": flip(BIN)},
)


# ---------------------------------------------------------------- config.json


def _build_config(d: Path) -> None:
    (d / "config.json").write_text(json.dumps(LLAMA_CONFIG, indent=2) + "\n")


def _read_config(d: Path) -> dict:
    from torch_bridge import config_from_hf

    return config_from_hf(d).to_dict()


def config_change(rng: random.Random, *, sizes: bool) -> tuple[str, object]:
    """A field of ``KINDS`` and a value it must refuse: of the wrong type, or (``sizes``) a
    size that is not positive."""
    if sizes:
        return rng.choice(SIZES), rng.choice(BAD_SIZES)
    field = rng.choice(sorted(KINDS))
    return field, rng.choice(WRONG[KINDS[field]])


def _field_mutation(sizes: bool) -> Mutation:
    def apply(rng: random.Random, d: Path) -> tuple[str, tuple[str, ...]]:
        field, value = config_change(rng, sizes=sizes)
        (d / "config.json").write_text(json.dumps(set_field(LLAMA_CONFIG, field, value)))
        return f"config.json: {field}={value!r}", ("config.json", field.split(".")[-1])

    return Mutation(apply, True)


CONFIG = Reader(
    "config.json",
    _build_config,
    _read_config,
    None,
    {
        "truncate": truncate("config.json", before_last=b"}"),
        "binary": replace("config.json", binary, "random bytes"),
        "not_object": replace("config.json", not_object, "not an object"),
        "wrong_type": _field_mutation(sizes=False),
        "bad_size": _field_mutation(sizes=True),
    },
)


# ---------------------------------------------------------------- orbax checkpoint (jaxckpt convert's output)


def build_hf(path: Path) -> Path:
    """A Hugging Face directory (config.json: ``LLAMA_CONFIG``; model.safetensors) of a random
    jaxckpt LLaMA, written by ``torch_bridge.save_hf`` (no torch needed)."""
    from flax import nnx

    import torch_bridge
    from jaxckpt import nn

    config = torch_bridge.config_from_hf(LLAMA_CONFIG)
    torch_bridge.save_hf(nn.Transformer(config, rngs=nnx.Rngs(0)), path)
    (path / "config.json").write_text(json.dumps(LLAMA_CONFIG, indent=2) + "\n")
    return path


def _build_orbax(d: Path) -> None:
    """``build_hf``'s LLaMA as ``jaxckpt convert`` writes it (an orbax checkpoint and jaxckpt.json)."""
    from jaxckpt.cli import main

    with tempfile.TemporaryDirectory() as tmp:
        hf = build_hf(Path(tmp) / "hf")
        with contextlib.redirect_stdout(io.StringIO()):
            main(["convert", str(hf), str(d), "--force", "--json"])


def _params(tree) -> dict:
    from torch_bridge._convert import flatten

    return tensors((k, np.asarray(v)) for k, v in flatten(tree).items())


def _read_orbax(d: Path) -> dict:
    from torch_bridge._cli import _restore

    return _params(_restore(d)[2])


ORBAX_FILES = ("0/_CHECKPOINT_METADATA", "0/default/_METADATA", "0/default/manifest.ocdbt")
ORBAX_FILES += ("0/default/ocdbt.process_0/manifest.ocdbt",)


def _array_files(d: Path) -> list[Path]:
    return sorted(p for p in (d / "0" / "default").rglob("*") if p.is_file() and p.parent.name == "d")


def _meta_types(rng: random.Random, old: bytes) -> bytes:
    """A field of jaxckpt.json that the reader reads, set to a value of the wrong type."""
    meta = json.loads(old)
    field = rng.choice(["config", "arch", "kind", "param_dtypes", "checkpoints", "config.d_model",
                        "config.n_layers", "config.dtype", "config.family", "config.vocab_size",
                        "param_dtypes.*"])  # fmt: skip
    value = rng.choice([5, "x", [1], {"a": 1}, None, -3, True])
    if field == "param_dtypes.*":  # one parameter's dtype (its path has dots)
        meta["param_dtypes"][rng.choice(sorted(meta["param_dtypes"]))] = value
    else:
        meta = set_field(meta, field, value)
    return json.dumps(meta).encode()


def _orbax_file(change: Callable[[random.Random, bytes], bytes | None], what: str) -> Mutation:
    """One of orbax's metadata files, or of its array files, changed (None: deleted). The error
    names the checkpoint directory (orbax's own file names mean little to a user)."""

    def apply(rng: random.Random, d: Path) -> tuple[str, tuple[str, ...]]:
        files = [d / f for f in ORBAX_FILES] if what.startswith("metadata") else _array_files(d)
        file = rng.choice(files)
        new = change(rng, file.read_bytes())
        file.unlink() if new is None else file.write_bytes(new)
        return f"{file.relative_to(d)}: {what}", (d.name,)

    return Mutation(apply, False)


def _checkpoint_name(d: Path, names: tuple[str, ...]) -> tuple[str, ...]:
    """A jaxckpt.json that still parses may be found wrong only against the arrays: the
    error names the checkpoint (the directory holding jaxckpt.json)."""
    return (d.name,)


def _named(mutation: Mutation, names: Callable[[Path, tuple[str, ...]], tuple[str, ...]]) -> Mutation:
    """``mutation`` with the names the error must give chosen by ``names(directory, its own)``."""

    def apply(rng: random.Random, d: Path) -> tuple[str, tuple[str, ...]]:
        what, own = mutation.apply(rng, d)
        return what, names(d, own)

    return Mutation(apply, mutation.detectable)


def _cut(rng: random.Random, old: bytes) -> bytes:
    return old[: rng.randrange(len(old))]


def _garble(rng: random.Random, old: bytes) -> bytes:
    if rng.random() < 0.5:
        return rng.randbytes(rng.randrange(1, 64))
    at = rng.randrange(len(old))
    return old[:at] + bytes([old[at] ^ rng.randrange(1, 256)]) + old[at + 1 :]


META = "jaxckpt.json"
ORBAX = Reader(
    "orbax",
    _build_orbax,
    _read_orbax,
    PRISTINE,
    {
        "meta_truncate": truncate(META, before_last=b"}"),
        "meta_flip": _named(flip(META), _checkpoint_name),
        # a wrong param_dtypes entry that is never looked up changes nothing: success counts
        # only when every array comes back as in the pristine checkpoint
        "meta_wrong_type": _named(Mutation(replace(META, _meta_types, "").apply, False), _checkpoint_name),
        "metadata_truncate": _orbax_file(_cut, "metadata truncated"),
        "metadata_garble": _orbax_file(_garble, "metadata garbled"),
        "array_deleted": _orbax_file(lambda rng, old: None, "array file deleted"),
        "array_truncate": _orbax_file(_cut, "array file truncated"),
    },
)
