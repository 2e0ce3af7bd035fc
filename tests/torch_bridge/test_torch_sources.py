"""torch_bridge readers (every HF / torch layout, every corruption) and atomic writers."""

import json
import os
import struct
import weakref

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy

from torch_bridge._atomic import atomic_output
from torch_bridge._sources import WEIGHT_LAYOUTS, find_config, open_tensors
from torch_bridge._writers import parse_shard_size, write_safetensors, write_torch_file

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")

RNG = np.random.default_rng(0)
ARRAYS = {  # odd, pairwise-distinct shapes; every dtype family; 0-d included
    "embed.weight": RNG.standard_normal((3, 5)).astype(ml_dtypes.bfloat16),
    "norm.weight": RNG.standard_normal(7).astype(np.float16),
    "proj.weight": RNG.standard_normal((5, 3)).astype(np.float32),
    "positions": np.arange(11, dtype=np.int64) * 3 - 7,
    "scale": np.array(2.5, dtype=np.float32),
}
SPECS = [(k, a.shape, a.dtype) for k, a in ARRAYS.items()]


def _torch(array):
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy())


def _state(keys=ARRAYS):
    return {k: _torch(ARRAYS[k]) for k in keys}


def _st(path, **arrays):
    safetensors.numpy.save_file(arrays, str(path))


def _same(a, b):
    assert (a.shape, a.dtype) == (b.shape, b.dtype) and a.tobytes() == b.tobytes()


