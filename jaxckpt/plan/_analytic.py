"""The analytic memory model: a train step's bytes from shapes alone, no compile.

``predict`` splits a step into the train state (params, optimizer state), the
gradients and the activations. The activations are

    n_layers x stored(spec) + max(layer working set, head working set)

where ``stored`` is what one layer keeps for its backward pass (``LayerGraph.kept``;
one layer input per segment when ``layers_per_checkpoint > 1``)
and the layer working set is the backward pass of one layer: its recomputed
residuals, its weight-gradient slice and the cotangents in flight. With AdamW the
update needs a params-sized buffer after the backward pass, so the activation term
is at least that (the buffers are reused). ``korthikanti_bytes`` is the published
baseline the model is checked against.

Over ``devices`` (FSDP, ``jaxckpt train --mesh fsdp=D``) each device holds its
shards of the state and of the update and runs ``batch / D`` sequences; the output
head's gathered weights and their gradient are added to the head's working set (a
layer's gathered parameters add nothing measurable: see ``layer_working_set``).
"""

import dataclasses
import functools
import math

import jax
from flax import nnx

from jaxckpt._checks import require_positive_int
from jaxckpt._tags import PROJECTIONS
from jaxckpt.nn import TransformerConfig
from jaxckpt.plan._layer_graph import LayerGraph, layer_graph
from jaxckpt.plan._measure import OPTIMIZERS, abstract_train_state, tree_bytes
from jaxckpt.plan._sharded import local_batch, sharded_bytes
from jaxckpt.remat import RematSpec
from jaxckpt.remat import get as get_remat


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Predicted bytes of one train step (the same split as ``MemoryReport``)."""

    params: int
    grads: int
    optimizer: int
    activations: int
    inputs: int

    @property
    def total(self) -> int:
        """Params + gradients + optimizer state + activations + the token batch."""
        return self.params + self.grads + self.optimizer + self.activations + self.inputs

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "total": self.total}


def saved_tags(spec: RematSpec) -> frozenset:
    """The tags a per-layer spec keeps on device or host (``save_dots`` adds the projections)."""
    return spec.save | spec.offload | (PROJECTIONS if spec.save_dots else frozenset())


@functools.lru_cache(maxsize=64)
def state_bytes(config: TransformerConfig, optimizer: str = "adamw", devices: int = 1) -> tuple[int, int]:
    """``(params, optimizer state)`` bytes on one of ``devices`` FSDP devices, from the
    abstract model (nothing allocated)."""
    model, opt = abstract_train_state(config, optimizer)
    return sharded_bytes(nnx.state(model, nnx.Param), devices), sharded_bytes(nnx.state(opt), devices)


@functools.lru_cache(maxsize=64)
def update_workspace(config: TransformerConfig, optimizer: str = "adamw", devices: int = 1) -> int:
    """Bytes the optimizer update needs after the backward pass (the activations' buffers are free).

    AdamW's update is one params-sized tree (on ``devices``: one device's shards);
    Adafactor's factored update goes one parameter at a time (the largest one); SGD
    updates in place.
    """
    if optimizer == "sgd":
        return 0
    model, _ = abstract_train_state(config, optimizer)
    params = nnx.state(model, nnx.Param)
    if optimizer == "adafactor":
        return max(tree_bytes(leaf) for leaf in jax.tree.leaves(params))
    return sharded_bytes(params, devices)


def layer_working_set(config: TransformerConfig, batch: int, seq: int) -> int:
    """Bytes in flight while one layer runs its backward pass under full remat.

    Its recomputed residuals, its weight-gradient slice, two cotangents of width F
    and two of width D, and one attention tile; ``batch`` is one device's. Under FSDP
    nothing is added for the layer's gathered parameters: with it the prediction was
    one layer's parameters over XLA's peak (small, 8 devices); without it, ``tiny``
    and ``small`` over 2-8 devices are within 6% of XLA.
    """
    graph = layer_graph(config, batch, seq)
    n, e = batch * seq, config.compute_dtype.itemsize
    cotangents = 2 * n * (config.ffn_dim + config.d_model) * e
    return graph.working_residual_bytes() + layer_param_bytes(config) + cotangents + graph.attention_tile


def layer_param_bytes(config: TransformerConfig) -> int:
    """Bytes of one layer's parameters (the embeddings and head left out)."""
    params, _ = state_bytes(config, "sgd")
    embed = config.vocab_size * config.d_model * config.storage_dtype.itemsize
    return (params - embed * (1 if config.tie_embeddings else 2)) // config.n_layers


