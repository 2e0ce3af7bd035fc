"""``jaxckpt convert``, ``save_hf``, the PEFT adapter and the seed block's ``.pt`` when the
destination fills: no partial output, one clear error.

``OSError(ENOSPC)`` is injected into every write point that Python reaches (``FullDisk``:
the directory creations and renames, each file opened for writing, each ``write`` on it,
each ``os.sendfile`` of a copy), one at a time. Every time the writer either succeeds, or
exits 2 (``OutputWriteError`` for a library call) with one line naming the destination, the
file or step, and ENOSPC; the destination then does not exist, or (``--force``) is the old
one, byte for byte, and no temporary is left beside it. The writes orbax makes through
tensorstore's C++ are failed for real: a subprocess under ``RLIMIT_FSIZE`` gets EFBIG.
"""

import builtins
import collections
import errno
import io
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import fault_harness as harness  # noqa: E402
import torch_models as tm  # noqa: E402
from flax import nnx  # noqa: E402

from jaxckpt import nn  # noqa: E402
from jaxckpt.cli import main  # noqa: E402
from torch_bridge import (  # noqa: E402
    OutputWriteError,
    read_checkpoint,
    save_hf,
    save_seed_block,
    seed_block_config,
)
from torch_bridge.peft._adapter import write_peft_adapter  # noqa: E402

pytestmark = pytest.mark.torch

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT


class _File:
    """A file opened for writing whose every ``write`` is a write point."""

    def __init__(self, file, disk: "FullDisk", where: str):
        self._file, self._disk, self._where = file, disk, where

    def write(self, data):
        self._disk.hit("write", self._where, named=False)  # a real ENOSPC from write() names no file
        return self._file.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._file.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._file, name)


class FullDisk:
    """Counts the write points under ``root``; the ``fail_at``-th raises ENOSPC (0: none does)."""

    def __init__(self, monkeypatch, root: Path, fail_at: int = 0):
        self.root, self.fail_at, self.calls, self.failed = str(root) + os.sep, fail_at, 0, None
        self.kinds: collections.Counter = collections.Counter()
        for name in ("mkdir", "rename", "replace"):
            self._path_call(monkeypatch, name)
        real_os_open, real_sendfile = os.open, os.sendfile

        def os_open(path, flags, *args, **kwargs):
            if flags & WRITE_FLAGS:
                self.hit("os.open", path)
            return real_os_open(path, flags, *args, **kwargs)

        def sendfile(out_fd, *args):
            self.hit("sendfile", os.readlink(f"/proc/self/fd/{out_fd}"), named=False)
            return real_sendfile(out_fd, *args)

        monkeypatch.setattr(os, "open", os_open)
        monkeypatch.setattr(os, "sendfile", sendfile)
        real_open = io.open

        def opened(file, mode="r", *args, **kwargs):
            if not (any(c in mode for c in "wax+") and isinstance(file, str | os.PathLike)):
                return real_open(file, mode, *args, **kwargs)
            self.hit("open", file)
            return _File(real_open(file, mode, *args, **kwargs), self, str(file))

        monkeypatch.setattr(builtins, "open", opened)
        monkeypatch.setattr(io, "open", opened)

    def _path_call(self, monkeypatch, name: str) -> None:
        real = getattr(os, name)

        def call(path, *args, **kwargs):
            self.hit(name, path)
            return real(path, *args, **kwargs)

        monkeypatch.setattr(os, name, call)

    def hit(self, kind: str, path, named: bool = True) -> None:
        where = os.path.abspath(os.fspath(path)) if isinstance(path, str | os.PathLike) else ""
        if not where.startswith(self.root):
            return
        self.calls += 1
        self.kinds[kind] += 1
        if self.calls == self.fail_at:
            self.failed = f"{kind}({where[len(self.root) :]})"
            raise OSError(errno.ENOSPC, "No space left on device", *([where] if named else []))


def _files(directory: Path) -> dict:
    """Every file under ``directory`` -> its bytes."""
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()
    }


def _check_failure(message: str, dst: Path, existed: bool) -> str:
    """Checks the one-line error; returns the step it names."""
    assert "\n" not in message.strip() and "Traceback" not in message, message
    assert f"could not write {str(dst)!r}: No space left on device (ENOSPC) while writing " in message
    left = f"the existing {dst.name} is unchanged" if existed else "nothing is left there"
    assert message.rstrip().endswith(left), message
    return message.split(" while writing ", 1)[1].rsplit(";", 1)[0]


