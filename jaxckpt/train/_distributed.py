"""Multi-host (multi-process) training: joining the processes, and placing host values
on a mesh whose devices belong to several processes.

Every process runs the same program. ``initialize`` must come before anything starts
JAX's backend (``jax.devices()``, any computation); afterwards ``jax.devices()`` lists
the devices of every process and a mesh spans all of them. Each process builds the
same initial state and the same global batch (both are pure functions of the seed and
the step), and places only its own shards of them (``put_global``).

When a process dies, the others must not hang: see ``initialize`` for what notices it,
how soon, and how the survivors exit.
"""

import contextlib
import os
import sys

import jax
import numpy as np

from jaxckpt.train._sharding import make_mesh

_PORTS = range(1, 65536)

HEARTBEAT_TIMEOUT_S = 100
"""JAX's default ``heartbeat_timeout_seconds`` (``jax.distributed.initialize``): how long the
coordination service waits for a silent process before it declares it dead."""

LOST_PEER_EXIT = 4
"""Exit status of a process that ended because another process of its run was gone."""

_LOST_PEER_MARKS = (
    "gloo",
    "connection reset",
    "connection closed",
    "connection refused",
    "broken pipe",
    "socket closed",
    "unavailable",
    "coordination service",
    "heartbeat",
)
"""Words of a ``JaxRuntimeError`` that a failed exchange with another process raises (gloo's TCP
collectives on CPU, the coordination service's RPCs), lower-cased."""

_run: dict = {}
"""This process's multi-process run (coordinator, num_processes, process_id), once initialized."""


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


def _check_heartbeat_timeout(heartbeat_timeout) -> int:
    if heartbeat_timeout is None:
        return HEARTBEAT_TIMEOUT_S
    if isinstance(heartbeat_timeout, bool) or not isinstance(heartbeat_timeout, int | np.integer):
        raise ValueError(f"heartbeat_timeout={heartbeat_timeout!r} must be an int (seconds)")
    if heartbeat_timeout < 1:
        raise ValueError(f"heartbeat_timeout={heartbeat_timeout} must be >= 1 (seconds)")
    return int(heartbeat_timeout)


