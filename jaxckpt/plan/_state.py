"""The train state's bytes on one device: the model, its gradients and the optimizer state.

Everything here comes from the abstract model (``nnx.eval_shape``): nothing is
allocated, so it works for models far larger than this machine's memory. Over
``devices`` each device holds the shards ``jaxckpt.train.state_shardings`` gives it on
an ``fsdp=D`` mesh.

The model's bytes are all of its variables: with LoRA (``config.lora``) the frozen base
(``nnx.Param``, or its quantized kernels with ``config.quantize_base``) and the adapters.
Only the trainable variables (``nn.trainable``: the adapters alone under LoRA) have a
gradient and optimizer state.
"""

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh

from jaxckpt.nn import Transformer, TransformerConfig, trainable
from jaxckpt.plan._compilers import on_tpu
from jaxckpt.plan._targets import Target, compile_target
from jaxckpt.plan._workload import OPTIMIZERS, Workload
from jaxckpt.train import OptimizerConfig, state_shardings


def tree_bytes(tree) -> int:
    """Bytes of every array (or ``ShapeDtypeStruct``) leaf of ``tree``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> tree_bytes({"w": jax.ShapeDtypeStruct((3, 5), jnp.float32), "b": jnp.ones(7, jnp.bfloat16)})
        74
    """
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _optimizer(optimizer: "str | OptimizerConfig") -> OptimizerConfig:
    if isinstance(optimizer, OptimizerConfig):
        return optimizer
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer={optimizer!r}; valid: {', '.join(OPTIMIZERS)}")
    return OptimizerConfig(name=optimizer)


def build_optimizer(model: nnx.Module, optimizer: OptimizerConfig) -> nnx.Optimizer:
    """The optimizer ``train.Trainer`` builds over ``model``: over ``nn.trainable`` only
    (the LoRA adapters alone when ``config.lora`` is set), with the trainer's own state.

    Example:
        >>> from flax import nnx
        >>> from jaxckpt import nn, plan
        >>> model = nn.Transformer(nn.TransformerConfig.preset("tiny", n_layers=1, lora=2), rngs=nnx.Rngs(0))
        >>> opt = build_optimizer(model, plan.Workload(model.config, 1, 8).optimizer)
        >>> opt.wrt is nnx.LoRAParam
        True
    """
    build = getattr(optimizer, "build", None)
    if build is not None:
        return build(model)
    return nnx.Optimizer(model, optimizer.transformation(), wrt=trainable(model.config))


def abstract_train_state(config: TransformerConfig, optimizer: "str | OptimizerConfig" = "adamw"):
    """Abstract ``(model, optimizer)``: their variables hold ``ShapeDtypeStruct``s.

    Nothing is allocated, so it works for models far larger than this machine's memory.
    The optimizer is the trainer's (``build_optimizer``): over the trainable variables.

    Args:
        config: the model.
        optimizer: a key of ``OPTIMIZERS`` or a ``train.OptimizerConfig``.

    Example:
        >>> from flax import nnx
        >>> from jaxckpt import nn, plan
        >>> from jaxckpt.plan._state import abstract_train_state
        >>> model, opt = abstract_train_state(nn.TransformerConfig.preset("tiny"), "sgd")
        >>> plan.tree_bytes(nnx.state(model, nnx.Param)) > 0
        True
    """
    optimizer = _optimizer(optimizer)

    def build():
        model = Transformer(config, rngs=nnx.Rngs(0))
        return model, build_optimizer(model, optimizer)

    return nnx.eval_shape(build)


TPU_MIN_ALLOCATION = 512
"""The least bytes XLA:TPU gives an array in HBM (``f32[]`` and ``bf16[144]`` each take 512
in the buffer assignment of a ``tiny``-sized step for v5e)."""