def _write_bin_shards(d, groups):
    weight_map = {}
    for i, keys in enumerate(groups, 1):
        name = f"pytorch_model-{i:05d}-of-{len(groups):05d}.bin"
        torch.save(_state(keys), d / name)
        weight_map |= dict.fromkeys(keys, name)
    (d / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _layout(kind, d):
    """Write ARRAYS in layout ``kind`` under ``d``; return the path to open."""
    if kind in ("safetensors", "sharded_safetensors"):
        write_safetensors(d, SPECS, ARRAYS.__getitem__, max_shard_size=10**6 if kind == "safetensors" else 40)
        return d
    if kind == "bin":
        torch.save(_state(), d / "pytorch_model.bin")
        return d
    if kind == "sharded_bin":
        _write_bin_shards(d, [["positions", "embed.weight"], ["scale", "norm.weight", "proj.weight"]])
        return d
    if kind == "file.safetensors":
        _st(d / "weights.safetensors", **ARRAYS)
        return d / "weights.safetensors"
    payload = {"pt": _state(), "nested_state_dict": {"state_dict": _state(), "epoch": 3}}
    payload["nested_model"] = {"model": _state(), "optimizer": {"lr": 0.1}}
    path = d / ("ckpt.pth" if kind == "legacy_pth" else "ckpt.pt")  # legacy: torch's pre-1.6 non-zip format
    torch.save(payload.get(kind, _state()), path, _use_new_zipfile_serialization=kind != "legacy_pth")
    return path


LAYOUTS = ["safetensors", "sharded_safetensors", "bin", "sharded_bin", "file.safetensors", "pt"]
LAYOUTS += ["nested_state_dict", "nested_model", "legacy_pth"]


@pytest.mark.parametrize("kind", LAYOUTS)
def test_every_layout_reads_bit_identical(tmp_path, kind):
    with open_tensors(_layout(kind, tmp_path)) as src:
        assert sorted(src.keys()) == sorted(ARRAYS) and len(src) == len(ARRAYS)
        assert src.nbytes() == sum(a.nbytes for a in ARRAYS.values())
        for key, array in ARRAYS.items():
            assert key in src and src.shape(key) == array.shape and src.dtype(key) == array.dtype
            assert src.file_of(key) in src.files
            _same(src[key], array)
        # keys are grouped file by file, in the order of src.files; items() follows keys()
        order = [src.files.index(src.file_of(k)) for k in src]
        assert order == sorted(order)
        streamed = list(src.items())
    assert [k for k, _ in streamed] == src.keys()
    for key, array in streamed:
        _same(array, ARRAYS[key])
    assert (len(src.files) > 1) == kind.startswith("sharded")
    if kind == "sharded_bin":  # torch files keep their dict order
        assert src.keys() == ["positions", "embed.weight", "scale", "norm.weight", "proj.weight"]


def _count_safe_open(monkeypatch):
    calls, live, real = [], [], safetensors.safe_open

    class Spy:
        def __init__(self, path, framework):
            self._file, self._path = real(path, framework=framework), path
            calls.append(os.path.basename(path))
            live.append(path)
            assert len(live) == 1, f"two files open at once: {live}"

        get_tensor = property(lambda self: self._file.get_tensor)

        def __exit__(self, *exc):
            live.remove(self._path)
            return self._file.__exit__(*exc)

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    return calls, live


def test_items_opens_each_safetensors_shard_once_one_at_a_time(tmp_path, monkeypatch):
    write_safetensors(tmp_path, SPECS, ARRAYS.__getitem__, max_shard_size=40)
    src = open_tensors(tmp_path)  # headers only: no safe_open
    calls, live = _count_safe_open(monkeypatch)
    assert len(list(src.items())) == len(ARRAYS)
    assert calls == [f.name for f in src.files] and not live
    calls.clear()
    for key in src:  # random access keeps one file open, reopens on file change only
        src[key]
    assert calls == [f.name for f in src.files] and len(live) == 1
    src.close()
    assert not live


def test_items_loads_each_torch_shard_once(tmp_path, monkeypatch):
    _write_bin_shards(tmp_path, [["positions", "embed.weight"], ["scale", "norm.weight", "proj.weight"]])
    src = open_tensors(tmp_path)
    calls, real = [], torch.load
    monkeypatch.setattr(torch, "load", lambda f, **kw: calls.append((f.name, kw["mmap"])) or real(f, **kw))
    stream = src.items()
    next(stream)
    assert calls == [(src.files[0].name, True)]  # lazily: the second shard is not loaded yet
    list(stream)
    assert calls == [(f.name, True) for f in src.files]


def test_non_contiguous_and_parameter_tensors(tmp_path):
    base = torch.arange(15, dtype=torch.float32).reshape(3, 5)
    torch.save({"t": base.t(), "p": torch.nn.Parameter(base[:, 1])}, tmp_path / "m.pt")
    src = open_tensors(tmp_path / "m.pt")
    np.testing.assert_array_equal(src["t"], base.t().numpy())
    np.testing.assert_array_equal(src["p"], base[:, 1].numpy())


def test_safetensors_preferred_over_bin_and_find_config(tmp_path):
    torch.save({"only_in_bin": torch.ones(3)}, tmp_path / "pytorch_model.bin")
    _st(tmp_path / "model.safetensors", only_in_st=np.ones(5))
    assert open_tensors(tmp_path).keys() == ["only_in_st"] and find_config(tmp_path) is None
    (tmp_path / "config.json").write_text("{}")
    assert find_config(tmp_path) == tmp_path / "config.json"
    assert find_config(tmp_path / "model.safetensors") is None


def test_missing_key_and_path_errors(tmp_path):
    _layout("safetensors", tmp_path)
    with pytest.raises(KeyError, match=r"'embed\.wieght'.*model\.safetensors.*did you mean 'embed\.weight'"):
        open_tensors(tmp_path)["embed.wieght"]
    with pytest.raises(FileNotFoundError, match=r"nope.*does not exist"):
        open_tensors(tmp_path / "nope")
    (tmp_path / "w.npz").write_bytes(b"")
    with pytest.raises(ValueError, match=r"w\.npz.*\.safetensors"):
        open_tensors(tmp_path / "w.npz")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty holds no weights") as err:
        open_tensors(tmp_path / "empty")
    assert all(layout in str(err.value) for layout in WEIGHT_LAYOUTS)


def _index(**weight_map):
    return json.dumps({"weight_map": {key: f"{shard}.safetensors" for key, shard in weight_map.items()}})


INDEX_CASES = [  # (tensors of each shard, index text, error, message)
    ({"s1": "a"}, _index(a="s1", b="s2"), FileNotFoundError, r"'b' in shard 's2.safetensors'.* not exist"),
    ({"s1": "a"}, "{not json", ValueError, r"model\.safetensors\.index\.json is not valid JSON"),
    ({"s1": "a"}, '{"metadata": {}}', ValueError, r'index\.json needs a "weight_map"'),
    ({"s1": "a"}, _index(a="s1", c="s1"), ValueError, r"tensor 'c' in .*s1.*, but no shard holds it"),
    ({"s1": "a b", "s2": "a c"}, _index(a="s1", c="s2"), ValueError, r"'a' is stored twice: .*s1.*in .*s2"),
    ({"s1": "a b", "s2": "c"}, _index(a="s2", b="s1", c="s2"), ValueError, r"'a' in .*s2.* it is in .*s1"),
]


@pytest.mark.parametrize(("shards", "index", "error", "message"), INDEX_CASES)
def test_index_and_shard_errors(tmp_path, shards, index, error, message):
    for shard, keys in shards.items():
        _st(tmp_path / f"{shard}.safetensors", **{key: np.ones(3) for key in keys.split()})
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(error, match=message):
        open_tensors(tmp_path)


ST_BYTES = safetensors.numpy.save({"a": np.ones((3, 5), np.float32), "b": np.arange(7)})


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (lambda b: b[:5], "fewer than the 8-byte header"),
        (lambda b: struct.pack("<Q", 10**9) + b[8:], "header claims 1000000000 bytes"),
        (lambda b: b[:8] + b"\xff" * (len(b) - 8), "header is not JSON"),
        (lambda b: struct.pack("<Q", 2) + b"[]", "header is a JSON list"),
        (lambda b: b[:-9], "tensor '.' ends at data byte"),
        (lambda b: b.replace(b'"F32"', b"[3,5]"), "header entry of tensor 'a' is malformed"),
        (lambda b: b.replace(b"[3,5]", b"[3,7]"), r"tensor 'a' spans bytes \d+\.\.\d+, not \(3, 7\) of F32"),
        (lambda b: b.replace(b'"F32"', b'"X32"'), "tensor 'a' has dtype X32, which numpy cannot hold"),
    ],
)
def test_corrupt_safetensors_fails_at_open(tmp_path, data, why):
    (tmp_path / "model.safetensors").write_bytes(data(ST_BYTES))
    with pytest.raises(ValueError, match=rf"model\.safetensors(:| is not a valid safetensors file).*{why}"):
        open_tensors(tmp_path)


