"""The jitted train step: next-token loss, micro-batch accumulation, AdamW, donation."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxckpt.nn import activation_sharding, trainable
from jaxckpt.remat import RematSpec
from jaxckpt.remat import get as get_remat
from jaxckpt.train._distributed import put_global
from jaxckpt.train._loss import PACKED_FIELDS, is_packed, weighted_loss_sum
from jaxckpt.train._sharding import ACTIVATION_RULES, batch_sharding, replicated, state_shardings


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warm-up, cosine decay and global-norm clipping.

    Attributes:
        learning_rate: peak learning rate. warmup_steps: linear warm-up length.
        decay_steps: cosine decay length after warm-up (0 = constant after warm-up).
        weight_decay, b1, b2, eps: AdamW hyper-parameters. clip_norm: 0 disables clipping.

    Raises:
        ValueError: for a learning rate that is not positive or a negative step count.

    Example:
        >>> import jax.numpy as jnp
        >>> tx = OptimizerConfig(learning_rate=1e-3, warmup_steps=0).transformation()
        >>> params = {"w": jnp.ones(2)}
        >>> updates, _ = tx.update(params, tx.init(params), params)  # gradient = params
        >>> bool((updates["w"] < 0).all())  # a step against the gradient
        True
    """

    learning_rate: float = 3e-3
    warmup_steps: int = 10
    decay_steps: int = 0
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0

    def __post_init__(self):
        if not self.learning_rate > 0:
            raise ValueError(f"OptimizerConfig: learning_rate={self.learning_rate!r} must be > 0")
        for name in ("warmup_steps", "decay_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"OptimizerConfig: {name}={getattr(self, name)!r} must be >= 0")

    def transformation(self) -> optax.GradientTransformation:
        """The optax transformation."""
        peak = self.learning_rate
        if self.decay_steps:
            schedule = optax.warmup_cosine_decay_schedule(
                peak / (self.warmup_steps + 1),
                peak,
                max(self.warmup_steps, 1),
                self.warmup_steps + self.decay_steps,
                end_value=peak / 10,
            )
        else:
            schedule = (
                optax.linear_schedule(peak / (self.warmup_steps + 1), peak, self.warmup_steps)
                if self.warmup_steps
                else peak
            )
        adamw = optax.adamw(schedule, b1=self.b1, b2=self.b2, eps=self.eps, weight_decay=self.weight_decay)
        return optax.chain(clip_by_global_norm(self.clip_norm), adamw) if self.clip_norm else adamw


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm`` in the form its own TODO names as faster: every
    gradient times one scalar, ``min(1, max_norm / norm)``. optax's ``select`` between the
    gradient and its rescaled copy costs a params-sized buffer; on ``bench_finetune``'s
    100M model (XLA:CPU) this form cut the optimizer update from 263 to 147 ms and the
    step's temp memory from 756 to 637 MiB. The results differ from optax's in the last bit.

    Example:
        >>> import jax.numpy as jnp
        >>> clipped, _ = clip_by_global_norm(1.0).update({"w": jnp.array([3.0, 4.0])}, None)
        >>> clipped["w"].tolist()  # norm 5, scaled to 1
        [0.6000000238418579, 0.800000011920929]
    """

    def clip(updates, params=None):
        del params
        norm = optax.tree.norm(updates)
        scale = jnp.where(norm < max_norm, 1.0, max_norm / norm)
        return jax.tree.map(lambda g: g * scale.astype(g.dtype), updates)

    return optax.stateless(clip)


def next_token_loss(
    model: nnx.Module,
    tokens: jax.Array,
    remat: "str | RematSpec | None" = None,
    dropout_key: "jax.Array | None" = None,
) -> jax.Array:
    """Mean cross-entropy of predicting ``tokens[:, 1:]`` from ``tokens[:, :-1]`` (fp32).

    Args:
        model: a ``jaxckpt.nn.Transformer``.
        tokens: ``[B, T + 1]`` integer ids.
        remat: overrides the model's remat spec.
        dropout_key: turns on the LoRA adapters' dropout (``Transformer.__call__``).

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from jaxckpt import nn, train
        >>> model = nn.Transformer(nn.TransformerConfig.preset("tiny", n_layers=1), rngs=nnx.Rngs(0))
        >>> float(train.next_token_loss(model, jnp.zeros((2, 9), jnp.int32))) > 0
        True
    """
    logits = model(tokens[:, :-1], remat=remat, dropout_key=dropout_key).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def loss_and_grads(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    rest: nnx.State,
    batch: jax.Array,
    spec: RematSpec,
    dropout_key: "jax.Array | None" = None,
):
    """Mean loss and gradient over micro-batches ``batch [M, B, T + 1]``, or over a packed
    batch (``jaxckpt.data.PackedBatch``, fields ``[M, B, T]``): the mean over its weighted
    targets, each document attended to alone.

    With ``M > 1`` the micro-batches are a ``lax.scan`` that accumulates fp32-param
    gradients, so only one micro-batch's activations are live at a time. ``params`` are
    the trainable variables (``nn.trainable``), ``rest`` the others (a LoRA model's frozen
    base among them). ``dropout_key`` turns on the LoRA adapters' dropout, a key per
    micro-batch folded from it.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> from jaxckpt import nn, remat, train
        >>> model = nn.Transformer(nn.TransformerConfig.preset("tiny", n_layers=1), rngs=nnx.Rngs(0))
        >>> graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        >>> batch = jnp.zeros((2, 1, 9), jnp.int32)  # 2 micro-batches of 1 x 8 tokens
        >>> loss, grads = train.loss_and_grads(graphdef, params, rest, batch, remat.get("full"))
        >>> jax.tree.structure(grads) == jax.tree.structure(params)
        True
    """

    if is_packed(batch):
        # The step's loss is the mean over every weighted target of every micro-batch.
        total = jnp.maximum(jnp.sum(batch.weights.astype(jnp.float32)), 1.0)

        def one(params, micro, key):
            return weighted_loss_sum(nnx.merge(graphdef, params, rest), micro, spec, key) / total

        m, scale = batch.inputs.shape[0], 1
    else:

        def one(params, tokens, key):
            return next_token_loss(nnx.merge(graphdef, params, rest), tokens, spec, key)

        m = scale = batch.shape[0]
    grad_fn = jax.value_and_grad(one)

    def key_of(i):
        return None if dropout_key is None else jax.random.fold_in(dropout_key, i)

    if m == 1:
        return grad_fn(params, jax.tree.map(lambda a: a[0], batch), key_of(0))

    def accumulate(carry, micro_and_index):
        micro, i = micro_and_index
        loss, grads = grad_fn(params, micro, key_of(i))
        return jax.tree.map(jnp.add, carry, (loss, grads)), None

    zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
    (loss, grads), _ = jax.lax.scan(accumulate, zeros, (batch, jnp.arange(m)))
    if scale == 1:
        return loss, grads
    return loss / scale, jax.tree.map(lambda g: g / scale, grads)


def _dropout_key(model, optimizer, seed: int) -> "jax.Array | None":
    """The step's key for the LoRA adapters' dropout (the seed folded with the step count),
    or None when the model has no dropout."""
    lora = model.config.lora
    if lora is None or lora.dropout == 0:
        return None
    return jax.random.fold_in(jax.random.key(seed), optimizer.step[...])


def _train_step(
    graphdef: nnx.GraphDef, state: nnx.State, batch: jax.Array, *, spec: RematSpec, mesh=None, seed: int = 0
):
    model, optimizer = nnx.merge(graphdef, state)
    model_def, params, rest = nnx.split(model, trainable(model.config), ...)
    key = _dropout_key(model, optimizer, seed)
    if mesh is None:
        loss, grads = loss_and_grads(model_def, params, rest, batch, spec, key)
    else:  # activations split over the batch, as the tokens are
        with activation_sharding(mesh, ACTIVATION_RULES):
            loss, grads = loss_and_grads(model_def, params, rest, batch, spec, key)
    with jax.numpy_dtype_promotion("standard"):  # optax mixes float and int32 (decay**count)
        optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss


def jit_train_step(graphdef: nnx.GraphDef, spec: RematSpec, shardings=None, mesh=None, seed: int = 0):
    """The jitted step ``(state, batch [M, B, T + 1]) -> (state, loss)`` with ``state``
    donated; ``state`` is ``nnx.split((model, nnx.Optimizer))[1]``, real or abstract.

    With a ``mesh``, ``shardings`` (the state's, from ``state_shardings``) pin the
    state in and out, and the batch is split over the mesh (data parallel + FSDP).

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
    step = functools.partial(_train_step, graphdef, spec=spec, mesh=mesh, seed=seed)
    if mesh is None:
        return jax.jit(step, donate_argnums=0)
    return jax.jit(
        step,
        donate_argnums=0,
        in_shardings=(shardings, batch_sharding(mesh)),
        out_shardings=(shardings, replicated(mesh)),
    )


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
        optimizer: AdamW settings.
        remat: overrides ``model.config.remat``.
        mesh: a ``jax.sharding.Mesh`` with axes ``data`` and ``fsdp`` (``make_mesh``):
            parameters, gradients and optimizer state are split over ``fsdp``, batches
            over both. None: one device. In a multi-process run (``train.initialize``) the
            mesh spans every process's devices, and every process must build the same
            model and pass the same global batches; each places only its own shards.
        seed: the LoRA adapters' dropout draws from it (with the step count).

    A model with LoRA adapters (``config.lora``) trains them alone: the optimizer is over
    ``nnx.LoRAParam`` (``nn.trainable``), and the base gets no gradient and no state.

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
        remat=None,
        mesh=None,
        seed: int = 0,
    ):
        self.config = model.config
        self.spec = get_remat(model.config.remat if remat is None else remat)
        tx = (optimizer or OptimizerConfig()).transformation()
        opt = nnx.Optimizer(model, tx, wrt=trainable(model.config))
        self.graphdef, self.state = nnx.split((model, opt))
        self.mesh, shardings = mesh, None
        if mesh is not None:
            shardings = state_shardings(self.state, mesh)
            self.state = put_global(self.state, shardings)
        self._step = jit_train_step(self.graphdef, self.spec, shardings, mesh, seed)
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
            rows = jax.tree.leaves(abstract)[0].shape[1]
            if self.mesh is not None and rows % self.mesh.size:
                raise ValueError(
                    f"batch={rows} must be a multiple of the mesh's {self.mesh.size} devices "
                    f"({dict(self.mesh.shape)}): each device takes an equal share of the batch"
                )
            self._compiled[key] = self._step.lower(self.state, abstract).compile()
        return self._compiled[key]

    @property
    def model(self) -> nnx.Module:
        """The current model (a view of the trainer's state)."""
        return nnx.merge(self.graphdef, self.state)[0]

    @property
    def step_count(self) -> int:
        """How many updates the optimizer has applied."""
        return int(nnx.merge(self.graphdef, self.state)[1].step[...])