def tpu_padded_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    """Bytes XLA:TPU allocates for an array of ``shape`` in HBM, its tiles padded.

    Read off the parameters of bf16 steps for v5e (d_model 144, F 392, V 301, head_dim 48;
    ``small``): of the two minor-most dimensions, one is laid out as the lanes, padded to
    128, the other as the sublanes, padded to a whole tile of ``8 x 4 / itemsize`` rows (16
    in bf16) or to a power of two under it (``bf16[2,144]``: 1,024 bytes, ``T(2,128)``),
    whichever way pads less: ``bf16[2,392,144]`` and ``bf16[2,144,392]`` both take 294,912
    bytes (144 x 512 per layer), ``bf16[301,144]`` 110,592 (144 x 384), ``small``'s
    ``bf16[8,512,1376]`` its 11,272,192 (1,376 rows of 512 lanes). A vector takes whole
    512-byte units.

    Example:
        >>> tpu_padded_bytes((2, 392, 144), 2), tpu_padded_bytes((301, 144), 2), tpu_padded_bytes((2, 144), 2)
        (294912, 110592, 1024)
        >>> tpu_padded_bytes((), 4), tpu_padded_bytes((32, 4096, 14336), 2) == 32 * 4096 * 14336 * 2
        (512, True)
    """
    if len(shape) < 2:
        raw = math.prod(shape) * itemsize
    else:
        *lead, a, b = shape
        tile = 8 * 4 // itemsize

        def tiles(rows: int, lanes: int) -> int:
            rows = -(-rows // tile) * tile if rows >= tile else 1 << max(0, rows - 1).bit_length()
            return rows * (-(-lanes // 128) * 128)

        raw = math.prod(lead) * min(tiles(a, b), tiles(b, a)) * itemsize
    return max(TPU_MIN_ALLOCATION, -(-raw // TPU_MIN_ALLOCATION) * TPU_MIN_ALLOCATION)


def sharded_bytes(state, devices: int, *, padded: bool = False) -> int:
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
        local, itemsize = sharding.shard_shape(leaf.shape), jnp.dtype(leaf.dtype).itemsize
        total += tpu_padded_bytes(local, itemsize) if padded else math.prod(local) * itemsize
    return total


@functools.lru_cache(maxsize=32)
def _abstract_model(config: TransformerConfig) -> Transformer:
    """The abstract model of ``config``, traced once for every byte count of it (the planner's
    predictions count one model's bytes many ways: whole, per layer, per device, padded). It is
    shared: read it, never change it."""
    return nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))


@functools.lru_cache(maxsize=32)
def _abstract_optimizer(config: TransformerConfig, optimizer: OptimizerConfig) -> nnx.Optimizer:
    """The abstract optimizer ``build_optimizer`` makes over ``_abstract_model(config)``,
    without tracing the model again (the same state as ``abstract_train_state``'s)."""
    return nnx.eval_shape(lambda model: build_optimizer(model, optimizer), _abstract_model(config))


@functools.lru_cache(maxsize=64)
def _model_bytes(config: TransformerConfig, devices: int, padded: bool = False) -> tuple[int, int]:
    """``(model, trainable)`` bytes on one of ``devices`` (``padded``: as XLA:TPU allocates them)."""
    model = _abstract_model(config)
    return (
        sharded_bytes(nnx.state(model), devices, padded=padded),
        sharded_bytes(nnx.state(model, trainable(config)), devices, padded=padded),
    )


@functools.lru_cache(maxsize=64)
def _optimizer_bytes(
    config: TransformerConfig, optimizer: OptimizerConfig, devices: int, padded: bool = False
) -> tuple[int, bool]:
    """The optimizer state's bytes on one of ``devices`` (``padded``: as XLA:TPU allocates
    them), and whether the step scales its loss."""
    opt = _abstract_optimizer(config, optimizer)
    scaler = getattr(opt, "loss_scaler", None)
    return sharded_bytes(nnx.state(opt), devices, padded=padded), scaler is not None and scaler.mode != "none"


def _key(workload: Workload) -> tuple:
    return workload.config, workload.optimizer, workload.devices


def state_bytes(workload: Workload, *, target: "str | Target | None" = None) -> tuple[int, int]:
    """``(params, optimizer state)`` bytes on one of the workload's devices, wherever they live.
    For a TPU ``target``, as XLA:TPU allocates them, each array's tiles padded
    (``tpu_padded_bytes``: the odd-sized step of ``test_plan_tpu_model`` has 4.30 MiB of
    arguments for 3.07 MiB of state; a model of multiples of 128 pads nothing).

    ``params`` is the whole model: under LoRA the frozen base (quantized or not) and the
    adapters. The optimizer state is over the trainable variables only. Only ``config``,
    the optimizer fields and ``devices`` matter (not the batch).

    Example:
        >>> from jaxckpt import nn, plan
        >>> w = plan.Workload(nn.TransformerConfig.preset("tiny"), batch=2, seq=64)
        >>> params, adamw = plan.state_bytes(w)
        >>> plan.state_bytes(w.replace(devices=2))[0] * 2 == params
        True
        >>> lora = w.replace(config=w.config.replace(lora=4))
        >>> plan.state_bytes(lora)[1] < adamw / 10  # the adapters' moments alone
        True
    """
    config, optimizer, devices = _key(workload)
    padded = on_tpu(target)
    return _model_bytes(config, devices, padded)[0], _optimizer_bytes(config, optimizer, devices, padded)[0]


def loss_scale_bytes(workload: Workload) -> int:
    """Bytes the loss scaling adds to the step: with a float16 model (``train.OptimizerConfig``'s
    ``loss_scale="auto"``) the gradients are unscaled into a second trainable-sized tree
    (measured: a full fine-tuning of ``llama2-7b`` in float16 grows by its fp32 params).

    Example:
        >>> from jaxckpt import nn, plan
        >>> cfg = nn.TransformerConfig.preset("tiny", dtype="float16")
        >>> loss_scale_bytes(plan.Workload(cfg, 2, 64)) == trainable_bytes(plan.Workload(cfg, 2, 64))
        True
        >>> loss_scale_bytes(plan.Workload(cfg.replace(dtype="bfloat16"), 2, 64))
        0
    """
    config, optimizer, devices = _key(workload)
    scaled = _optimizer_bytes(config, optimizer, devices)[1]
    return _model_bytes(config, devices)[1] if scaled else 0


def trainable_bytes(workload: Workload, *, target: "str | Target | None" = None) -> int:
    """Bytes of the trainable variables on one device (``nn.trainable``): one gradient's
    (for a TPU ``target`` padded as ``state_bytes`` pads them).

    Example:
        >>> from jaxckpt import nn, plan
        >>> w = plan.Workload(nn.TransformerConfig.preset("tiny", lora=4), batch=2, seq=64)
        >>> trainable_bytes(w) < plan.state_bytes(w)[0] / 10
        True
    """
    return _model_bytes(workload.config, workload.devices, on_tpu(target))[1]


@functools.lru_cache(maxsize=64)
def _largest_trainable_leaf(config: TransformerConfig) -> int:
    model = _abstract_model(config)
    return max(tree_bytes(leaf) for leaf in jax.tree.leaves(nnx.state(model, trainable(config))))


def _adafactor_workspace(workload: Workload) -> int:
    return _largest_trainable_leaf(workload.config)


def _sgd_workspace(workload: Workload) -> int:
    return 0


UPDATE_WORKSPACES = {"adamw": _sgd_workspace, "adafactor": _adafactor_workspace, "sgd": _sgd_workspace}
"""Optimizer name -> the bytes its update needs after the backward pass (see ``update_workspace``)."""


def update_workspace(workload: Workload) -> int:
    """Bytes the optimizer update needs after the backward pass (the activations' buffers are free).

    AdamW and SGD update in place: XLA:CPU reuses the gradients' and the donated state's
    buffers (the params-sized temporary it allocated went with the one-multiply clip,
    ``train.clip_by_global_norm``: ``small`` at B=1, T=64 measures 406 MiB, 407 predicted
    without it and 488 with it). Adafactor's factored update goes one parameter at a
    time (the largest one). With the state or the master weights in host memory
    (``optimizer.offload`` / ``offload_master``) the update streams leaf by leaf:
    one leaf's state and update (the largest) at a time.
    """
    if workload.optimizer.offload or workload.optimizer.offload_master:
        return 3 * _largest_trainable_leaf(workload.config)
    return UPDATE_WORKSPACES[workload.optimizer.name](workload)


def layer_param_bytes(config: TransformerConfig) -> int:
    """Bytes of one layer's variables (the embeddings and head left out): under LoRA its
    frozen base and its adapters."""
    params, _ = _model_bytes(config, 1)
    return (params - _embedding_bytes(config)) // config.n_layers


def layer_trainable_bytes(config: TransformerConfig) -> int:
    """Bytes of one layer's trainable variables: its weight-gradient slice (under LoRA, the
    adapters'; the embeddings and head are frozen then)."""
    _, train = _model_bytes(config, 1)
    if config.lora is not None:
        return train // config.n_layers
    return (train - _embedding_bytes(config)) // config.n_layers


def _embedding_bytes(config: TransformerConfig) -> int:
    embed = config.vocab_size * config.d_model * config.storage_dtype.itemsize
    return embed * (1 if config.tie_embeddings else 2)


WIDENED = jnp.dtype(jnp.bfloat16)
"""The dtype XLA:CPU has no kernels for: it computes it in float32 (see ``widened_bytes``)."""


@functools.lru_cache(maxsize=64)
def _stack_shards(config: TransformerConfig, devices: int) -> tuple:
    """``(dtype, shard shape, partition spec)`` of each layer-stack leaf on one of ``devices``
    FSDP devices (``state_shardings``)."""
    stacks = nnx.state(_abstract_model(config))["blocks"]
    shardings = state_shardings(stacks, AbstractMesh((1, devices), ("data", "fsdp")))
    return tuple(
        (jnp.dtype(leaf.dtype), sharding.shard_shape(leaf.shape), sharding.spec)
        for leaf, sharding in zip(jax.tree.leaves(stacks), jax.tree.leaves(shardings), strict=True)
    )


def _widened_bytes(config: TransformerConfig, devices: int) -> int:
    return sum(math.prod(shape) * 4 for dtype, shape, _ in _stack_shards(config, devices) if dtype == WIDENED)


def widened_bytes(workload: Workload, *, target: "str | Target | None" = None) -> int:
    """Bytes of XLA:CPU's float32 copies of the layer stacks stored in bfloat16.

    XLA:CPU has no bfloat16 kernels: its float normalization runs every bfloat16 op in
    float32, the scan's slicing of a weight stack among them, so each bfloat16 stack
    gets a float32 copy, live through the forward and backward passes (measured on
    ``small``: the step's temp grows by 4 bytes per bfloat16 weight). float16, which it
    computes natively, gets none, nor does XLA:GPU, which has bfloat16 kernels: for a GPU
    ``target`` (``plan.TARGETS``) this is 0.

    Example:
        >>> from jaxckpt import nn, plan
        >>> cfg = nn.TransformerConfig.preset("tiny", param_dtype="bfloat16")
        >>> w = plan.Workload(cfg, batch=2, seq=64)
        >>> embed_head_norm = 2 * 256 * 128 + 128  # not widened: not in the stack
        >>> widened_bytes(w) == 2 * plan.state_bytes(w)[0] - 4 * embed_head_norm
        True
        >>> widened_bytes(w.replace(config=cfg.replace(param_dtype="float16")))
        0
        >>> widened_bytes(w, target="h100-80g")
        0

    Host master weights (``optimizer.offload_master``) in a bfloat16 compute: the device's
    bfloat16 copies of the float32 masters are held in float32 there (XLA drops the
    round trip through bfloat16, ``xla_allow_excess_precision``), 2 bytes per stack
    weight over the copy ``predict`` counts (measured on ``small``: +48 MiB for 24M
    stack weights).
    """
    if target is not None:
        compile_target(target)
        return 0
    config = workload.config
    if workload.optimizer.offload_master and config.compute_dtype == WIDENED:
        return _widened_bytes(config.replace(param_dtype=config.dtype), workload.devices) // 2
    return _widened_bytes(config, workload.devices)


def _transposed_bytes(config: TransformerConfig, devices: int) -> int:
    total = 0
    for dtype, shape, spec in _stack_shards(config, devices):
        split = [d for d, axis in enumerate(spec) if axis is not None]
        if split and split[0] > 1:  # axis 0 is the layer; 1 is a layer's major axis
            total += math.prod(shape) * dtype.itemsize
    return total


def transposed_bytes(workload: Workload, *, target: "str | Target | None" = None) -> int:
    """Bytes of XLA:GPU's transposed copies of the layer stacks FSDP splits along a minor axis.

    XLA:GPU all-gathers along an operand's major dimension. A stack that ``fsdp=D`` splits
    along a layer's minor axis (the widest one: an up or gate projection's F) is
    relaid out once, its local shard copied whole with the split axis major (the copy is
    hoisted out of both scans and lives through the forward and backward passes): a
    ``llama2-7b`` device over 8 holds ``bf16[1376, 32, 4096]`` copies of its gate and up
    shards, 344 MiB each, beside the stacks. XLA:CPU, one device, or a stack split along a
    layer's major axis (down, q, k, v, o): 0.

    Example:
        >>> from jaxckpt import nn, plan
        >>> w = plan.Workload(nn.TransformerConfig.preset("tiny"), batch=4, seq=64, devices=4)
        >>> transposed_bytes(w), transposed_bytes(w, target="h100-80g") > 0
        (0, True)
        >>> transposed_bytes(w.replace(devices=1), target="h100-80g")
        0
    """
    if target is None or workload.devices == 1:
        if target is not None:
            compile_target(target)
        return 0
    compile_target(target)
    return _transposed_bytes(workload.config, workload.devices)
