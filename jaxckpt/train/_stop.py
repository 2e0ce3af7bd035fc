"""SIGTERM, as a preempted cluster job gets it: training finishes its step, checkpoints, exits 0."""

import contextlib
import signal
import threading

import jax

STOP_SIGNALS = (signal.SIGTERM,)
"""The signals that end a run cleanly (SIGINT keeps Python's KeyboardInterrupt)."""


class StopRequest:
    """The name of the stop signal received (``"SIGTERM"``), or None.

    Example:
        >>> import os, signal
        >>> with stop_requests() as stop:
        ...     os.kill(os.getpid(), signal.SIGTERM)
        ...     stop.received
        'SIGTERM'
    """

    def __init__(self):
        self.received: str | None = None

    def _handle(self, signum, frame) -> None:
        del frame
        self.received = signal.Signals(signum).name


@contextlib.contextmanager
def stop_requests():
    """Yields a ``StopRequest`` that a stop signal sets instead of killing the process;
    the previous handlers come back on exit.

    Only a single-process run in the main thread listens: Python handles signals there
    alone, and the processes of a multi-process run could stop at different steps (they
    keep the default: the signal ends them, and they resume from the last checkpoint).
    """
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread() or jax.process_count() > 1:
        yield stop
        return
    previous = {sig: signal.signal(sig, stop._handle) for sig in STOP_SIGNALS}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
