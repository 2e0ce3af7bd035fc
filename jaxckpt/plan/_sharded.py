"""The FSDP step compiled in a subprocess, for when this process has too few devices.

Compiling the step over D devices needs D devices, and JAX fixes the CPU device count
when it starts. So when this process has fewer, the step is compiled in a fresh Python
process with ``--xla_force_host_platform_device_count=D``, and the figures come back
as JSON.

Run as ``python -m jaxckpt.plan._sharded`` it is that worker: one JSON request
(``{"workload": Workload.to_dict(), "spec": spec_dict(spec)}``) on stdin, one
``MemoryReport`` dict on stdout.
"""

import dataclasses
import functools
import json
import os
import subprocess
import sys

from jaxckpt.plan._compile import compile_report
from jaxckpt.plan._specs import spec_dict
from jaxckpt.plan._workload import Workload
from jaxckpt.remat import RematSpec
from jaxckpt.train import MemoryReport

WORKER_TIMEOUT = 1800
"""Seconds one sharded compile in a subprocess may take."""


@functools.lru_cache(maxsize=64)
def compile_in_subprocess(workload: Workload, spec: RematSpec) -> MemoryReport:
    """``compile_report(workload, spec)``, computed in a fresh process with
    ``workload.devices`` simulated CPU devices.

    Raises:
        RuntimeError: when the subprocess fails (its error output is included) or times out.
    """
    devices = workload.devices
    request = {"workload": workload.to_dict(), "spec": spec_dict(spec)}
    flags = os.environ.get("XLA_FLAGS", "")
    flags = " ".join(f for f in flags.split() if "xla_force_host_platform_device_count" not in f)
    env = {
        **os.environ,
        "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={devices}".strip(),
        "JAX_PLATFORMS": "cpu",
    }
    try:
        done = subprocess.run(
            [sys.executable, "-m", "jaxckpt.plan._sharded"],
            input=json.dumps(request),
            env=env,
            capture_output=True,
            text=True,
            timeout=WORKER_TIMEOUT,
        )
    except subprocess.TimeoutExpired as err:
        raise RuntimeError(f"compiling the step over {devices} devices took over {WORKER_TIMEOUT} s") from err
    if done.returncode != 0:
        raise RuntimeError(
            f"compiling the step over {devices} simulated CPU devices failed:\n{done.stderr[-4000:]}"
        )
    fields = {f.name for f in dataclasses.fields(MemoryReport)}
    return MemoryReport(**{k: v for k, v in json.loads(done.stdout.splitlines()[-1]).items() if k in fields})


def _worker() -> None:
    request = json.loads(sys.stdin.read())
    workload = Workload.from_dict(request["workload"])
    report = compile_report(workload, RematSpec(**request["spec"]))
    print(json.dumps(report.to_dict()))


if __name__ == "__main__":
    _worker()
