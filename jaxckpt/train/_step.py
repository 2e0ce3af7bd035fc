"""The jitted train step (the gradients from ``_grads``, the optimizer update skipped where
not finite, donation) and the ``Trainer`` that owns it."""

import collections
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxckpt._sizes import format_bytes, host_memory
from jaxckpt.attention import check_strategy, to_zigzag
from jaxckpt.data import PackedBatch
from jaxckpt.nn import activation_sharding, trainable
from jaxckpt.remat import RematSpec
from jaxckpt.remat import get as get_remat
from jaxckpt.train._distributed import put_global
from jaxckpt.train._grads import loss_and_grads
from jaxckpt.train._loss import PACKED_FIELDS, is_packed
from jaxckpt.train._loss_scale import all_finite, keep_if_finite
from jaxckpt.train._master import compute_copies, require_master_weights, step_masters
from jaxckpt.train._offload import offload_shardings, require_host_memory
from jaxckpt.train._optimizers import OptimizerConfig
from jaxckpt.train._sharding import (
    activation_rules,
    batch_sharding,
    check_batch_split,
    replicated,
    seq_split,
    state_shardings,
)

__all__ = ["OptimizerConfig", "Trainer", "jit_train_step"]


def _dropout_key(model, optimizer, seed: int) -> "jax.Array | None":
    """The step's key for the LoRA adapters' dropout (the seed folded with the step count),
    or None when the model has no dropout."""
    lora = model.config.lora
    if lora is None or lora.dropout == 0:
        return None
    return jax.random.fold_in(jax.random.key(seed), optimizer.step[...])


def zigzag_batch(batch, n: int):
    """``batch`` with every position of its rows in the load-balanced order of a sequence
    split over ``n`` devices (``jaxckpt.attention.zigzag_order``), for context parallelism.

    A token batch ``[M, B, T + 1]`` becomes a packed-form batch (``jaxckpt.data.PackedBatch``
    with ``inputs``, ``targets``, weights 1, no segment ids and ``positions`` ``0..T-1``)
    so that each target stays with its input; a packed batch has all its fields reordered.
    The model then reads the positions (RoPE, and the attention's masks), so its loss is
    the loss of the original order (fp32 rounding aside).

    Raises:
        ValueError: unless ``2 * n`` divides T, naming both.

    Example:
        >>> import jax.numpy as jnp
        >>> zigzag_batch(jnp.arange(9)[None, None], 2).positions.tolist()
        [[[0, 1, 6, 7, 2, 3, 4, 5]]]
    """
    if not is_packed(batch):
        inputs, targets = batch[..., :-1], batch[..., 1:]
        positions = jnp.broadcast_to(jnp.arange(inputs.shape[-1], dtype=jnp.int32), inputs.shape)
        batch = PackedBatch(inputs, targets, jnp.ones(inputs.shape, jnp.float32), None, positions)
    t = batch.inputs.shape[-1]
    if t % (2 * n):
        raise ValueError(
            f"seq={t} must be a multiple of 2 x the mesh's seq={n} = {2 * n}: each device of the "
            f"seq axis holds two chunks of every row (the load-balanced order); "
            f"e.g. seq={2 * n * max(1, t // (2 * n))}"
        )
    fields = (getattr(batch, name) for name in PACKED_FIELDS)
    return type(batch)(*(None if x is None else to_zigzag(x, n, axis=2) for x in fields))


