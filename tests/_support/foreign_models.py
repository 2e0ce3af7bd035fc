"""Four training steps written as a user of JAX would write them, not for jaxckpt's planner.

Each is tiny and oddly sized (every figure compiles in about a second on XLA:CPU) and is a
``ForeignModel``: a train step (loss, gradients, an optax update) built for a
``jax.checkpoint`` policy, its abstract arguments (``jax.ShapeDtypeStruct`` pytrees from
``jax.eval_shape``: nothing is allocated), and its repeated block, with the block's abstract
arguments and how many times the step runs it:

* ``vit``: an NNX ViT: patch embedding, encoder blocks stacked with ``nnx.vmap`` and run by
  ``nnx.scan`` under ``nnx.remat``, attention by ``jaxckpt.flash_attention``; its values
  tagged with ``checkpoint_name`` (``qkv``, ``attn_proj``, ``mlp_hidden``, ``mlp_act``) and by
  the kernel (``attn_out``, ``attn_lse``). Adam.
* ``convnet``: an NNX ConvNet with no attention and no tags: a stem convolution, residual
  blocks (conv, group norm, ReLU, conv) in a Python loop of ``nnx.remat``, a pooled head. SGD
  with momentum.
* ``linen_mixer``: a Linen MLP-Mixer (token and channel MLPs) under ``nn.scan(nn.remat(...))``,
  made an NNX module by ``nnx.bridge.ToNNX``; untagged. AdamW.
* ``plain_mlp``: pytrees of arrays, no Flax: a residual MLP block (layer norm, dense, GELU,
  dense) under ``jax.checkpoint`` in ``jax.lax.scan``; untagged. Adam.

``model.step_fn(policy)`` is the step: ``policy=None`` runs the block without
``jax.checkpoint`` (autodiff keeps what it needs), any other value is the ``policy`` of the
``jax.checkpoint`` around each block (``jax.checkpoint_policies.nothing_saveable``: full
recompute). ``model.block(*model.block_args)`` is one block's forward pass, with its
parameters first (the NNX models': its ``nnx.State``) and its input last.
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import linen, nnx
from jax.ad_checkpoint import checkpoint_name

import jaxckpt


@dataclasses.dataclass(frozen=True)
class ForeignModel:
    """A user's train step and its repeated block (see the module).

    Attributes:
        name: the model's name (test ids).
        make_step: ``policy -> step``; ``step(*args)`` returns the new state and the loss.
        args: the step's abstract arguments: the state's pytrees, then the batch.
        block: one block's forward pass, ``block(params, x) -> y``.
        block_args: its abstract arguments.
        count: how many blocks one step runs.
        tagged: whether the model names its values with ``checkpoint_name``.
    """

    name: str
    make_step: Callable
    args: tuple
    block: Callable
    block_args: tuple
    count: int
    tagged: bool = False

    def step_fn(self, policy=None) -> Callable:
        """The train step with ``policy`` on each block (None: no ``jax.checkpoint``), traced
        under JAX's default promotion rules (a user's: the suite is stricter, and optax's
        update promotes its int32 step count)."""
        step = self.make_step(policy)

        @functools.wraps(step)
        def traced_as_users_do(*args):
            with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
                return step(*args)

        return traced_as_users_do


def _abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def _nnx_step(graphdef, tx, loss_of_model):
    """``step(params, opt_state, rest, batch)`` of an NNX model split into its parameters and
    the rest of its state (``nnx.split(model, nnx.Param, ...)``: the Linen bridge's RNG keys)."""

    def step(params, opt_state, rest, batch):
        def loss(p):
            return loss_of_model(nnx.merge(graphdef, p, rest), batch)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step


def _nnx_args(params, rest, tx, batch) -> tuple:
    return (params, _abstract(jax.eval_shape(tx.init, params)), rest, batch)


def _cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


# ---------------------------------------------------------------- an NNX ViT, tagged


class EncoderBlock(nnx.Module):
    """Pre-norm attention (``jaxckpt.flash_attention``) and GELU MLP."""

    def __init__(self, dim: int, heads: int, hidden: int, *, rngs: nnx.Rngs):
        self.heads = heads
        self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
        self.qkv = nnx.Linear(dim, 3 * dim, rngs=rngs)
        self.proj = nnx.Linear(dim, dim, rngs=rngs)
        self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
        self.fc1 = nnx.Linear(dim, hidden, rngs=rngs)
        self.fc2 = nnx.Linear(hidden, dim, rngs=rngs)

    def __call__(self, x):
        b, t, d = x.shape
        qkv = checkpoint_name(self.qkv(self.norm1(x)), "qkv")
        q, k, v = jnp.split(qkv.reshape(b, t, 3 * self.heads, d // self.heads), 3, axis=2)
        o = jaxckpt.flash_attention(q, k, v).reshape(b, t, d)
        x = x + checkpoint_name(self.proj(o), "attn_proj")
        h = checkpoint_name(self.fc1(self.norm2(x)), "mlp_hidden")
        h = checkpoint_name(jax.nn.gelu(h), "mlp_act")
        return x + self.fc2(h)


class ViT(nnx.Module):
    def __init__(self, *, image, patch, channels, dim, heads, hidden, depth, classes, rngs: nnx.Rngs):
        self.patch = patch
        self.embed = nnx.Conv(channels, dim, (patch, patch), strides=(patch, patch), rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), ((image // patch) ** 2, dim)))

        @nnx.split_rngs(splits=depth)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs):
            return EncoderBlock(dim, heads, hidden, rngs=rngs)

        self.blocks = blocks(rngs)
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, classes, rngs=rngs)
        self.policy = None

    def __call__(self, images):
        x = self.embed(images)
        x = x.reshape(x.shape[0], -1, x.shape[-1]) + self.pos[None]

        def run(block, x):
            return block(x)

        if self.policy is not None:
            run = nnx.remat(run, policy=self.policy)
        x = nnx.scan(run, in_axes=(0, nnx.Carry), out_axes=nnx.Carry)(self.blocks, x)
        return self.head(self.norm(x).mean(axis=1))


@functools.cache
def vit(batch: int = 3, image: int = 20, patch: int = 4, depth: int = 3) -> ForeignModel:
    """A ViT of ``depth`` blocks, width 40, 4 heads, MLP 88, on ``image`` x ``image`` x 3."""
    sizes = dict(image=image, patch=patch, channels=3, dim=40, heads=4, hidden=88, depth=depth, classes=7)
    model = nnx.eval_shape(lambda: ViT(**sizes, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.adam(1e-3)
    images = jax.ShapeDtypeStruct((batch, image, image, 3), jnp.float32)
    labels = jax.ShapeDtypeStruct((batch,), jnp.int32)

    def make_step(policy):
        def loss(m, batch):
            m.policy = policy
            return _cross_entropy(m(batch[0]), batch[1])

        return _nnx_step(graphdef, tx, loss)

    block = nnx.eval_shape(lambda: EncoderBlock(40, 4, 88, rngs=nnx.Rngs(0)))
    block_def, block_params = nnx.split(block)
    x = jax.ShapeDtypeStruct((batch, (image // patch) ** 2, 40), jnp.float32)

    def run_block(p, x):
        return nnx.merge(block_def, p)(x)

    args = _nnx_args(params, rest, tx, (images, labels))
    return ForeignModel("vit", make_step, args, run_block, (block_params, x), depth, tagged=True)


# ---------------------------------------------------------------- an NNX ConvNet, untagged


class ResBlock(nnx.Module):
    def __init__(self, channels: int, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(channels, channels, (3, 3), rngs=rngs)
        self.norm = nnx.GroupNorm(channels, num_groups=4, rngs=rngs)
        self.conv2 = nnx.Conv(channels, channels, (3, 3), rngs=rngs)

    def __call__(self, x):
        return x + self.conv2(jax.nn.relu(self.norm(self.conv1(x))))


class ConvNet(nnx.Module):
    def __init__(self, *, channels: int, depth: int, classes: int, rngs: nnx.Rngs):
        self.stem = nnx.Conv(3, channels, (3, 3), rngs=rngs)

        @nnx.split_rngs(splits=depth)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs):
            return ResBlock(channels, rngs=rngs)

        self.blocks = blocks(rngs)
        self.head = nnx.Linear(channels, classes, rngs=rngs)
        self.policy = None

    def __call__(self, images):
        x = jax.nn.relu(self.stem(images))
        graphdef, stacked = nnx.split(self.blocks)

        def run(x, state):
            return nnx.merge(graphdef, state)(x), None

        if self.policy is not None:
            run = jax.checkpoint(run, policy=self.policy)
        x, _ = jax.lax.scan(run, x, stacked)
        return self.head(x.mean(axis=(1, 2)))


@functools.cache
def convnet(batch: int = 3, size: int = 13, channels: int = 20, depth: int = 3) -> ForeignModel:
    """A ConvNet of ``depth`` residual blocks of ``channels`` channels on ``size`` x ``size`` x 3."""
    model = nnx.eval_shape(lambda: ConvNet(channels=channels, depth=depth, classes=5, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.sgd(1e-2, momentum=0.9)
    images = jax.ShapeDtypeStruct((batch, size, size, 3), jnp.float32)
    labels = jax.ShapeDtypeStruct((batch,), jnp.int32)

    def make_step(policy):
        def loss(m, batch):
            m.policy = policy
            return _cross_entropy(m(batch[0]), batch[1])

        return _nnx_step(graphdef, tx, loss)

    block = nnx.eval_shape(lambda: ResBlock(channels, rngs=nnx.Rngs(0)))
    block_def, block_params = nnx.split(block)
    x = jax.ShapeDtypeStruct((batch, size, size, channels), jnp.float32)

    def run_block(p, x):
        return nnx.merge(block_def, p)(x)

    args = _nnx_args(params, rest, tx, (images, labels))
    return ForeignModel("convnet", make_step, args, run_block, (block_params, x), depth)


# ---------------------------------------------------------------- a Linen MLP-Mixer through nnx.bridge


class MixerBlock(linen.Module):
    tokens_hidden: int
    channels_hidden: int

    @linen.compact
    def __call__(self, x, _=None):
        y = linen.LayerNorm()(x).swapaxes(1, 2)
        y = linen.Dense(x.shape[1])(jax.nn.gelu(linen.Dense(self.tokens_hidden)(y)))
        x = x + y.swapaxes(1, 2)
        y = linen.Dense(x.shape[2])(jax.nn.gelu(linen.Dense(self.channels_hidden)(linen.LayerNorm()(x))))
        return x + y, None


class Mixer(linen.Module):
    dim: int
    depth: int
    classes: int
    policy: Callable | None = None

    @linen.compact
    def __call__(self, x):
        x = linen.Dense(self.dim)(x)
        block = MixerBlock if self.policy is None else linen.remat(MixerBlock, policy=self.policy)
        stack = linen.scan(
            block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=self.depth,
        )
        x, _ = stack(tokens_hidden=24, channels_hidden=56, name="blocks")(x, None)
        return linen.Dense(self.classes)(linen.LayerNorm()(x).mean(axis=1))


@functools.cache
def linen_mixer(batch: int = 3, tokens: int = 17, features: int = 12, depth: int = 4) -> ForeignModel:
    """An MLP-Mixer of ``depth`` blocks, width 36, over ``tokens`` x ``features`` inputs."""
    inputs = jax.ShapeDtypeStruct((batch, tokens, features), jnp.float32)
    labels = jax.ShapeDtypeStruct((batch,), jnp.int32)

    def bridged(policy):
        module = nnx.bridge.ToNNX(Mixer(dim=36, depth=depth, classes=6, policy=policy))
        return nnx.bridge.lazy_init(module, jnp.zeros(inputs.shape, inputs.dtype), rngs=nnx.Rngs(0))

    model = nnx.eval_shape(lambda: bridged(None))
    _, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.adamw(1e-3)

    def make_step(policy):
        graphdef, _, _ = nnx.split(nnx.eval_shape(lambda: bridged(policy)), nnx.Param, ...)

        def loss(m, batch):
            return _cross_entropy(m(batch[0]), batch[1])

        return _nnx_step(graphdef, tx, loss)

    block = MixerBlock(tokens_hidden=24, channels_hidden=56)
    x = jax.ShapeDtypeStruct((batch, tokens, 36), jnp.float32)
    block_params = jax.eval_shape(block.init, jax.random.key(0), x)

    def run_block(p, x):
        return block.apply(p, x)[0]

    args = _nnx_args(params, rest, tx, (inputs, labels))
    return ForeignModel("linen_mixer", make_step, args, run_block, (block_params, x), depth)


# ---------------------------------------------------------------- a plain-function residual MLP


def _init_plain(key, features: int, dim: int, hidden: int, depth: int, classes: int):
    k = iter(jax.random.split(key, 6))

    def dense(key, shape):
        return jax.random.normal(key, shape) * shape[-2] ** -0.5

    return {
        "embed": dense(next(k), (features, dim)),
        "blocks": {
            "scale": jnp.ones((depth, dim)),
            "w1": dense(next(k), (depth, dim, hidden)),
            "b1": jnp.zeros((depth, hidden)),
            "w2": dense(next(k), (depth, hidden, dim)),
        },
        "head": dense(next(k), (dim, classes)),
    }


def plain_block(p, x):
    """A pre-norm residual MLP block: ``x + gelu(norm(x) @ w1 + b1) @ w2``."""
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    h = (x - mean) * jax.lax.rsqrt(var + 1e-6) * p["scale"][None, None]
    return x + jax.nn.gelu(h @ p["w1"] + p["b1"][None, None]) @ p["w2"]


@functools.cache
def plain_mlp(batch: int = 5, seq: int = 19, features: int = 9, depth: int = 5) -> ForeignModel:
    """A residual MLP of ``depth`` blocks, width 44, hidden 100, over ``[batch, seq, features]``."""
    dim, hidden, classes = 44, 100, 3
    params = jax.eval_shape(
        functools.partial(
            _init_plain, features=features, dim=dim, hidden=hidden, depth=depth, classes=classes
        ),
        jax.random.key(0),
    )
    tx = optax.adam(1e-3)
    inputs = jax.ShapeDtypeStruct((batch, seq, features), jnp.float32)
    targets = jax.ShapeDtypeStruct((batch, seq, classes), jnp.float32)

    def make_step(policy):
        block = plain_block if policy is None else jax.checkpoint(plain_block, policy=policy)

        def loss(p, batch):
            x, y = batch
            h = x @ p["embed"]
            h, _ = jax.lax.scan(lambda h, bp: (block(bp, h), None), h, p["blocks"])
            return ((h @ p["head"] - y) ** 2).mean()

        def step(p, opt_state, batch):
            value, grads = jax.value_and_grad(loss)(p, batch)
            updates, opt_state = tx.update(grads, opt_state, p)
            return optax.apply_updates(p, updates), opt_state, value

        return step

    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params["blocks"])
    x = jax.ShapeDtypeStruct((batch, seq, dim), jnp.float32)
    args = (params, _abstract(jax.eval_shape(tx.init, params)), (inputs, targets))
    return ForeignModel("plain_mlp", make_step, args, plain_block, (one, x), depth)


MODELS = {"vit": vit, "convnet": convnet, "linen_mixer": linen_mixer, "plain_mlp": plain_mlp}
"""Name -> the function building the model at its default sizes."""
