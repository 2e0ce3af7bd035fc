"""Orbax's reports of a failed save or restore: kept off stderr, the detail kept in a log file.

When one part of a save fails (a full disk, say), orbax logs the error from each of its
background threads (``absl`` log records carrying tensorstore's specs as JSON), stops its
event loop, and tensorstore's other requests then finish on the closed loop: each reports
``RuntimeError('Event loop is closed')`` through ``sys.unraisablehook``. At exit, asyncio
logs ``Task exception was never retrieved`` for orbax's failed tasks, and Python warns of
its coroutines that were ``never awaited``. jaxckpt raises the failure itself, as one line
naming the directory and the step (``CheckpointWriteError``); the rest would bury it.

So, during a save (``SaveReports``), every record of the ``absl`` and ``asyncio`` loggers and
every uncaught exception of a thread is *held*, not printed. A save that succeeds prints
what it held, as it would have. A save that fails writes it, with its tracebacks, to
``checkpoint-errors.log`` in the checkpoint directory, and the one line names that file;
what orbax reports after that (its threads ending, asyncio at exit) is appended there too,
until the next save begins. With the ``jaxckpt.checkpoint`` logger enabled for DEBUG
(``jaxckpt train --verbose``) nothing is held: orbax's reports reach stderr as they come.

Outside a save (a restore), orbax's failure records keep their message and lose their
traceback: ``restore_checkpoint`` raises its own one-line error.
"""

import contextlib
import datetime
import logging
import sys
import threading
import traceback
import warnings
from pathlib import Path

LOGGERS = ("absl", "asyncio")
"""The loggers of orbax (``absl.logging``) and of the asyncio tasks it leaves failed."""

VERBOSE_LOGGER = "jaxckpt.checkpoint"
"""Enabled for DEBUG (``jaxckpt train --verbose``): orbax's reports are never held."""

LOG_NAME = "checkpoint-errors.log"
"""The file in the checkpoint directory that a failed save's reports are written to."""

_FORMAT = logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(threadName)s] %(message)s")


def verbose() -> bool:
    """Whether orbax's reports go to stderr as they come (``--verbose``).

    Example:
        >>> verbose()
        False
    """
    return logging.getLogger(VERBOSE_LOGGER).isEnabledFor(logging.DEBUG)