def _train_step(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    batch: jax.Array,
    *,
    spec: RematSpec,
    mesh=None,
    seed: int = 0,
    masters: "OptimizerConfig | None" = None,
    context_parallel: str = "all_gather",
):
    model, optimizer = nnx.merge(graphdef, state)
    model_def, params, rest = nnx.split(model, trainable(model.config), ...)
    key = _dropout_key(model, optimizer, seed)
    scaler = getattr(optimizer, "loss_scaler", None)  # a plain nnx.Optimizer has none
    scale = None if scaler is None or scaler.mode == "none" else scaler.scale[...]
    accumulate = None
    if masters is not None:  # host-memory masters: the step computes with device copies
        params, accumulate = compute_copies(params, model.config.compute_dtype), jnp.float32
    if mesh is None:
        loss, grads = loss_and_grads(model_def, params, rest, batch, spec, key, scale, accumulate)
    else:  # activations split over the batch, as the tokens are, and over T with a seq axis
        if seq_split(mesh) > 1:
            batch = zigzag_batch(batch, seq_split(mesh))
        with activation_sharding(mesh, activation_rules(mesh), context_parallel=context_parallel):
            loss, grads = loss_and_grads(model_def, params, rest, batch, spec, key, scale, accumulate)
    finite = all_finite((loss, grads))
    skips = scaler is not None and scaler.skip_nonfinite
    with jax.numpy_dtype_promotion("standard"):  # optax mixes float and int32 (decay**count)
        if masters is not None:
            step_masters(model, optimizer, grads, masters, finite if skips else None)
        elif not skips:
            optimizer.update(model, grads)
        else:
            _update_if_finite(model, optimizer, grads, finite)
        if scaler is not None:
            scaler.adjust(finite)
    return nnx.state((model, optimizer)), loss


def _update_if_finite(model, optimizer, grads, finite: jax.Array) -> None:
    """The optimizer's update where ``finite``; else params, step count and optimizer state
    are left as they were (the transformation keeps its state itself: ``finite=``)."""
    params, step = nnx.as_pure(nnx.state(model, optimizer.wrt)), optimizer.step[...]  # the values
    optimizer.update(model, grads, finite=finite)
    nnx.update(model, keep_if_finite(finite, nnx.as_pure(nnx.state(model, optimizer.wrt)), params))
    optimizer.step[...] = jnp.where(finite, optimizer.step[...], step)


def jit_train_step(
    graphdef: nnx.GraphDef,
    spec: RematSpec,
    shardings=None,
    mesh=None,
    seed: int = 0,
    masters: "OptimizerConfig | None" = None,
    context_parallel: str = "all_gather",
):
    """The jitted step ``(state, batch [M, B, T + 1]) -> (state, loss)`` with ``state``
    donated; ``state`` is ``nnx.split((model, nnx.Optimizer))[1]``, real or abstract.

    With a ``mesh``, ``shardings`` (the state's, from ``state_shardings``) pin the
    state in and out, and the batch is split over the mesh (data parallel + FSDP).
    Without one, ``shardings`` (``offload_shardings``) pin the state's memory kinds.
    A mesh with a ``seq`` axis also splits every row along T (context parallelism): the
    step puts the rows in the zigzag order (``zigzag_batch``) and the attention runs
    across the shards with the ``context_parallel`` strategy (``"all_gather"``, ``"ring"``).

    A ``TrainOptimizer`` (``OptimizerConfig.build``) brings its loss scaler: the loss is
    scaled and the gradients unscaled, and with ``skip_nonfinite`` a step whose loss or
    gradients are not finite leaves params and optimizer state unchanged.

    ``masters`` (the ``OptimizerConfig``, with ``offload_master``): the float32 master
    weights are in host memory (``shardings`` place them), the step computes with their
    16-bit copies and updates them leaf by leaf (``jaxckpt.train._master``).

    Example:
        >>> import jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> from jaxckpt import nn, remat, train
        >>> model = nn.Transformer(nn.TransformerConfig.preset("tiny", n_layers=1), rngs=nnx.Rngs(0))
        >>> graphdef, state = nnx.split((model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)))
        >>> step = train.jit_train_step(graphdef, remat.get("full"))
        >>> state, loss = step(state, jnp.zeros((1, 2, 9), jnp.int32))
        >>> bool(loss > 0)
        True
    """
    step = functools.partial(
        _train_step,
        graphdef,
        spec=spec,
        mesh=mesh,
        seed=seed,
        masters=masters,
        context_parallel=context_parallel,
    )
    if mesh is None:
        if shardings is None:
            return jax.jit(step, donate_argnums=0)
        return jax.jit(step, donate_argnums=0, out_shardings=(shardings, None))
    return jax.jit(
        step,
        donate_argnums=0,
        in_shardings=(shardings, batch_sharding(mesh)),
        out_shardings=(shardings, replicated(mesh)),
    )


