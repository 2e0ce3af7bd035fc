"""FP32 master weights in host memory (``OptimizerConfig(offload_master=True)``).

A full fine-tuning in a 16-bit compute dtype keeps float32 parameters: the masters the
update adds to. With ``offload_master`` they live in ``pinned_host`` memory and the step
works on their copies:

* ``compute_copies``: leaf by leaf (an ``optimization_barrier`` orders each leaf after the
  previous one), a master comes to the device and the weights the model casts anyway
  (``nnx.Linear`` kernels and biases, ``nnx.Embed`` tables: ``CAST_LEAVES``) are cast to
  the compute dtype there; the others (norm scales) stay float32. The forward pass sees
  the values it would see with the masters on the device, so the loss is the same.
* ``update_masters``: the update, one leaf at a time: its master (and, with ``offload``,
  its optimizer state) comes to the device, the gradient is widened to float32 and
  clipped by the global norm, the optimizer's step is added, and master and state go
  back to host memory. The device holds the compute copies, their gradients and one
  leaf's master at a time instead of every float32 master.

On CPU ``pinned_host`` is the same RAM: it runs and saves nothing
(``offload_saves_memory``).
"""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxckpt.train._loss_scale import keep_if_finite
from jaxckpt.train._offload import DEVICE, HOST, leaf_state, merge_leaf_states, to_memory
from jaxckpt.train._transforms import global_norm_scale

CAST_LEAVES = ("kernel", "bias", "embedding")
"""The parameters ``nnx.Linear`` and ``nnx.Embed`` promote to the compute dtype before any
use: their compute copies are cast on the device, once, instead of in every layer."""


def has_master_weights(config) -> bool:
    """Whether ``config`` trains float32 masters of a 16-bit compute (a full fine-tuning:
    ``param_dtype="float32"``, a 16-bit ``dtype``, no LoRA).

    Example:
        >>> from jaxckpt import nn
        >>> has_master_weights(nn.TransformerConfig.preset("tiny", dtype="bfloat16"))
        True
        >>> has_master_weights(nn.TransformerConfig.preset("tiny"))  # float32 compute
        False
    """
    return config.lora is None and config.param_dtype == "float32" and config.compute_dtype.itemsize == 2


def require_master_weights(config) -> None:
    """Raises a ValueError naming the fields when ``config`` has no float32 masters to offload."""
    if not has_master_weights(config):
        raise ValueError(
            "OptimizerConfig: offload_master=True needs the float32 master weights of a full "
            "fine-tuning (param_dtype='float32', dtype 'bfloat16' or 'float16', no lora); got "
            f"param_dtype={config.param_dtype!r}, dtype={config.dtype!r}, lora={config.lora is not None}"
        )


def _casts(path) -> bool:
    names = [key.key for key in path if isinstance(key, jax.tree_util.DictKey)]
    return bool(names) and names[-1] in CAST_LEAVES


def compute_copies(masters, dtype):
    """The device copies of ``masters`` (a pure parameter tree in host memory) the step
    computes with, brought over one leaf at a time (module docstring).

    Example:
        >>> import jax.numpy as jnp
        >>> copies = compute_copies({"kernel": jnp.ones((2, 3)), "scale": jnp.ones(3)}, jnp.bfloat16)
        >>> copies["kernel"].dtype, copies["scale"].dtype
        (dtype(bfloat16), dtype('float32'))
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(masters)
    copies, previous = [], None
    for path, master in leaves:
        if previous is not None:
            master, _ = jax.lax.optimization_barrier((master, previous))
        copy = to_memory(master, DEVICE)
        copies.append(copy.astype(dtype) if _casts(path) else copy)
        previous = copies[-1]
    return jax.tree_util.tree_unflatten(treedef, copies)


def update_masters(base, clip_norm: float, grads, state, masters, *, state_on_host: bool, finite=None):
    """``(new masters, new state)``: ``base`` (an optax transformation that updates every
    leaf alone, its state ``state``) applied to the host-memory ``masters`` one leaf at a
    time, after the global-norm clip (``clip_norm``; 0: none) of ``grads`` widened to
    float32. ``state_on_host``: the state lives in host memory too. ``finite`` (a bool
    scalar): where False, masters and state are kept as they were.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> masters, grads = {"w": jnp.ones(3)}, {"w": jnp.ones(3, jnp.bfloat16)}
        >>> tx = optax.sgd(0.5)
        >>> new, _ = update_masters(tx, 0.0, grads, tx.init(masters), masters, state_on_host=False)
        >>> new["w"].tolist()
        [0.5, 0.5, 0.5]
    """
    treedef = jax.tree.structure(masters)
    # the norm of the float32 gradients, each widened inside its own reduction
    scale = global_norm_scale(jax.tree.map(_widened, grads), clip_norm) if clip_norm else None
    new_masters, new_states, previous = [], [], None
    pairs = zip(treedef.flatten_up_to(grads), treedef.flatten_up_to(masters), strict=True)
    for i, (grad, master) in enumerate(pairs):
        held = leaf_state(state, treedef, i)
        if previous is not None:  # this leaf after the previous leaf's write back
            (held, master, grad), _ = jax.lax.optimization_barrier(((held, master, grad), previous))
        if state_on_host:
            held = to_memory(held, DEVICE)
        master = to_memory(master, DEVICE)
        grad = grad.astype(master.dtype)
        grad = grad if scale is None else grad * scale.astype(grad.dtype)
        (step,), new = base.update([grad], held, [master])
        updated = optax.apply_updates(master, step)
        if finite is not None:
            new = keep_if_finite(finite, new, held)
            updated = jnp.where(finite, updated, master)
        new_states.append(to_memory(new, HOST) if state_on_host else new)
        new_masters.append(to_memory(updated, HOST))
        previous = new_masters[-1]
    return treedef.unflatten(new_masters), merge_leaf_states(state, treedef, new_states)


def _widened(g):
    return g.astype(jnp.float32)


def step_masters(model, optimizer, grads, settings, finite=None) -> None:
    """The optimizer step of a trainer whose masters are in host memory: ``update_masters``
    with ``settings`` (the ``OptimizerConfig``), written into ``model`` and ``optimizer``
    (an ``nnx.Optimizer`` built with ``settings.transformation()``, whose state layout is
    the same), the step count advanced where ``finite`` (None: always)."""
    opt_state = nnx.as_pure(optimizer.opt_state)
    base_state = opt_state[1] if settings.clip_norm else opt_state
    masters, base_state = update_masters(
        settings.base_transformation(),
        settings.clip_norm,
        nnx.as_pure(grads),
        base_state,
        nnx.as_pure(nnx.state(model, optimizer.wrt)),
        state_on_host=settings.offload,
        finite=finite,
    )
    nnx.update(model, masters)
    new_state = (opt_state[0], base_state) if settings.clip_norm else base_state
    nnx.update(optimizer.opt_state, nnx.state(new_state))
    step = optimizer.step[...]
    optimizer.step[...] = step + 1 if finite is None else jnp.where(finite, step + 1, step)