def test_safetensors_damaged_after_open_fails_at_read(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(ST_BYTES)
    src = open_tensors(tmp_path)
    path.write_bytes(ST_BYTES + b"\0" * 8)  # trailing bytes: safetensors' own check
    with pytest.raises(ValueError, match=r"model\.safetensors is not a valid safetensors file"):
        src["a"]
    path.write_bytes(ST_BYTES[:-9])  # truncated
    with pytest.raises(ValueError, match=r"model\.safetensors is not a valid safetensors file"):
        list(src.items())


@pytest.mark.parametrize("damage", [lambda b: b[: len(b) // 2], lambda b: b"not a pickle", lambda b: b""])
def test_corrupt_torch_file(tmp_path, damage):
    torch.save(_state(), tmp_path / "pytorch_model.bin")
    (tmp_path / "pytorch_model.bin").write_bytes(damage((tmp_path / "pytorch_model.bin").read_bytes()))
    with pytest.raises(ValueError, match=r"pytorch_model\.bin is not a valid PyTorch file: torch\.load"):
        open_tensors(tmp_path)


NOT_STATE_DICTS = [
    ({"epoch": 3, "optimizer": {"lr": 0.1}}, r" holds a dict with top-level keys \['epoch', 'optimizer'\]"),
    ([torch.ones(3)], r" holds a list; expected a state_dict"),
    ({"w": torch.ones(3), "step": 3}, r": state_dict entry 'step' is a int"),
    ({"state_dict": {"w": torch.ones(3), "cfg": {}}}, r": state_dict entry 'cfg' is a dict"),
]


@pytest.mark.parametrize(("obj", "message"), NOT_STATE_DICTS)
def test_torch_file_that_is_not_a_state_dict(tmp_path, obj, message):
    torch.save(obj, tmp_path / "ckpt.pt")
    with pytest.raises(ValueError, match=r"ckpt\.pt" + message):
        open_tensors(tmp_path / "ckpt.pt")


def test_single_file_layout(tmp_path):
    files = write_safetensors(tmp_path, SPECS, ARRAYS.__getitem__, max_shard_size=10**6, metadata={"k": "v"})
    assert files == [tmp_path / "model.safetensors"] and os.listdir(tmp_path) == ["model.safetensors"]
    with safetensors.safe_open(str(files[0]), framework="np") as f:
        assert f.metadata() == {"format": "pt", "k": "v"} and sorted(f.keys()) == sorted(ARRAYS)
    (tmp_path / "t").mkdir()
    array = np.arange(15, dtype=np.float32).reshape(3, 5).T  # not C-contiguous
    write_safetensors(tmp_path / "t", [("t", (5, 3), array.dtype)], lambda _: array, max_shard_size=10)
    np.testing.assert_array_equal(open_tensors(tmp_path / "t")["t"], array)


def test_sharded_layout_plan_and_index(tmp_path):
    events, alive = [], []

    def get(key):
        events.append(key)
        alive[:] = [r for r in alive if r() is not None]
        assert not alive, "write_safetensors holds one tensor at a time"
        array = ARRAYS[key].copy()
        alive.append(weakref.ref(array))
        return array

    # sizes in bytes: embed 30, norm 14, proj 60 (> 40: its own shard), positions 88 (own), scale 4
    files = write_safetensors(tmp_path, SPECS, get, max_shard_size=44)
    names = [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    assert [f.name for f in files] == names
    plan = [["embed.weight", "norm.weight"], ["proj.weight"], ["positions"], ["scale"]]
    assert events == [key for shard in plan for key in shard]  # each tensor fetched once, in order
    for key, array in open_tensors(tmp_path).items():
        np.testing.assert_array_equal(array, ARRAYS[key])
    text = (tmp_path / "model.safetensors.index.json").read_text()
    index = json.loads(text)
    assert index["metadata"] == {"total_size": sum(a.nbytes for a in ARRAYS.values())}
    assert index["weight_map"] == {k: names[i] for i, shard in enumerate(plan) for k in shard}
    assert list(index["weight_map"]) == sorted(index["weight_map"]) and text.endswith("}\n")
    for name, shard in zip(names, plan, strict=True):
        with safetensors.safe_open(str(tmp_path / name), framework="np") as f:
            assert sorted(f.keys()) == sorted(shard) and f.metadata()["format"] == "pt"


def test_write_safetensors_errors(tmp_path):
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    with pytest.raises(ValueError, match=r"get\('embed\.weight'\) returned shape \(15,\) dtype bfloat16"):
        write_safetensors(fresh, SPECS, lambda k: ARRAYS[k].reshape(-1), max_shard_size=10**6)
    assert not any(fresh.iterdir())  # the failed shard was removed
    write_safetensors(tmp_path, SPECS, ARRAYS.__getitem__, max_shard_size=10**6)
    with pytest.raises(FileExistsError, match=r"already holds \['model\.safetensors'\]"):
        write_safetensors(tmp_path, SPECS, ARRAYS.__getitem__, max_shard_size=10**6)
    with pytest.raises(ValueError, match=r"\['a'\] appear more than once"):
        write_safetensors(fresh, [("a", (3,), np.float32)] * 2, np.ones, max_shard_size=10)
    with pytest.raises(ValueError, match=r'"format"\] must be "pt"'):
        write_safetensors(fresh, [], np.ones, max_shard_size=10, metadata={"format": "np"})
    with pytest.raises(FileNotFoundError, match="missing does not exist"):
        write_safetensors(tmp_path / "missing", [], np.ones, max_shard_size=10)
    assert parse_shard_size("5GB") == 5 * 10**9 and parse_shard_size("2GiB") == 2 * 2**30
    assert parse_shard_size("500MB") == 5 * 10**8 and parse_shard_size(123) == 123
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_shard_size("lots")


def test_write_torch_file_round_trip_and_failure(tmp_path, monkeypatch):
    path = write_torch_file(tmp_path / "w.pt", ARRAYS.items())
    loaded = torch.load(path, weights_only=True)
    assert list(loaded) == list(ARRAYS) and loaded["embed.weight"].dtype == torch.bfloat16
    for key, array in open_tensors(path).items():
        _same(array, ARRAYS[key])
    before = path.read_bytes()

    def broken_save(obj, f):  # write_torch_file hands torch.save an open file
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        write_torch_file(path, [("x", np.ones(3))])
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["w.pt"]
    with pytest.raises(ValueError, match="'x' given twice"):
        write_torch_file(path, [("x", np.ones(3)), ("x", np.ones(3))])
    with pytest.raises(IsADirectoryError, match="is a directory"):
        write_torch_file(tmp_path, [])


def test_atomic_output_success_and_failure(tmp_path):
    out = tmp_path / "out"
    with atomic_output(out) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".out.tmp-") and tmp.is_dir()
        (tmp / "a.txt").write_text("new")
    assert os.listdir(tmp_path) == ["out"] and (out / "a.txt").read_text() == "new"
    with pytest.raises(RuntimeError, match="boom"), atomic_output(tmp_path / "other") as tmp:
        (tmp / "a.txt").write_text("half")
        raise RuntimeError("boom")
    assert os.listdir(tmp_path) == ["out"]
    orphan = tmp_path / "no_parent" / "x"
    with pytest.raises(FileNotFoundError, match=r"no_parent does not exist; create"), atomic_output(orphan):
        pass


def test_atomic_output_existing_needs_force(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    entered = False
    with pytest.raises(FileExistsError, match=r"out already exists; pass force=True"), atomic_output(out):
        entered = True
    assert not entered and os.listdir(out) == ["old.txt"]
    with pytest.raises(RuntimeError), atomic_output(out, force=True) as tmp:
        (tmp / "new.txt").write_text("new")
        raise RuntimeError
    assert os.listdir(out) == ["old.txt"] and os.listdir(tmp_path) == ["out"]
    real_rename = os.rename

    def rename(src, dst):  # moving the old one away works, moving the new one in fails
        if ".tmp-" in str(src):
            raise OSError("no space")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="no space"), atomic_output(out, force=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert os.listdir(out) == ["old.txt"] and os.listdir(tmp_path) == ["out"]  # the old one is back
    monkeypatch.undo()
    with atomic_output(out, force=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert os.listdir(out) == ["new.txt"] and os.listdir(tmp_path) == ["out"]


def test_atomic_output_files(tmp_path):
    out = tmp_path / "w.pt"
    with atomic_output(out, is_dir=False) as tmp:
        assert not tmp.exists()
        tmp.write_text("one")
    with pytest.raises(FileExistsError, match="force=True"), atomic_output(out, is_dir=False):
        pass
    with atomic_output(out, force=True, is_dir=False) as tmp:
        tmp.write_text("two")
    assert out.read_text() == "two" and os.listdir(tmp_path) == ["w.pt"]
    unwritten = atomic_output(out.with_name("x"), is_dir=False)
    with pytest.raises(FileNotFoundError, match="nothing was written"), unwritten:
        pass
    with atomic_output(out, force=True) as tmp:  # a directory replaces a file
        (tmp / "inside").write_text("3")
    assert (out / "inside").read_text() == "3" and os.listdir(tmp_path) == ["w.pt"]
