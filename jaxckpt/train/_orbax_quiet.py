"""Orbax's reports of a failed read or write, kept to the one line jaxckpt raises.

When one array of a save or restore fails (a full disk, a damaged file), orbax logs the
error with its traceback from its background threads, stops its event loop, and
tensorstore's other requests then finish on the closed loop: each prints
``RuntimeError('Event loop is closed')`` with a traceback, through ``sys.unraisablehook``.
jaxckpt raises the failure itself, as one line naming the directory and the step
(``CheckpointWriteError``, or the ``ValueError`` of ``restore_checkpoint``); these
tracebacks would bury it (so would asyncio's ``Task exception was never retrieved`` for
orbax's failed tasks, at exit). ``quiet_orbax_failures`` drops exactly those: the log lines
stay (without their tracebacks), and every other unraisable report and log record passes.
"""

import logging
import sys

LOGGERS = ("absl", "asyncio")
"""The loggers of orbax (``absl.logging``) and of the asyncio tasks it leaves failed
(``Task exception was never retrieved``, at exit)."""


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


class _OrbaxTracebacks(logging.Filter):
    """Keeps an orbax failure's log message, drops its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and _through_orbax(record):
            record.exc_info, record.exc_text = None, None
        return True


def quiet_orbax_failures() -> None:
    """Installs both filters (once per process; idempotent).

    Example:
        >>> quiet_orbax_failures(); quiet_orbax_failures()
        >>> [sum(isinstance(f, _OrbaxTracebacks) for f in logging.getLogger(n).filters) for n in LOGGERS]
        [1, 1]
    """
    for logger in map(logging.getLogger, LOGGERS):
        if not any(isinstance(f, _OrbaxTracebacks) for f in logger.filters):
            logger.addFilter(_OrbaxTracebacks())
    previous = sys.unraisablehook
    if getattr(previous, "drops_closed_loop_reports", False):
        return

    def hook(unraisable) -> None:
        if not _is_closed_loop(unraisable):
            previous(unraisable)

    hook.drops_closed_loop_reports = True
    sys.unraisablehook = hook
