"""Orbax's reports of a failed read or write, kept to the one line jaxckpt raises.

When one array of a save or restore fails (a full disk, a damaged file), orbax logs the
error with its traceback from its background threads, stops its event loop, and
tensorstore's other requests then finish on the closed loop: each prints
``RuntimeError('Event loop is closed')`` with a traceback, through ``sys.unraisablehook``.
jaxckpt raises the failure itself, as one line naming the directory and the step
(``CheckpointWriteError``, or the ``ValueError`` of ``restore_checkpoint``); these
tracebacks would bury it. ``quiet_orbax_failures`` drops exactly those: orbax's log lines
stay (without their tracebacks), and every other unraisable report and log record passes.
"""

import logging
import sys

ORBAX_LOGGER = "absl"
"""The logger orbax writes to (``absl.logging``)."""


def _is_closed_loop(unraisable) -> bool:
    error = unraisable.exc_value
    return isinstance(error, RuntimeError) and str(error) == "Event loop is closed"


class _OrbaxTracebacks(logging.Filter):
    """Keeps an orbax log record's message, drops its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and "orbax" in record.pathname.split("site-packages")[-1]:
            record.exc_info, record.exc_text = None, None
        return True


def quiet_orbax_failures() -> None:
    """Installs both filters (once per process; idempotent).

    Example:
        >>> quiet_orbax_failures(); quiet_orbax_failures()
        >>> sum(isinstance(f, _OrbaxTracebacks) for f in logging.getLogger(ORBAX_LOGGER).filters)
        1
    """
    logger = logging.getLogger(ORBAX_LOGGER)
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
