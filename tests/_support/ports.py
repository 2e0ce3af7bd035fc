"""What the multi-process tests' processes share: a free TCP port on 127.0.0.1 for their
coordinator, and the environment that gives each process two CPU devices."""

import os
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_cpu_devices_env() -> dict:
    """What a process of a two-process CPU run adds to its environment: two CPU devices. The
    suite's XLA flags are kept (appended to, not replaced): they halve every compile, and they
    key XLA's persistent cache, which every multi-process test's processes share."""
    flags = os.environ.get("XLA_FLAGS", "")
    return {"XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count=2".strip(), "JAX_PLATFORMS": "cpu"}
