"""Multi-host (multi-process) training: joining the processes, and placing host values
on a mesh whose devices belong to several processes.

Every process runs the same program. ``initialize`` must come before anything starts
JAX's backend (``jax.devices()``, any computation); afterwards ``jax.devices()`` lists
the devices of every process and a mesh spans all of them. Each process builds the
same initial state and the same global batch (both are pure functions of the seed and
the step), and places only its own shards of them (``put_global``).
"""

import jax
import numpy as np

from jaxckpt.train._sharding import make_mesh

_PORTS = range(1, 65536)


def _check_arguments(coordinator: str, num_processes: int, process_id: int) -> None:
    host, sep, port = str(coordinator).rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or int(port) not in _PORTS:
        raise ValueError(
            f"coordinator={coordinator!r} must be HOST:PORT with a port in 1..65535, "
            "e.g. 10.0.0.1:1234 (process 0's address; every process passes the same one)"
        )
    for name, value in (("num_processes", num_processes), ("process_id", process_id)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise ValueError(f"{name}={value!r} must be an int")
    if num_processes < 1:
        raise ValueError(f"num_processes={num_processes} must be >= 1")
    if process_id < 0:
        raise ValueError(f"process_id={process_id} must be >= 0")
    if process_id >= num_processes:
        raise ValueError(
            f"process_id={process_id} must be < num_processes={num_processes} "
            f"(the processes are numbered 0..{num_processes - 1})"
        )


def initialize(coordinator: str, num_processes: int, process_id: int) -> None:
    """Joins this process to a multi-process JAX run (``jax.distributed.initialize``).

    Call it in every process, before anything else touches JAX devices. On CPU the
    processes exchange data through gloo's TCP collectives
    (``jax_cpu_collectives_implementation="gloo"``), which is selected here unless
    another implementation (``"mpi"``) was chosen explicitly; GPUs and TPUs use their
    own collectives and ignore that setting.

    Args:
        coordinator: ``HOST:PORT`` of process 0, the same in every process; process 0
            listens on that port.
        num_processes: how many processes take part (>= 1).
        process_id: this process's number, ``0 <= process_id < num_processes``.

    Raises:
        ValueError: for a malformed address or an out-of-range count or id, naming the
            argument and its value.
        RuntimeError: (from JAX) when the backend has already started, or on a second call.

    Example:
        Two processes with two CPU devices each (one shell per process; ``process_id=1`` in
        the other), each running, with
        ``XLA_FLAGS=--xla_force_host_platform_device_count=2``::

            train.initialize('127.0.0.1:1234', num_processes=2, process_id=0)
            run = train.train(cfg, steps=10, batch=8, seq=64, mesh='data=2,fsdp=2')

        >>> initialize("127.0.0.1:1234", num_processes=2, process_id=3)
        Traceback (most recent call last):
        ...
        ValueError: process_id=3 must be < num_processes=2 (the processes are numbered 0..1)
    """
    _check_arguments(coordinator, num_processes, process_id)
    if jax.config.jax_cpu_collectives_implementation in (None, "gloo"):
        # Read when the CPU backend starts, which is after this call (or the check below fails).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator, num_processes=int(num_processes), process_id=int(process_id)
    )


def is_primary() -> bool:
    """Whether this is process 0, the one that prints, draws progress and writes files
    that are not shards (always True in a single-process run).

    Example:
        >>> is_primary()
        True
    """
    return jax.process_index() == 0


def default_mesh_axes() -> dict[str, int] | None:
    """The mesh of a run that names none. One process: None (one device, no mesh).
    Several: ``data`` over the processes and ``fsdp`` over each one's devices, so the
    parameter all-gathers stay inside a host and only gradients cross between hosts.

    Example:
        >>> default_mesh_axes() is None  # a single-process run
        True
    """
    if jax.process_count() == 1:
        return None
    return {"data": jax.process_count(), "fsdp": jax.local_device_count()}


def resolve_mesh(mesh) -> "jax.sharding.Mesh | None":
    """The mesh a run uses, from what ``train.train(mesh=...)`` takes: None gives
    :func:`default_mesh_axes` (no mesh for one process), axis sizes (``"fsdp=4"``,
    ``{"fsdp": 4}``) are built into a mesh over every device, and a ``Mesh`` is kept.

    Raises:
        ValueError: (from ``make_mesh``) for sizes the devices do not match.

    Example:
        >>> resolve_mesh(None) is None  # one process, no mesh named
        True
    """
    if mesh is None:
        mesh = default_mesh_axes()
    if mesh is None or isinstance(mesh, jax.sharding.Mesh):
        return mesh
    return make_mesh(mesh)


def put_global(tree, shardings):
    """``jax.device_put(tree, shardings)``, also where the shardings span devices of
    other processes.

    With one process this is ``jax.device_put``. With several, every process must hold
    the same full value of ``tree`` (on the host or on any of its devices); each one
    cuts from it the shards of its own devices (``jax.make_array_from_callback``), with
    no communication and no check that the values agree.

    Example:
        >>> import numpy as np
        >>> from jaxckpt.train._sharding import make_mesh, replicated
        >>> mesh = make_mesh({}, devices=jax.devices()[:1])
        >>> put_global({"w": np.ones(3)}, {"w": replicated(mesh)})["w"].shape
        (3,)
    """
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def one(leaf, sharding):
        host = np.asarray(leaf)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: np.asarray(host[index]))

    return jax.tree.map(one, tree, shardings)
