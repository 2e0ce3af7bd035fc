"""Orbax's background threads that a failed save leaves waiting, released at once.

Orbax runs the parts of a save in threads that wait for each other's signals (the step's
directory is made, then the item's, then the arrays are written, ...). When one part fails
(a full disk while the directory is made, say), the signal it would have sent never comes,
and the threads that wait for it block until orbax's coordination timeout, 300 s. They are
not daemon threads: the process cannot exit before then, so ``jaxckpt train`` printed its
one-line error and then hung for five minutes (and so did a test worker).

``release_stranded_threads`` cancels the threads that the failed save started and sends them
the signals they wait for: each wakes, sees that it is cancelled and ends without running
its part (nothing more is written). It reads two attributes of orbax's ``_SignalingThread``
(the signals it waits for and its operation id); ``tests/reliability/test_checkpoint_write_faults.py``
fails if they change.
"""

import threading

JOIN_SECONDS = 10.0
"""How long a released thread may take to end (it only returns)."""


def release_stranded_threads(before: "set[threading.Thread]") -> None:
    """Cancels and wakes every orbax signalling thread alive now that is not in ``before``
    (the threads alive when the save began), and waits for them to end.

    Example:
        >>> before = set(threading.enumerate())
        >>> release_stranded_threads(before)  # (after a save that raised)
        >>> set(threading.enumerate()) <= before
        True
    """
    from orbax.checkpoint._src.futures import future

    stranded = [
        thread
        for thread in threading.enumerate()
        if thread not in before and isinstance(thread, future._SignalingThread) and thread.is_alive()
    ]
    for thread in stranded:
        thread.cancel()
        future.set_signals(thread._receive_signals, operation_id=thread._operation_id)
    for thread in stranded:
        threading.Thread.join(thread, JOIN_SECONDS)  # orbax's join raises for a cancelled thread
