"""Builds the XLA FFI attention library ``libjaxckpt_npu_ffi.so`` with g++.

The library holds the FFI handlers (``attention.cc``) and the CPU kernel
(``kernel_cpu.cc``), always; and the Ascend kernel (``kernel_ascend.cc``) only
when CANN is found: ``ASCEND_TOOLKIT_HOME`` is set and its ``include`` folder
exists. It goes to ``npu_backend/ffi/build/`` (ignored by git, like every
``build/`` folder).

It rebuilds only when needed: a stamp file next to the library holds a SHA-256
of the compile flags, the sources and the XLA FFI headers, and the library is
rebuilt when that digest changes (or with ``force``). An up-to-date library is
used even where no compiler exists. The compiler is ``$CXX`` if set, else
``g++``.

Run it as a script (this is what ``make ffi`` does)::

    python npu_backend/ffi/build.py [--force] [--strict]

With no compiler it prints why and exits 0, so ``make test`` still runs (the
FFI tests then skip themselves); ``--strict`` makes that exit 1.
"""

import argparse
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUILD_DIR = HERE / "build"
LIB_NAME = "libjaxckpt_npu_ffi.so"
SOURCES = ("attention.cc", "kernel_cpu.cc")
ASCEND_SOURCES = ("kernel_ascend.cc",)
HEADERS = ("kernel.h",)
FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC")
ASCEND_LIBS = ("-lascendcl", "-lnnopbase", "-lopapi")
NO_COMPILER = "no C++ compiler (g++) found; install one (e.g. `apt-get install g++`) or set CXX"


class BuildError(RuntimeError):
    """The library could not be built (no compiler, or the compiler failed)."""


def library_path() -> Path:
    """Where the shared library is (or will be) built.

    Returns:
        ``npu_backend/ffi/build/libjaxckpt_npu_ffi.so``.

    Example:
        >>> library_path().name
        'libjaxckpt_npu_ffi.so'
    """
    return BUILD_DIR / LIB_NAME


def find_compiler() -> str | None:
    """The C++ compiler: ``$CXX`` if set, else ``g++``; None when not found.

    Example:
        >>> isinstance(find_compiler(), str | None)
        True
    """
    return shutil.which(os.environ.get("CXX") or "g++")


def ascend_home() -> Path | None:
    """``$ASCEND_TOOLKIT_HOME`` when it is set and holds an ``include`` folder, else None.

    Example:
        >>> ascend_home() is None or (ascend_home() / "include").is_dir()
        True
    """
    home = os.environ.get("ASCEND_TOOLKIT_HOME")
    if home and (Path(home) / "include").is_dir():
        return Path(home)
    return None


def _jax_include() -> Path:
    import jax  # deferred: only a build needs it

    return Path(jax.ffi.include_dir())


def compile_args(output: Path) -> list[str]:
    """Every argument after the compiler name, writing the library to ``output``.

    Example:
        >>> args = compile_args(Path("lib.so"))
        >>> args[:4], args[-2:]
        (['-O2', '-std=c++17', '-shared', '-fPIC'], ['-o', 'lib.so'])
    """
    args = [*FLAGS, f"-I{_jax_include()}"]
    sources = [str(HERE / s) for s in SOURCES]
    home = ascend_home()
    if home is not None:
        args += ["-DJAXCKPT_WITH_ASCEND", f"-I{home / 'include'}"]
        sources += [str(HERE / s) for s in ASCEND_SOURCES]
        args += [*sources, f"-L{home / 'lib64'}", f"-Wl,-rpath,{home / 'lib64'}", *ASCEND_LIBS]
    else:
        args += sources
    return [*args, "-o", str(output)]


def _digest() -> str:
    """SHA-256 of the flags, the compiled sources, the kernel header and the XLA FFI headers."""
    h = hashlib.sha256(" ".join(compile_args(Path(LIB_NAME))).encode())
    ffi_api = _jax_include() / "xla" / "ffi" / "api"
    compiled = (*SOURCES, *HEADERS, *(ASCEND_SOURCES if ascend_home() else ()))
    files = [HERE / f for f in compiled]
    files += sorted(ffi_api.glob("*.h"))
    for f in files:
        if f.exists():
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def _stamp() -> Path:
    return BUILD_DIR / (LIB_NAME + ".sha256")


def is_up_to_date() -> bool:
    """True when the library exists and was built from the current sources and flags.

    Example:
        >>> isinstance(is_up_to_date(), bool)
        True
    """
    stamp = _stamp()
    return library_path().exists() and stamp.exists() and stamp.read_text().strip() == _digest()


def build(force: bool = False) -> Path:
    """Compiles the library if it is missing or stale (or if ``force``).

    Concurrent builds (pytest-xdist workers) are safe: each compiles to its own
    temporary file, then atomically renames it over the library.

    Args:
        force: rebuild even when the library is up to date.

    Returns:
        The path of the library.

    Raises:
        BuildError: no C++ compiler was found, or compilation failed (the
            message holds the command and the compiler's output).

    Example:
        >>> build().name
        'libjaxckpt_npu_ffi.so'
    """
    if not force and is_up_to_date():
        return library_path()
    cxx = find_compiler()
    if cxx is None:
        raise BuildError(NO_COMPILER + ".")
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    tmp = BUILD_DIR / f".{LIB_NAME}.{os.getpid()}.tmp"
    cmd = [cxx, *compile_args(tmp)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise BuildError(
            f"compiling the FFI library failed (exit {done.returncode}):\n{shlex.join(cmd)}\n"
            f"{done.stderr.strip()}"
        )
    os.replace(tmp, library_path())
    stamp_tmp = BUILD_DIR / f".{LIB_NAME}.{os.getpid()}.sha256.tmp"
    stamp_tmp.write_text(_digest() + "\n")
    os.replace(stamp_tmp, _stamp())
    return library_path()


def main(argv: list[str] | None = None) -> int:
    """The command line: builds, prints what it did, returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.add_argument("--strict", action="store_true", help="exit 1 when no compiler is found")
    args = parser.parse_args(argv)
    fresh = not args.force and is_up_to_date()
    try:
        path = build(force=args.force)
    except BuildError as e:
        no_compiler = str(e).startswith(NO_COMPILER)
        print(f"npu_backend FFI: {'skipped' if no_compiler else 'failed'}: {e}", file=sys.stderr)
        return 1 if (args.strict or not no_compiler) else 0
    ascend = "with" if ascend_home() else "without"
    print(f"npu_backend FFI: {'up to date' if fresh else 'built'} {path} ({ascend} the Ascend kernel)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