def head_working_set(config: TransformerConfig, batch: int, seq: int, devices: int = 1) -> int:
    """The output head: logits in the compute dtype, their fp32 copy and its gradient;
    over ``devices``, also the head's weights gathered whole and their full gradient."""
    n = batch * seq
    gathered = 2 * config.vocab_size * config.d_model * config.storage_dtype.itemsize if devices > 1 else 0
    return n * config.vocab_size * (config.compute_dtype.itemsize + 8) + gathered


def predict(
    config: TransformerConfig,
    batch: int,
    seq: int,
    remat: "str | RematSpec",
    *,
    optimizer: str = "adamw",
    micro_batches: int = 1,
    devices: int = 1,
) -> Prediction:
    """Predicts a train step's memory from shapes (no compile; ``measure`` is the check).

    Args:
        config: the model. batch, seq: one micro-batch ``[B, T]`` (B over all devices).
        remat: a preset name or ``RematSpec``.
        optimizer: a key of ``jaxckpt.plan.OPTIMIZERS``.
        micro_batches: gradient accumulation steps (adds one gradient accumulator).
        devices: FSDP devices; the figures are one device's (``B`` must divide evenly).

    Example:
        >>> from jaxckpt import nn, plan
        >>> cfg = nn.TransformerConfig.preset("tiny")
        >>> plan.predict(cfg, 2, 256, "none").activations > plan.predict(cfg, 2, 256, "full").activations
        True
    """
    for name, value in (("batch", batch), ("seq", seq), ("micro_batches", micro_batches)):
        require_positive_int(name, value, "predict: ")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; valid: {', '.join(OPTIMIZERS)}")
    spec = get_remat(remat)
    batch = local_batch(batch, devices)
    params, opt = state_bytes(config, optimizer, devices)
    graph = layer_graph(config, batch, seq)
    stored = stored_bytes(graph, spec, config.n_layers)
    layer = layer_working_set(config, batch, seq)
    if spec.enabled:  # what a layer keeps is not recomputed, so not held twice
        layer -= graph.stored_bytes(saved_tags(spec) - spec.offload) - graph.values["x"].nbytes
        if config.n_layers > spec.layers_per_checkpoint > 1:
            # a segment's backward pass slices k layers' parameters and their gradients
            # out of the stacks (measured: XLA copies both)
            layer += 2 * spec.layers_per_checkpoint * layer_param_bytes(config) // devices
    working = max(layer, head_working_set(config, batch, seq, devices))
    activations = stored + working
    grads = params * (2 if micro_batches > 1 else 1)
    return Prediction(
        params=params,
        grads=grads,
        optimizer=opt,
        activations=max(activations, update_workspace(config, optimizer, devices)),
        inputs=micro_batches * batch * (seq + 1) * 4,
    )


def stored_bytes(graph: LayerGraph, spec: RematSpec, n_layers: int) -> int:
    """Bytes the layers keep on the device from the forward pass for the backward pass."""
    if not spec.enabled:
        return n_layers * graph.residual_bytes()
    k = min(spec.layers_per_checkpoint, n_layers)
    x = graph.values["x"].nbytes
    kept = graph.stored_bytes(saved_tags(spec) - spec.offload) - x  # offloaded tags live on the host
    # a segment of k layers keeps its input; its backward pass holds its k layer inputs
    boundaries = math.ceil(n_layers / k) + (k if k > 1 else 0)
    return n_layers * kept + x * boundaries


def korthikanti_bytes(config: TransformerConfig, batch: int, seq: int, *, flash: bool) -> int:
    """Per-layer activation bytes of Korthikanti et al. 2022 (Eq. 1), in 16-bit units.

    ``s b h (34 + 5 a s / h)`` bytes for a GPT layer with dropout and 16-bit activations;
    flash attention keeps no ``a s^2`` term, leaving ``34 s b h``.

    Example:
        >>> from jaxckpt import nn
        >>> cfg = nn.TransformerConfig.preset("gpt2")
        >>> korthikanti_bytes(cfg, 1, 1024, flash=True) == 1024 * 768 * 34
        True
    """
    s, b, h, a = seq, batch, config.d_model, config.n_heads
    return s * b * h * 34 + (0 if flash else 5 * a * s * s * b)
