"""Where the suite's time goes: JAX's trace, lowering and compile time per test.

The suite's time is mostly XLA compiles, and a test's duration alone does not say whether it
traced, lowered, compiled or read the persistent cache. With ``JAXCKPT_COMPILE_PROFILE=<dir>``
set, ``tests/conftest.py`` registers this plugin; every test then appends one JSON line to
``<dir>/<worker>.jsonl``::

    {"test": "tests/nn/test_nn.py::test_x", "slow": false, "wall": 3.1, "trace": 0.4,
     "lower": 0.2, "compile": 1.9, "compiles": 3, "cache_hits": 1, "cache_misses": 2}

``compile`` is XLA's backend compile, persistent-cache reads included; ``compiles`` counts
them. Work done in a child process the test starts is not seen (only its wall time is).
Summarise with ``python tests/_support/compile_profile.py <dir> [top]``: the totals, the
files and tests by wall time, and the tests of ``SLOW_S`` or more not marked ``slow`` (run
it with the cache warm: ``make test-fast`` skips the ``slow`` ones).
"""

import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

from jax import monitoring

SLOW_S = 2.0
"""A test this long or longer with the compile cache warm is marked ``slow``."""

_DURATIONS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
}
_COUNTS = {
    "/jax/core/compile/backend_compile_duration": "compiles",
    "/jax/compilation_cache/cache_hits": "cache_hits",
    "/jax/compilation_cache/cache_misses": "cache_misses",
}


class CompileProfile:
    """A pytest plugin: one JSON line of JAX compile figures per test."""

    def __init__(self, out_dir: str):
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        self._out = open(Path(out_dir) / f"{worker}.jsonl", "a")  # noqa: SIM115 (open for the session)
        self._current: Counter = Counter()
        monitoring.register_event_duration_secs_listener(self._on_duration)
        monitoring.register_event_listener(self._on_event)

    def _on_duration(self, event: str, duration: float, **_):
        if event in _DURATIONS:
            self._current[_DURATIONS[event]] += duration
        if event in _COUNTS:
            self._current[_COUNTS[event]] += 1

    def _on_event(self, event: str, **_):
        if event in _COUNTS:
            self._current[_COUNTS[event]] += 1

    def pytest_runtest_protocol(self, item, nextitem):
        self._current = Counter()
        start = time.perf_counter()
        yield
        row = {
            "test": item.nodeid,
            "slow": item.get_closest_marker("slow") is not None,
            "wall": round(time.perf_counter() - start, 3),
        }
        row.update({k: round(v, 3) for k, v in self._current.items()})
        self._out.write(json.dumps(row) + "\n")
        self._out.flush()

    pytest_runtest_protocol.hookwrapper = True  # type: ignore[attr-defined]


def summarise(out_dir: str, top: int = 40) -> None:
    """Print the totals and the ``top`` tests and files by wall time."""
    rows = [json.loads(line) for f in Path(out_dir).glob("*.jsonl") for line in f.read_text().splitlines()]
    keys = ("wall", "trace", "lower", "compile", "compiles", "cache_hits", "cache_misses")
    total = Counter()
    by_file: dict[str, Counter] = {}
    for row in rows:
        path = row["test"].split("::")[0]
        for k in keys:
            total[k] += row.get(k, 0)
            by_file.setdefault(path, Counter())[k] += row.get(k, 0)
    head = f"{'wall':>8} {'trace':>7} {'lower':>7} {'compile':>8} {'n':>5} {'hit':>5} {'miss':>5}"

    def line(c, name):
        return (
            f"{c['wall']:8.1f} {c['trace']:7.1f} {c['lower']:7.1f} {c['compile']:8.1f} "
            f"{c['compiles']:5d} {c['cache_hits']:5d} {c['cache_misses']:5d}  {name}"
        )

    print(f"{len(rows)} tests\n{head}\n{line(total, 'TOTAL')}\n")
    print(f"files by wall time\n{head}")
    for path, c in sorted(by_file.items(), key=lambda kv: -kv[1]["wall"])[:top]:
        print(line(c, path))
    print(f"\ntests by wall time\n{head}")
    for row in sorted(rows, key=lambda r: -r["wall"])[:top]:
        print(line(Counter(row), row["test"]))
    unmarked = [r for r in rows if r["wall"] >= SLOW_S and not r.get("slow")]
    print(f"\n{len(unmarked)} tests of {SLOW_S} s or more not marked slow (if the cache was warm)")
    for row in sorted(unmarked, key=lambda r: -r["wall"]):
        print(line(Counter(row), row["test"]))


if __name__ == "__main__":
    summarise(sys.argv[1], *(int(a) for a in sys.argv[2:]))
