"""Optimizer state in host memory (``pinned_host``), updated one parameter leaf at a time.

``stream_to_host`` wraps an optax transformation: its state stays where it is stored
(host memory, placed by ``offload_shardings``), and the update brings one leaf's state to
the device, updates it and writes it back, then the next leaf's (an
``optimization_barrier`` orders each leaf's read after the previous leaf's update), so
the device holds about one leaf's state at a time instead of all of it. The state's
layout is the wrapped transformation's own: a checkpoint restores with or without
offload.

On CPU, ``pinned_host`` is the same RAM as the device's: offload runs there and saves
nothing (``jaxckpt.train.offload_saves_memory``), and XLA:CPU's memory analysis counts the host-placed
state among the step's arguments. Where the backend has no ``pinned_host`` memory,
``require_host_memory`` raises: nothing falls back silently.
"""

import jax
import optax
from flax import nnx
from jax.sharding import SingleDeviceSharding

from jaxckpt.remat import has_pinned_host
from jaxckpt.train._loss_scale import keep_if_finite

HOST = "pinned_host"
DEVICE = "device"


def require_host_memory(device: "jax.Device | None" = None) -> None:
    """Raises a ValueError when ``device`` (the first by default) has no ``pinned_host``
    memory to hold an offloaded optimizer state.

    Example:
        >>> require_host_memory()  # XLA:CPU has one (the same RAM)
    """
    device = device or jax.devices()[0]
    if not has_pinned_host(device):
        raise ValueError(
            f"OptimizerConfig: offload=True needs a '{HOST}' memory space, and {device.platform} "
            f"device {device} has none; train without offload"
        )


def _in_memory(tree, kind: str):
    return jax.tree.map(lambda sharding: sharding.with_memory_kind(kind), tree)


def offload_shardings(state, shardings=None, *, optimizer: bool = True, masters: bool = False):
    """The shardings of a trainer's ``state`` (``nnx.split((model, optimizer))[1]``) with
    the optimizer's ``opt_state`` in ``pinned_host`` memory (``optimizer``), the model's
    parameters too (``masters``: host master weights) and the rest (the step count, the
    loss scaler, other variables) in device memory. ``shardings``: the state's shardings
    (``state_shardings`` over a mesh); None: the first device.

    Example:
        >>> import optax
        >>> from flax import nnx
        >>> model = nnx.Linear(3, 5, rngs=nnx.Rngs(0))
        >>> state = nnx.state((model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)))
        >>> kinds = offload_shardings(state)
        >>> kinds[1]["opt_state"][0]["mu"]["kernel"].get_value().memory_kind
        'pinned_host'
        >>> kinds[0]["kernel"].get_value().memory_kind
        'device'
    """
    if shardings is None:
        device = jax.devices()[0]
        shardings = jax.tree.map(lambda _: SingleDeviceSharding(device), state)
    out = _in_memory(shardings, DEVICE)
    if optimizer:
        out[1]["opt_state"] = _in_memory(out[1]["opt_state"], HOST)
    if masters:
        out[0] = jax.tree.map(
            lambda v: v.replace(v.get_value().with_memory_kind(HOST)) if isinstance(v, nnx.Param) else v,
            out[0],
            is_leaf=lambda v: isinstance(v, nnx.Variable),
        )
    return out


def to_memory(tree, kind: str):
    """``tree`` moved to ``DEVICE`` or ``HOST`` memory (inside a jitted function)."""
    space = jax.memory.Space.Device if kind == DEVICE else jax.memory.Space.Host
    return jax.tree.map(lambda x: jax.device_put(x, space), tree)


def _is_param_tree(treedef):
    return lambda x: jax.tree.structure(x) == treedef


def leaf_state(state, treedef, i: int):
    """Parameter leaf ``i``'s slice of an optimizer ``state``: each parameter-shaped subtree
    (``treedef``: the parameters') cut to ``[leaf i]``, the other leaves (step counts) whole."""
    is_param_tree = _is_param_tree(treedef)
    return jax.tree.map(
        lambda sub: [treedef.flatten_up_to(sub)[i]] if is_param_tree(sub) else sub,
        state,
        is_leaf=is_param_tree,
    )


def merge_leaf_states(state, treedef, news: list):
    """The state ``leaf_state``'s slices were cut from, rebuilt from their updates ``news``
    (one per leaf, in order; the last one's step counts)."""
    is_param_tree = _is_param_tree(treedef)

    def merge(sub, *parts):
        return treedef.unflatten([part[0] for part in parts]) if is_param_tree(sub) else parts[-1]

    return jax.tree.map(merge, state, *news, is_leaf=is_param_tree)


def stream_to_host(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """``inner`` updated one parameter leaf at a time, each leaf's state read from and
    written back to host memory (module docstring). ``inner`` must update every leaf
    independently (AdamW, Adafactor and SGD do; a global-norm clip goes before it). Its
    state's parameter-shaped subtrees (moments, factored statistics) are cut per leaf; its
    other leaves (step counts) go along with each leaf. ``finite=`` (a bool scalar) keeps
    the old state where it is False, on the device, before the write back.

    Example:
        >>> import jax, jax.numpy as jnp, optax
        >>> tx, params = stream_to_host(optax.adam(0.1)), {"a": jnp.ones(3), "b": jnp.ones(2)}
        >>> updates, state = jax.jit(tx.update)(params, tx.init(params), params)
        >>> reference = jax.jit(optax.adam(0.1).update)(params, optax.adam(0.1).init(params), params)[0]
        >>> bool(jnp.allclose(updates["a"], reference["a"]))
        True
    """

    def update(updates, state, params=None, *, finite=None, **extra):
        del extra
        treedef = jax.tree.structure(updates)
        grads = treedef.flatten_up_to(updates)
        param_leaves = [None] * len(grads) if params is None else treedef.flatten_up_to(params)
        new_updates, new_states, previous = [], [], None
        for i, (grad, param) in enumerate(zip(grads, param_leaves, strict=True)):
            held = leaf_state(state, treedef, i)
            if previous is not None:  # read this leaf's state after the previous leaf's update
                held, _ = jax.lax.optimization_barrier((held, previous))
            held = to_memory(held, DEVICE)
            step, new = inner.update([grad], held, None if param is None else [param])
            if finite is not None:
                new = keep_if_finite(finite, new, held)
            new_states.append(to_memory(new, HOST))
            new_updates.append(step[0])
            previous = step[0]
        return treedef.unflatten(new_updates), merge_leaf_states(state, treedef, new_states)

    return optax.GradientTransformationExtraArgs(inner.init, update)


def offload_saves_memory(device: jax.Device | None = None) -> bool:
    """Offload rows only make sense where host memory is separate from device memory.

    On CPU ``pinned_host`` is the same RAM, so offloading there saves nothing.

    Example:
        >>> import jax
        >>> offload_saves_memory(jax.devices("cpu")[0])
        False
    """
    device = device or jax.devices()[0]
    return has_pinned_host(device) and device.platform != "cpu"