_SHARED_STEPS_MAX = 32
"""How many jitted steps ``_shared_train_step`` keeps (the least recently used goes first)."""
_shared_steps: "collections.OrderedDict[tuple, Callable]" = collections.OrderedDict()


def _shared_train_step(
    model_graphdef: nnx.GraphDef,
    optimizer: OptimizerConfig,
    graphdef: nnx.GraphDef,
    spec: RematSpec,
    shardings,
    mesh,
    seed: int,
    masters: "OptimizerConfig | None",
    context_parallel: str,
):
    """``jit_train_step(graphdef, spec, shardings, mesh, seed, masters, context_parallel)``,
    one jitted function for every ``Trainer`` of the same model structure and options, so that
    a second such trainer in a process (a resumed run, another run of the same config, the
    tests) reuses the first one's trace, lowering and compiled program instead of doing all
    three again (a 3-layer tiny model: 1.8 s of its first step).

    The key is everything the step depends on but the state's values: the model's graphdef
    (its structure, config and variable metadata), the optimizer's config (the
    ``nnx.Optimizer``'s graphdef holds the optax transformation, a new closure per build,
    which ``OptimizerConfig.transformation`` makes from the config alone), the remat spec,
    the state's shardings (their tree and every leaf), the mesh, the dropout seed, the
    master weights' config and the context-parallel strategy. ``graphdef``, the full
    ``(model, optimizer)`` one, is what the step merges the state with (equal models and
    configs give the same structure). Tested in tests/train/test_train.py.
    """
    leaves, tree = jax.tree.flatten(shardings)
    key = (model_graphdef, optimizer, spec, tree, tuple(leaves), mesh, seed, masters, context_parallel)
    if key in _shared_steps:
        _shared_steps.move_to_end(key)
        return _shared_steps[key]
    step = jit_train_step(graphdef, spec, shardings, mesh, seed, masters, context_parallel)
    _shared_steps[key] = step
    if len(_shared_steps) > _SHARED_STEPS_MAX:
        _shared_steps.popitem(last=False)
    return step


def check_seq(config, seq: int) -> None:
    """Raises a ValueError naming ``seq`` when it exceeds ``config.max_len``.

    Example:
        >>> from jaxckpt import nn
        >>> check_seq(nn.TransformerConfig.preset("tiny", max_len=64), 100)
        Traceback (most recent call last):
        ...
        ValueError: seq=100 exceeds the model's config.max_len=64; use a shorter seq
    """
    if seq > config.max_len:
        raise ValueError(f"seq={seq} exceeds the model's config.max_len={config.max_len}; use a shorter seq")


STEP_TOKEN_BYTES = 4
"""Bytes of one input token on the host (int32)."""


def check_step_tokens(batch: int, seq: int, micro_batches: int) -> None:
    """Raises a ValueError naming ``micro_batches`` when one step's input tokens alone
    (``micro_batches x batch`` windows of ``seq + 1`` int32 tokens) exceed this machine's
    memory: the data pipeline could not even hold them.

    Example:
        >>> check_step_tokens(8, 2048, 16)
        >>> check_step_tokens(2, 32, 10**12)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: micro_batches=1000000000000 x batch=2 windows of seq=32 + 1 tokens take 245869.16 GiB...
    """
    need, memory = micro_batches * batch * (seq + 1) * STEP_TOKEN_BYTES, host_memory()
    if need > memory:
        raise ValueError(
            f"micro_batches={micro_batches} x batch={batch} windows of seq={seq} + 1 tokens take "
            f"{format_bytes(need)} per step as int32, more than this machine's "
            f"{format_bytes(memory)} of memory; use fewer micro-batches"
        )


