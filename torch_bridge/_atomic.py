"""Outputs that appear whole or not at all: ``atomic_output`` and its write errors.

``atomic_output`` gives a temporary path next to the destination and renames it into
place only when the whole output is written; a write that fails there (a full disk, a
quota, a file size limit) becomes one ``OutputWriteError`` naming the destination and the
file (``writing``) it was writing, with nothing partial left behind.
"""

import contextlib
import errno
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

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
