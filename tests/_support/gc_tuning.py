"""Python's cyclic garbage collector, tuned for the suite's processes.

JAX's tracing makes many short-lived objects, and at Python's default thresholds
(700, 10, 10) the collector runs so often that it took about a fifth of a train step's trace
(four tiny train steps: 1.84 s of trace at the defaults, 1.41 s tuned). Tuned, ``tests/nn``
and ``tests/remat`` took 12% less time (152.5 and 158.0 s -> 132.1 and 138.1 s on two
workers, a cold compile cache). The objects alive when it is called (the imports) are
frozen out of every later collection, and the youngest generation is collected every
``JAXCKPT_TEST_GC_THRESHOLD`` allocations (50,000 by default) instead of 700. Reference
counting still frees everything that is not in a cycle at once.

``tests/conftest.py`` calls it in every pytest process, and the children the tests start
call it too (``fault_child.py``, ``remat_losses_child.py``). The library leaves the user's
collector alone.
"""

import gc
import os

DEFAULT_THRESHOLD = 50_000
"""Allocations between two collections of the youngest generation (Python's default: 700)."""


def thresholds() -> tuple[int, int, int]:
    """``gc.set_threshold``'s arguments: the youngest generation's from the environment."""
    return int(os.environ.get("JAXCKPT_TEST_GC_THRESHOLD", DEFAULT_THRESHOLD)), 20, 100


def tune_gc() -> None:
    """Freezes the objects alive now and collects the youngest generation less often."""
    gc.freeze()
    gc.set_threshold(*thresholds())