def initialize(
    coordinator: str, num_processes: int, process_id: int, *, heartbeat_timeout: int | None = None
) -> None:
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
        heartbeat_timeout: seconds of silence after which the coordination service
            declares a process dead (``heartbeat_timeout_seconds`` of
            ``jax.distributed.initialize``); None: JAX's default, ``HEARTBEAT_TIMEOUT_S``
            = 100. Every process should pass the same value.

    When a process dies, the others exit; they never hang. They end in one of two ways:

    - gloo's collective fails with a ``JaxRuntimeError`` (``Connection reset by peer``).
      Left uncaught, it ends the process at once: one line on stderr, ``jaxckpt: error:
      process I of P lost contact with another process of the run ...``, exit status
      ``LOST_PEER_EXIT`` = 4 (``initialize`` installs a ``sys.excepthook`` for this;
      without it Python's exit would wait at JAX's shutdown barrier for the dead process
      until the heartbeat timeout, and then abort).
    - The JAX client aborts the process, in C++: exit status -6 (SIGABRT; 134 from a
      shell), after the log line ``F... Terminating process because the JAX distributed
      service detected fatal errors. This most likely indicates that another task died``
      (then the cause, and a C++ stack). JAX 0.10.2 gives no public hook to replace it.

    What notices a death, and when (measured on one host, 2 processes, CPU):

    - Process 0, which hosts the coordination service, killed: the survivors' clients
      find the service's socket closed and abort within a second (or gloo raises first).
    - Another process killed: a survivor in a train step is often blocked in a gloo
      all-reduce that does not notice (XLA:CPU's collective timeout is 30 minutes);
      the coordination service declares the process dead once it has sent no heartbeat
      for ``heartbeat_timeout`` seconds and aborts the survivors: at most
      ``heartbeat_timeout`` after the death (8-10 s for 10; 60-92 s for the default
      100). Sometimes gloo raises at once instead.
    - A process alive but silent (stopped, hung, its host or network lost): only the
      heartbeats notice, after ``heartbeat_timeout`` seconds, whichever process it is.
    - A death while the others are not in a collective (compiling, writing a
      checkpoint): their next collective or barrier, or the heartbeats.

    A lower ``heartbeat_timeout`` notices sooner; it must stay well above any pause of a
    live process's heartbeat thread (a C++ thread, not held up by Python or compiles).

    Raises:
        ValueError: for a malformed address, an out-of-range count or id or a
            heartbeat timeout that is not a positive int, naming the argument and its value.
        RuntimeError: (from JAX) when the backend has already started, or on a second call.

    Example:
        Two processes with two CPU devices each (one shell per process; ``process_id=1`` in
        the other), each running, with
        ``XLA_FLAGS=--xla_force_host_platform_device_count=2``::

            train.initialize('127.0.0.1:1234', num_processes=2, process_id=0)
            run = train.train(cfg, train.RunConfig(steps=10, batch=8, seq=64, mesh='data=2,fsdp=2'))

        >>> initialize("127.0.0.1:1234", num_processes=2, process_id=3)
        Traceback (most recent call last):
        ...
        ValueError: process_id=3 must be < num_processes=2 (the processes are numbered 0..1)
    """
    _check_arguments(coordinator, num_processes, process_id)
    heartbeat = _check_heartbeat_timeout(heartbeat_timeout)
    if jax.config.jax_cpu_collectives_implementation in (None, "gloo"):
        # Read when the CPU backend starts, which is after this call (or the check below fails).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=int(num_processes),
        process_id=int(process_id),
        heartbeat_timeout_seconds=heartbeat,
    )
    _run.update(coordinator=coordinator, num_processes=int(num_processes), process_id=int(process_id))
    if not getattr(sys.excepthook, "exits_on_lost_peer", False):
        sys.excepthook = _exit_on_lost_peer(sys.excepthook)


def lost_peer_message(error: BaseException) -> str | None:
    """The one-line report of ``error`` when it is a failed exchange with another process
    of this multi-process run (the peer died, or the coordinator is unreachable); None for
    any other error, and outside a multi-process run.

    Example:
        >>> lost_peer_message(RuntimeError("Gloo all-reduce failed")) is None  # one process
        True
    """
    if _run.get("num_processes", 1) < 2 or not isinstance(error, jax.errors.JaxRuntimeError):
        return None
    text = str(error).strip()
    if not any(mark in text.lower() for mark in _LOST_PEER_MARKS):
        return None
    first = text.splitlines()[0] if text else type(error).__name__
    return (
        f"jaxckpt: error: process {_run['process_id']} of {_run['num_processes']} lost contact with "
        f"another process of the run (one died, or the coordinator {_run['coordinator']} is "
        f"unreachable): {first}; exiting with status {LOST_PEER_EXIT}"
    )


def _exit_on_lost_peer(previous):
    """A ``sys.excepthook`` that ends the process at once, with one line on stderr and
    ``LOST_PEER_EXIT``, for an uncaught error of a lost peer (``lost_peer_message``), and
    hands any other error to ``previous``.

    It skips Python's exit handlers on purpose: JAX's would wait at the shutdown barrier
    for the process that is gone (until the heartbeat timeout) and then abort."""

    def hook(kind, error, traceback):
        message = lost_peer_message(error)
        if message is None:
            return previous(kind, error, traceback)
        with contextlib.suppress(OSError, ValueError):  # a closed stream must not stop the exit
            sys.stdout.flush()
        with contextlib.suppress(OSError, ValueError):
            print(message, file=sys.stderr, flush=True)
        os._exit(LOST_PEER_EXIT)

    hook.exits_on_lost_peer = True
    return hook


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
    """The mesh a run uses, from what ``train.RunConfig(mesh=...)`` takes: None gives
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
