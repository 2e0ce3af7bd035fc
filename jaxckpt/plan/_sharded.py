"""Per-device figures of an FSDP train step over D devices, compiled by XLA.

The step is the one ``jaxckpt train --mesh fsdp=D`` runs: the train state split by
``jaxckpt.train.state_shardings``, the batch split over the devices. ``plan.measure``
compiles it from abstract inputs (``ShapeDtypeStruct``s with shardings), so nothing
is allocated; XLA's memory analysis of an SPMD program describes one device. This
module holds what FSDP does to sizes (``sharded_bytes``, ``local_batch``) and where
the compile runs (``measure_sharded``).

Compiling needs D devices. When this process has fewer (JAX fixes the CPU device
count when it starts), the step is compiled in a fresh Python process with
``--xla_force_host_platform_device_count=D``, and the figures come back as JSON.

Run as ``python -m jaxckpt.plan._sharded`` it is that worker: one JSON request on
stdin, one ``MemoryReport`` dict on stdout.
"""

import dataclasses
import functools
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh

from jaxckpt._checks import require_positive_int
from jaxckpt.nn import TransformerConfig
from jaxckpt.remat import RematSpec
from jaxckpt.train import MemoryReport, state_shardings
from jaxckpt.train._sharding import AXES

WORKER_TIMEOUT = 1800
"""Seconds one sharded compile in a subprocess may take."""


def fsdp_mesh_shape(devices: int) -> dict[str, int]:
    """The mesh the planner plans for: every device in ``fsdp`` (ZeRO-3), ``data=1``."""
    return {"data": 1, "fsdp": devices}


def sharded_bytes(state, devices: int) -> int:
    """Bytes one device holds of ``state`` (an ``nnx.State`` of arrays or
    ``ShapeDtypeStruct``s) when it is split as ``jaxckpt.train`` splits it over
    ``devices`` (``fsdp=devices``). The leaves ``fsdp`` cannot split count in full.

    Example:
        >>> from flax import nnx
        >>> from jaxckpt import nn
        >>> cfg = nn.TransformerConfig.preset("tiny")
        >>> model = nnx.eval_shape(lambda: nn.Transformer(cfg, rngs=nnx.Rngs(0)))
        >>> state = nnx.state(model, nnx.Param)
        >>> sharded_bytes(state, 4) * 4 == sharded_bytes(state, 1)
        True
    """
    shape = fsdp_mesh_shape(devices)
    mesh = AbstractMesh(tuple(shape[a] for a in AXES), AXES)
    shardings = state_shardings(state, mesh)
    total = 0
    for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(shardings), strict=True):
        local = sharding.shard_shape(leaf.shape)
        total += math.prod(local) * jnp.dtype(leaf.dtype).itemsize
    return total


def local_batch(batch: int, devices: int) -> int:
    """One device's share of ``batch`` under FSDP; the error names both numbers.

    Example:
        >>> local_batch(8, 4)
        2
    """
    require_positive_int("devices", devices)
    if batch % devices:
        raise ValueError(
            f"batch {batch} must be a multiple of devices={devices}: FSDP gives each device an "
            f"equal share of the batch (e.g. batch {devices * max(1, batch // devices)})"
        )
    return batch // devices


def measure_sharded(
    config: TransformerConfig,
    batch: int,
    seq: int,
    spec: RematSpec,
    optimizer: str,
    micro_batches: int,
    devices: int,
) -> MemoryReport:
    """XLA's per-device ``MemoryReport`` of the FSDP step over ``devices`` devices.

    ``batch`` is the global batch (split over the devices); ``params``, ``optimizer``
    and ``grads`` are one device's shares. Compiled in this process when it has
    ``devices`` devices, else in a subprocess (see the module docstring).

    Raises:
        ValueError: when ``batch`` is not a multiple of ``devices``.
        RuntimeError: when the subprocess fails (its error output is included).
    """
    local_batch(batch, devices)
    if len(jax.devices()) >= devices:
        from jaxckpt.plan._measure import _measure  # it imports this module

        return _measure(config, batch, seq, spec, optimizer, micro_batches, devices)
    return _in_subprocess(config, batch, seq, spec, optimizer, micro_batches, devices)


@functools.lru_cache(maxsize=64)
def _in_subprocess(config, batch, seq, spec, optimizer, micro_batches, devices) -> MemoryReport:
    from jaxckpt.plan._cost import spec_dict  # it imports this module (through _analytic)

    request = {
        "config": config.to_dict(),
        "batch": batch,
        "seq": seq,
        "spec": spec_dict(spec),
        "optimizer": optimizer,
        "micro_batches": micro_batches,
        "devices": devices,
    }
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
    config = TransformerConfig.from_dict(request["config"])
    spec = RematSpec(**request["spec"])
    args = (request["batch"], request["seq"], spec, request["optimizer"], request["micro_batches"])
    from jaxckpt.plan._measure import _measure  # it imports this module

    report = _measure(config, *args, request["devices"])
    print(json.dumps(report.to_dict()))


if __name__ == "__main__":
    _worker()