def check_batch(batch) -> None:
    """Raises a ValueError unless ``batch`` is integer ``[M, B, T + 1]``, or a packed batch
    whose fields are all ``[M, B, T]`` (integer, but for float weights).

    ``T <= max_len`` is checked once, by the model, when the step is traced.
    """
    if is_packed(batch):
        shapes = {name: tuple(getattr(batch, name).shape) for name in PACKED_FIELDS}
        if len(set(shapes.values())) != 1 or len(shapes["inputs"]) != 3:
            raise ValueError(f"a packed batch's fields must all be [micro_batches, B, T], got {shapes}")
        return
    if batch.ndim != 3 or not jnp.issubdtype(batch.dtype, jnp.integer):
        raise ValueError(
            f"batch must be integer tokens [micro_batches, B, T + 1], got {batch.shape=} {batch.dtype=}"
        )


def _on_device(batch):
    if is_packed(batch):
        return type(batch)(*(jnp.asarray(getattr(batch, name)) for name in PACKED_FIELDS))
    return jnp.asarray(batch, jnp.int32)


def _on_host(batch):
    if is_packed(batch):
        return type(batch)(*(np.asarray(getattr(batch, name)) for name in PACKED_FIELDS))
    return np.asarray(batch, np.int32)


class Trainer:
    """Owns a model, its ``nnx.Optimizer`` and the jitted, state-donating train step.

    Args:
        model: a ``jaxckpt.nn.Transformer`` (its parameters are moved into the trainer).
        optimizer: the optimizer (AdamW by default), its state's dtype and placement, and
            the loss scaling (``OptimizerConfig``).
        remat: the remat spec of the step (a preset name or ``RematSpec``; ``"full"``
            by default).
        mesh: a ``jax.sharding.Mesh`` with axes ``data`` and ``fsdp`` (``make_mesh``):
            parameters, gradients and optimizer state are split over ``fsdp``, batches
            over both; with a ``seq`` axis too, every row is split along T over it
            (context parallelism, the rows in the zigzag order). None: one device. In a
            multi-process run (``train.initialize``) the mesh spans every process's devices,
            and every process must build the same model and pass the same global batches;
            each places only its own shards.
        seed: the LoRA adapters' dropout draws from it (with the step count).
        context_parallel: on a mesh with a ``seq`` axis, the attention's strategy across
            the shards: ``"all_gather"`` (default) or ``"ring"``.

    A model with LoRA adapters (``config.lora``) trains them alone: the optimizer is over
    ``nnx.LoRAParam`` (``nn.trainable``), and the base gets no gradient and no state.
    With ``optimizer.offload`` the optimizer state lives in ``pinned_host`` memory
    (``offload_shardings``; on CPU the same RAM: nothing is saved), and with
    ``optimizer.offload_master`` a full fine-tuning's float32 master weights too (the
    model ``Trainer.model`` returns then holds them there: evaluate it through
    ``train.Evaluator``, which computes with device copies).

    Raises:
        ValueError: ``optimizer.offload`` or ``offload_master`` on a device without
            ``pinned_host`` memory, or ``offload_master`` without float32 masters of a
            16-bit compute (``has_master_weights``).

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from jaxckpt import nn, train
        >>> model = nn.Transformer(nn.TransformerConfig.preset("tiny", n_layers=1), rngs=nnx.Rngs(0))
        >>> trainer = train.Trainer(model, remat="save_attn")
        >>> loss = trainer.step(jnp.zeros((2, 3, 9), jnp.int32))  # 2 micro-batches of 3 x 8 tokens
        >>> bool(loss > 0)
        True
    """

    def __init__(
        self,
        model: nnx.Module,
        *,
        optimizer: OptimizerConfig | None = None,
        remat="full",
        mesh=None,
        seed: int = 0,
        context_parallel: str = "all_gather",
    ):
        check_strategy(context_parallel, "context_parallel")
        self.config = model.config
        self.spec = get_remat(remat)
        self.optimizer = optimizer or OptimizerConfig()
        if self.optimizer.offload_master:
            require_master_weights(model.config)
        if self.optimizer.offload or self.optimizer.offload_master:
            require_host_memory()
        opt = self.optimizer.build(model)
        self.loss_scale_mode = opt.loss_scaler.mode
        """``"dynamic"``, ``"static"`` or ``"none"`` (``OptimizerConfig.loss_scale`` for this model)."""
        self.skips_nonfinite = opt.loss_scaler.skip_nonfinite
        """Whether a step with a non-finite loss or gradients is skipped."""
        self.graphdef, self.state = nnx.split((model, opt))
        self.mesh, self.shardings = mesh, None
        if mesh is not None:
            self.shardings = state_shardings(self.state, mesh)
        if self.optimizer.offload or self.optimizer.offload_master:
            self.shardings = offload_shardings(
                self.state,
                self.shardings,
                optimizer=self.optimizer.offload,
                masters=self.optimizer.offload_master,
            )
        if self.shardings is not None:
            self.state = put_global(self.state, self.shardings)
        masters = self.optimizer if self.optimizer.offload_master else None
        self._step = _shared_train_step(
            nnx.graphdef(model),
            self.optimizer,
            self.graphdef,
            self.spec,
            self.shardings,
            mesh,
            seed,
            masters,
            context_parallel,
        )
        self._compiled: dict[tuple[int, ...], jax.stages.Compiled] = {}

    def step(self, batch) -> jax.Array:
        """Runs one step on ``batch [M, B, T + 1]`` (or a ``PackedBatch``) and returns its
        mean loss (on device)."""
        check_batch(batch)
        # Several processes: each cuts its shards from the host copy (no trip through a device).
        batch = _on_host(batch) if jax.process_count() > 1 else _on_device(batch)
        compiled = self.compile(batch)  # checks the batch against the mesh first
        if self.mesh is not None:
            sharding = batch_sharding(self.mesh)
            batch = put_global(batch, jax.tree.map(lambda _: sharding, batch))
        self.state, loss = compiled(self.state, batch)
        return loss

    def compile(self, batch) -> jax.stages.Compiled:
        """The compiled step for batches like ``batch`` (a token batch's shape
        ``(M, B, T + 1)``, or a batch itself, token or packed): compiled once, then reused
        by ``step``, so its memory analysis describes exactly what runs."""
        if isinstance(batch, tuple) and not is_packed(batch):
            batch = jax.ShapeDtypeStruct(tuple(batch), jnp.int32)
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch)
        key = (jax.tree.structure(abstract), tuple((a.shape, a.dtype) for a in jax.tree.leaves(abstract)))
        if key not in self._compiled:
            check_batch(abstract)
            check_batch_split(jax.tree.leaves(abstract)[0].shape[1], self.mesh)
            self._compiled[key] = self._step.lower(self.state, abstract).compile()
        return self._compiled[key]

    @property
    def model(self) -> nnx.Module:
        """The current model (a view of the trainer's state)."""
        return nnx.merge(self.graphdef, self.state)[0]

    @property
    def step_count(self) -> int:
        """How many updates the optimizer has applied (a skipped step is not one)."""
        return int(nnx.merge(self.graphdef, self.state)[1].step[...])

    def loss_scale(self) -> dict:
        """``{"mode", "scale", "skipped_steps"}`` of the loss scaler, read from the device:
        ``scale`` is None without scaling; ``skipped_steps`` counts every step skipped for
        non-finite values, also before a resume (it is saved with the checkpoints)."""
        scaler = self.state[1]["loss_scaler"]
        scale = None if self.loss_scale_mode == "none" else float(scaler["scale"][...])
        return {"mode": self.loss_scale_mode, "scale": scale, "skipped_steps": int(scaler["skipped"][...])}