def _every_write_fails(monkeypatch, root: Path, write, check_done, dst: Path, old: dict | None) -> dict:
    """Runs ``write()`` once per write point, failing that one; returns what was seen."""
    with monkeypatch.context() as patch:
        counting = FullDisk(patch, root)
        assert write() is None
    total, steps, survived = counting.calls, collections.Counter(), 0
    assert total >= 3, counting.kinds
    for k in range(1, total + 1):
        _restore(dst, old or {})  # the old destination, or none (the last round may have written it)
        with monkeypatch.context() as patch:
            disk = FullDisk(patch, root, fail_at=k)
            message = write()
        assert disk.failed, k
        if message is None:  # a failure the writer survived: the output must be whole
            survived += 1
            check_done(dst)
        else:
            steps[_check_failure(message, dst, old is not None)] += 1
            assert (_files(dst) == old) if old is not None else not os.path.lexists(dst), disk.failed
        strays = [p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.")]
        assert strays == [], (disk.failed, strays)
    assert survived <= total // 4, (survived, total)
    return {"points": total, "kinds": dict(counting.kinds), "steps": dict(steps), "survived": survived}


def _restore(dst: Path, files: dict) -> None:
    """Puts the old destination back as it was (the previous round may have replaced it);
    with no ``files``, removes it."""
    if dst.exists():
        for p in sorted(dst.rglob("*"), reverse=True):
            p.unlink() if p.is_file() or p.is_symlink() else p.rmdir()
        dst.rmdir()
    for name, data in files.items():
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        (dst / name).write_bytes(data)


def _cli(capsys, *argv) -> "str | None":
    """``jaxckpt *argv --json``: None on success, else the error (it must exit 2)."""
    try:
        code = main([*argv, "--json"])
    except SystemExit as exit_info:
        err = capsys.readouterr().err
        assert exit_info.code == 2, (exit_info.code, err)
        return err
    assert code == 0
    capsys.readouterr()
    return None


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict:
    """A tiny LLaMA (two safetensors shards, tokenizer files) and its jaxckpt conversion."""
    root = tmp_path_factory.mktemp("sources")
    tm.tiny_llama().save_pretrained(root / "hf", max_shard_size="40KB")
    (root / "hf" / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    (root / "hf" / "chat_template.jinja").write_text("{{ messages }}")
    assert main(["convert", str(root / "hf"), str(root / "jax"), "--json"]) == 0
    return {"hf": root / "hf", "jax": root / "jax"}


def _old(dst: Path) -> dict:
    _restore(dst, {"old.txt": b"the old destination", "sub/keep.bin": bytes(range(7))})
    return _files(dst)


@pytest.mark.slow
def test_convert_to_jax_when_the_disk_fills(sources, tmp_path, monkeypatch, capsys):
    dst = tmp_path / "jax"

    def done(path):
        assert json.loads((path / "jaxckpt.json").read_text())["kind"] == "params"

    write = lambda: _cli(capsys, "convert", str(sources["hf"]), str(dst), "--force")
    seen = _every_write_fails(monkeypatch, tmp_path, write, done, dst, _old(dst))
    print("convert --to jax --force:", seen)
    assert any("orbax checkpoint" in s for s in seen["steps"]), seen
    assert any("tokenizer files" in s for s in seen["steps"]), seen
    assert any("rename" in s for s in seen["steps"]), seen


@pytest.mark.slow
def test_convert_to_torch_when_the_disk_fills(sources, tmp_path, monkeypatch, capsys):
    dst = tmp_path / "hf"
    argv = ("convert", str(sources["jax"]), str(dst), "--to", "torch", "--max-shard-size", "30KB")

    def done(path):
        assert read_checkpoint(path).report.problems() == []

    seen = _every_write_fails(monkeypatch, tmp_path, lambda: _cli(capsys, *argv), done, dst, None)
    print("convert --to torch:", seen)
    shards = [s for s in seen["steps"] if s.startswith("model-0000")]
    assert len(shards) >= 2 and "model.safetensors.index.json" in seen["steps"], seen
    assert "config.json" in seen["steps"] and any("tokenizer files" in s for s in seen["steps"]), seen


def _library(write) -> "str | None":
    try:
        write()
    except OutputWriteError as err:
        assert err.errno == errno.ENOSPC
        return str(err)
    return None


def test_save_hf_when_the_disk_fills(sources, tmp_path, monkeypatch):
    cfg = nn.TransformerConfig.preset("tiny", n_layers=1, d_model=16, n_heads=2, ffn_dim=24, vocab_size=37)
    model, dst = nn.Transformer(cfg, rngs=nnx.Rngs(0)), tmp_path / "saved"
    write = lambda: _library(lambda: save_hf(model, dst, force=True, tokenizer_from=sources["hf"]))
    seen = _every_write_fails(monkeypatch, tmp_path, write, lambda p: read_checkpoint(p), dst, _old(dst))
    print("save_hf --force:", seen)
    assert {"model.safetensors", "config.json"} <= set(seen["steps"]), seen


@pytest.mark.slow
def test_the_peft_adapter_and_the_seed_block_when_the_disk_fills(tmp_path, monkeypatch):
    cfg = nn.TransformerConfig.preset("tiny", n_layers=1, d_model=16, n_heads=2, ffn_dim=24, lora=3)
    params = nnx.state(nn.Transformer(cfg, rngs=nnx.Rngs(0)), nnx.LoRAParam)
    adapter = tmp_path / "adapter"
    write = lambda: _library(lambda: write_peft_adapter(params, cfg, adapter))
    seen = _every_write_fails(monkeypatch, tmp_path, write, lambda p: None, adapter, None)
    print("write_peft_adapter:", seen)
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(seen["steps"]), seen

    block, pt = nn.Block(seed_block_config(6, 2), rngs=nnx.Rngs(0)), tmp_path / "block.pt"
    pt.write_bytes(b"the old block")
    write = lambda: _library(lambda: save_seed_block(block, pt, force=True))
    with monkeypatch.context() as patch:
        counting = FullDisk(patch, tmp_path)
        assert write() is None
    for k in range(1, counting.calls + 1):
        pt.write_bytes(b"the old block")
        with monkeypatch.context() as patch:
            FullDisk(patch, tmp_path, fail_at=k)
            message = write()
        written = r"while writing (block\.pt|the rename of \.block\.pt\.tmp-\w+ onto it)"
        assert message is not None and re.search(f"{written}; the existing block.pt is unchanged$", message)
        assert pt.read_bytes() == b"the old block"
        assert [name for name in os.listdir(tmp_path) if name.startswith(".")] == []
    print("save_seed_block:", counting.calls, dict(counting.kinds))


@pytest.mark.slow
def test_a_file_size_limit_fails_the_real_writes(sources, tmp_path, tmp_path_factory):
    """``RLIMIT_FSIZE`` fails tensorstore's own writes (and Python's) with EFBIG. The limit is a
    process's: the commands run in a process of their own (``fault_child.under_file_size_limit``),
    forked warm by the fault harness's fork server instead of a fresh Python importing JAX,
    jaxckpt and torch_bridge again (seconds of CPU)."""
    argvs = [
        ["convert", str(sources["hf"]), str(tmp_path / "jax"), "--json"],
        ["convert", str(sources["jax"]), str(tmp_path / "hf"), "--to", "torch", "--json"],
    ]
    logs = tmp_path_factory.mktemp("fsize-logs")  # not in tmp_path, which must stay empty
    out, err = logs / "stdout.txt", logs / "stderr.txt"
    argv = ["fsize", str(16 * 1024), json.dumps(argvs)]
    child = harness.fork_server().start("fault_child", argv, stdout=out, stderr=err)
    try:
        child.wait(timeout=120)
    finally:
        child.kill()
    done = subprocess.CompletedProcess(argv, child.returncode, out.read_text(), err.read_text())
    assert done.stdout.split().count("exit") == 2 and "exit 2" in done.stdout, (done.stdout, done.stderr)
    errors = [line for line in done.stderr.splitlines() if line.startswith("jaxckpt convert: error:")]
    assert "Traceback" not in done.stderr and len(errors) == 2, done.stderr
    for line, dst in zip(errors, ("jax", "hf"), strict=True):
        assert f"could not write {str(tmp_path / dst)!r}: File too large (EFBIG) while writing" in line, line
        assert line.endswith("nothing is left there"), line
    assert "the orbax checkpoint" in errors[0] and "safetensors" in errors[1], errors
    assert os.listdir(tmp_path) == []  # neither destination, nor a temporary