class _Reports:
    """Where orbax's reports go now (one per process: orbax reports from its own threads)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.held: list | None = None  # during a save: the held records and report texts
        self.late_log: Path | None = None  # after a failed save: where later reports go

    def take(self, report) -> bool:
        """Holds or logs ``report`` (a ``LogRecord`` or a text); False when it should print."""
        if verbose():
            return False
        with self.lock:
            if self.held is not None:
                self.held.append(report)
                return True
            if self.late_log is not None:
                with contextlib.suppress(OSError):  # the disk is still full: the report is lost
                    _append(self.late_log, [_text(report)])
                return True
        return False


_REPORTS = _Reports()


def _text(report) -> str:
    return _FORMAT.format(report) if isinstance(report, logging.LogRecord) else report


def _append(path: Path, texts: list[str]) -> None:
    """Appends ``texts`` to ``path``; raises OSError (a full disk) after writing what fits."""
    with open(path, "a", encoding="utf-8") as log:
        for text in texts:
            log.write(text.rstrip("\n") + "\n")


class SaveReports:
    """Holds orbax's reports during a save (a context manager); see the module's docstring.

    Example:
        >>> import tempfile
        >>> with SaveReports() as reports:
        ...     logging.getLogger("absl").error("Save Finalize thread (save_finalize) failed.")
        >>> line = reports.write_log(Path(tempfile.mkdtemp()), "step 2: disk full")
        >>> line.startswith("details in ") and line.endswith(LOG_NAME)
        True
        >>> "save_finalize" in Path(line.removeprefix("details in ")).read_text()
        True
        >>> with SaveReports():  # the next save: later reports print again
        ...     pass
    """

    def __init__(self):
        self._records: list = []

    def __enter__(self) -> "SaveReports":
        quiet_orbax_failures()
        with _REPORTS.lock:
            _REPORTS.held, _REPORTS.late_log = self._records, None
        return self

    def __exit__(self, *exc) -> None:
        with _REPORTS.lock:
            _REPORTS.held = None

    def release(self) -> None:
        """After a save that succeeded: prints what was held, as it would have printed."""
        records, self._records[:] = list(self._records), []
        for report in records:
            if isinstance(report, logging.LogRecord):
                logging.getLogger(report.name).handle(report)
            else:
                sys.stderr.write(report)

    def write_log(self, directory: Path, error: str) -> str:
        """After a save that failed: writes ``error`` and what was held to ``directory /
        LOG_NAME`` (appended), and sends what orbax reports later there too. Returns the
        words that end the one-line error: where the detail is, or why it could not be kept.
        """
        path = directory / LOG_NAME
        with _REPORTS.lock:
            texts = [_text(report) for report in self._records]
            self._records[:] = []
            _REPORTS.late_log = path
        stamp = datetime.datetime.now().isoformat(timespec="seconds")
        try:
            _append(path, [f"=== {stamp} {error}", *texts])
        except OSError as err:
            return f"its details could not be written to {str(path)!r} ({err.strerror}): rerun with --verbose"
        return f"details in {path}"


def _is_closed_loop(unraisable) -> bool:
    error = unraisable.exc_value
    return isinstance(error, RuntimeError) and str(error) == "Event loop is closed"


def _through_orbax(record: logging.LogRecord) -> bool:
    """Whether the record was logged by orbax, or its exception passed through orbax."""
    if "orbax" in record.pathname.split("site-packages")[-1]:
        return True
    tb = record.exc_info[2] if record.exc_info else None
    while tb is not None:
        if "orbax" in tb.tb_frame.f_code.co_filename.split("site-packages")[-1]:
            return True
        tb = tb.tb_next
    return False


class _OrbaxReports(logging.Filter):
    """Holds a record during a save (logs it after a failed one); elsewhere keeps an orbax
    failure's message and drops its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _REPORTS.take(record):
            return False
        if record.exc_info and _through_orbax(record) and not verbose():
            record.exc_info, record.exc_text = None, None
        return True


def _hook(owner, name: str, wrap) -> None:
    """Replaces ``owner.name`` (a hook of ``sys``, ``threading`` or ``warnings``) by
    ``wrap(previous)``, once."""
    previous = getattr(owner, name)
    if not getattr(previous, "holds_orbax_reports", False):
        hook = wrap(previous)
        hook.holds_orbax_reports = True
        setattr(owner, name, hook)


def _unraisable(previous):
    def hook(unraisable) -> None:
        if not _is_closed_loop(unraisable) or verbose():
            previous(unraisable)
        else:  # held during a save, logged after a failed one, dropped elsewhere
            _REPORTS.take(f"{unraisable.err_msg or 'unraisable'}: {unraisable.exc_value!r}")

    return hook


def _thread_exception(previous):
    def hook(args) -> None:
        name = args.thread.name if args.thread is not None else "?"
        lines = traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback)
        if not _REPORTS.take(f"exception in thread {name}:\n{''.join(lines)}"):
            previous(args)

    return hook


def _show_warning(previous):
    def hook(message, category, filename, lineno, file=None, line=None) -> None:
        never_awaited = issubclass(category, RuntimeWarning) and "was never awaited" in str(message)
        text = warnings.formatwarning(message, category, filename, lineno, line)
        if not (never_awaited and _REPORTS.take(text)):
            previous(message, category, filename, lineno, file, line)

    return hook


def quiet_orbax_failures() -> None:
    """Installs the filters and hooks (once per process; idempotent).

    Example:
        >>> quiet_orbax_failures(); quiet_orbax_failures()
        >>> [sum(isinstance(f, _OrbaxReports) for f in logging.getLogger(n).filters) for n in LOGGERS]
        [1, 1]
    """
    for logger in map(logging.getLogger, LOGGERS):
        if not any(isinstance(f, _OrbaxReports) for f in logger.filters):
            logger.addFilter(_OrbaxReports())
    _hook(sys, "unraisablehook", _unraisable)
    _hook(threading, "excepthook", _thread_exception)
    _hook(warnings, "showwarning", _show_warning)
