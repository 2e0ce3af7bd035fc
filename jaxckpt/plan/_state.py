"""The train state's bytes on one device: params and optimizer state, whole or FSDP-split.

Everything here comes from the abstract model (``nnx.eval_shape``): nothing is
allocated, so it works for models far larger than this machine's memory. Over
``devices`` each device holds the shards ``jaxckpt.train.state_shardings`` gives it on
an ``fsdp=D`` mesh.
"""

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh

from jaxckpt.nn import Transformer, TransformerConfig
from jaxckpt.plan._workload import OPTIMIZERS, Workload
from jaxckpt.train import state_shardings


def tree_bytes(tree) -> int:
    """Bytes of every array (or ``ShapeDtypeStruct``) leaf of ``tree``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> tree_bytes({"w": jax.ShapeDtypeStruct((3, 5), jnp.float32), "b": jnp.ones(7, jnp.bfloat16)})
        74
    """
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def abstract_train_state(config: TransformerConfig, optimizer: str = "adamw"):
    """Abstract ``(model, nnx.Optimizer)``: their variables hold ``ShapeDtypeStruct``s.

    Nothing is allocated, so it works for models far larger than this machine's memory.

    Example:
        >>> from flax import nnx
        >>> from jaxckpt import nn, plan
        >>> from jaxckpt.plan._state import abstract_train_state
        >>> model, opt = abstract_train_state(nn.TransformerConfig.preset("tiny"), "sgd")
        >>> plan.tree_bytes(nnx.state(model, nnx.Param)) > 0
        True
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer={optimizer!r}; valid: {', '.join(OPTIMIZERS)}")
    tx = OPTIMIZERS[optimizer]()

    def build():
        model = Transformer(config, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    return nnx.eval_shape(build)


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
    shape = {"data": 1, "fsdp": devices}
    mesh = AbstractMesh(tuple(shape.values()), tuple(shape))
    shardings = state_shardings(state, mesh)
    total = 0
    for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(shardings), strict=True):
        local = sharding.shard_shape(leaf.shape)
        total += math.prod(local) * jnp.dtype(leaf.dtype).itemsize
    return total


@functools.lru_cache(maxsize=64)
def _state_bytes(config: TransformerConfig, optimizer: str, devices: int) -> tuple[int, int]:
    model, opt = abstract_train_state(config, optimizer)
    return sharded_bytes(nnx.state(model, nnx.Param), devices), sharded_bytes(nnx.state(opt), devices)


def state_bytes(workload: Workload) -> tuple[int, int]:
    """``(params, optimizer state)`` bytes on one of the workload's devices.

    Only ``config``, ``optimizer`` and ``devices`` matter (not the batch).

    Example:
        >>> from jaxckpt import nn, plan
        >>> w = plan.Workload(nn.TransformerConfig.preset("tiny"), batch=2, seq=64)
        >>> params, adamw = plan.state_bytes(w)
        >>> plan.state_bytes(w.replace(devices=2))[0] * 2 == params
        True
    """
    return _state_bytes(workload.config, workload.optimizer, workload.devices)


@functools.lru_cache(maxsize=64)
def _update_workspace(config: TransformerConfig, optimizer: str, devices: int) -> int:
    if optimizer == "sgd":
        return 0
    model, _ = abstract_train_state(config, optimizer)
    params = nnx.state(model, nnx.Param)
    if optimizer == "adafactor":
        return max(tree_bytes(leaf) for leaf in jax.tree.leaves(params))
    return sharded_bytes(params, devices)


def update_workspace(workload: Workload) -> int:
    """Bytes the optimizer update needs after the backward pass (the activations' buffers are free).

    AdamW's update is one params-sized tree (on ``devices``: one device's shards);
    Adafactor's factored update goes one parameter at a time (the largest one); SGD
    updates in place.
    """
    return _update_workspace(workload.config, workload.optimizer, workload.devices)


def layer_param_bytes(config: TransformerConfig) -> int:
    """Bytes of one layer's parameters (the embeddings and head left out)."""
    params, _ = _state_bytes(config, "sgd", 1)
    embed = config.vocab_size * config.d_model * config.storage_dtype.itemsize
    return (params - embed * (1 if config.tie_embeddings else 2)) // config.n_layers
