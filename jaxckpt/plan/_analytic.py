"""The analytic memory model: a train step's bytes from shapes alone, no compile.

``predict`` splits a step into the train state (params, optimizer state), the
gradients and the activations. The activations are

    n_layers x stored(spec) + max(layer working set, head working set) + widened

where ``stored`` is what one layer keeps for its backward pass (``LayerGraph.kept``;
one layer input per segment when ``layers_per_checkpoint > 1``, the segments cut as
``nn.segment_sizes`` cuts them)
and the layer working set is the backward pass of one layer: its recomputed
residuals, its weight-gradient slice and the cotangents in flight. ``widened`` is
XLA:CPU's float32 copy of bfloat16 weight stacks (``widened_bytes``). The optimizer
update's own workspace (``update_workspace``: Adafactor's largest leaf) bounds the
activation term from below; a loss-scaled (float16) step adds its unscaled gradients.
``korthikanti_bytes`` is the published baseline the model is checked against.

Under LoRA (``config.lora``) the params are the frozen base (in its storage dtype, or
its quantized codes and scales) plus the adapters; the gradients and the optimizer
state are the adapters' alone, a layer's weight-gradient slice is its adapters', and
the layer graph reads a projection's input only where an adapter needs it
(``layer_graph``). Optimizer state or master weights placed in host memory are
``Prediction.host``, off the device's total.

Over ``workload.devices`` (FSDP, ``jaxckpt train --mesh fsdp=D``) each device holds its
shards of the state and of the update and runs ``batch / D`` sequences; the output
head's gathered weights and their gradient are added to the head's working set (a
layer's gathered parameters add nothing measurable: see ``layer_working_set``).
"""

import dataclasses

from jaxckpt.nn import TransformerConfig, segment_sizes
from jaxckpt.plan._layer_graph import LayerGraph, layer_graph
from jaxckpt.plan._specs import saved_tags
from jaxckpt.plan._state import (
    layer_param_bytes,
    layer_trainable_bytes,
    loss_scale_bytes,
    state_bytes,
    trainable_bytes,
    update_workspace,
    widened_bytes,
)
from jaxckpt.plan._workload import Workload, require_workload
from jaxckpt.remat import RematSpec
from jaxckpt.remat import get as get_remat


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Predicted bytes of one train step on one device (the same split as ``MemoryReport``).

    Example:
        >>> from jaxckpt import nn, plan
        >>> p = plan.predict(plan.Workload(nn.TransformerConfig.preset("tiny"), batch=2, seq=64), "full")
        >>> p.total == p.params + p.grads + p.optimizer + p.activations + p.inputs
        True
    """

    params: int
    grads: int
    optimizer: int
    activations: int
    inputs: int
    host: int = 0
    """Bytes in host memory (``pinned_host``): the optimizer state or master weights placed
    there. Not part of ``total``, the device's peak."""

    @property
    def total(self) -> int:
        """Params + gradients + optimizer state + activations + the token batch (on the device)."""
        return self.params + self.grads + self.optimizer + self.activations + self.inputs

    def to_dict(self) -> dict:
        """The fields, with ``total``."""
        return {**dataclasses.asdict(self), "total": self.total}


def layer_working_set(workload: Workload) -> int:
    """Bytes in flight while one layer runs its backward pass under full remat.

    Its recomputed residuals, its weight-gradient slice, one cotangent of width F and
    one of width D, and one attention tile, for one device's batch. (Before the dense
    projections took their weight gradient from a materialised ``x^T``
    (``nn._dense.dense_dot_general``), XLA:CPU held two of each: every family's measured
    peak fell by one ``[n, F + D]`` pair with it, at 3,072 tokens 9.9 MiB of 130 to 870.)
    Under FSDP nothing is added for the layer's gathered parameters: with it the
    prediction was one layer's parameters over XLA's peak (small, 8 devices); without
    it, ``tiny`` and ``small`` over 2-8 devices are within 6% of XLA.
    """
    config = workload.config
    graph = layer_graph(workload)
    n, e = workload.local_tokens, config.compute_dtype.itemsize
    cotangents = n * (config.ffn_dim + config.d_model) * e
    weight_grads = layer_trainable_bytes(config)
    return graph.working_residual_bytes() + weight_grads + cotangents + graph.attention_tile


def head_working_set(workload: Workload) -> int:
    """The output head: the fp32 logits the loss reads and their gradient, ``[B, T, V]``
    each; in a 16-bit compute dtype also the logits and their gradient in it. A logit soft
    cap (``config.logits_softcap``) adds the capped logits and their gradient in fp32
    (measured on XLA:CPU: 14.6 bytes per logit for 16 predicted); in 16 bits XLA fuses
    the cap into the conversion and it adds nothing (11.6 bytes measured, 12 predicted,
    with or without it). Over several devices, also the head's weights gathered whole
    and their full gradient.

    Example:
        >>> from jaxckpt import nn, plan
        >>> cfg = nn.TransformerConfig.preset("tiny")
        >>> w = plan.Workload(cfg, batch=2, seq=64)
        >>> head_working_set(w) == 2 * 64 * cfg.vocab_size * 8  # fp32: the logits and their gradient
        True
        >>> head_working_set(w.replace(config=cfg.replace(logits_softcap=30.0))) == 2 * head_working_set(w)
        True
    """
    config = workload.config
    gathered = 2 * config.vocab_size * config.d_model * config.storage_dtype.itemsize
    e = config.compute_dtype.itemsize
    per_logit = 8 + (2 * e if e != 4 else 8 if config.logits_softcap is not None else 0)
    head = workload.local_tokens * config.vocab_size * per_logit
    return head + (gathered if workload.devices > 1 else 0)


def predict(workload: Workload, remat: "str | RematSpec") -> Prediction:
    """Predicts one device's memory for a train step from shapes (no compile; ``measure`` is the check).

    Args:
        workload: the step. ``micro_batches > 1`` adds one gradient accumulator; over
            ``devices`` the figures are one device's. Under LoRA the gradients are the
            adapters'. State placed in host memory (``optimizer_placement``,
            ``master_placement``) is ``Prediction.host``, not part of the device's total;
            host master weights leave their compute-dtype copy (and its gradient) on the
            device, and the update streams leaf by leaf.
        remat: a preset name or ``RematSpec``.

    Raises:
        TypeError: when ``workload`` is not a ``Workload``.
        ValueError: for an unknown remat preset (or ``"auto"``: that is what ``plan_memory`` answers).

    Example:
        >>> from jaxckpt import nn, plan
        >>> w = plan.Workload(nn.TransformerConfig.preset("tiny"), batch=2, seq=256)
        >>> plan.predict(w, "none").activations > plan.predict(w, "full").activations
        True
    """
    require_workload(workload, "predict")
    spec = get_remat(remat)
    config = workload.config
    params, opt = state_bytes(workload)
    graph = layer_graph(workload)
    stored = stored_bytes(graph, spec, config)
    layer = layer_working_set(workload)
    if spec.enabled:  # what a layer keeps is not recomputed, so not held twice
        layer -= graph.stored_bytes(saved_tags(spec) - spec.offload) - graph.values["x"].nbytes
        k, _ = segments(config, spec)
        if config.n_layers > k > 1:
            # a segment's backward pass slices k layers' parameters and their gradients
            # out of the stacks (measured: XLA copies both)
            layer += k * (layer_param_bytes(config) + layer_trainable_bytes(config)) // workload.devices
    working = max(layer, head_working_set(workload))
    widened = widened_bytes(workload)
    if not spec.enabled:  # the stored casts are those copies
        widened = max(0, widened - config.n_layers * weight_casts(graph, config))
    grads = trainable_bytes(workload) * (2 if workload.micro_batches > 1 else 1)
    host = 0
    if workload.optimizer_placement == "host":
        host, opt = opt, 0
    if workload.master_placement == "host":  # the device holds a compute-dtype copy
        half = config.compute_dtype.itemsize
        host, params, grads = host + params, params * half // 4, grads * half // 4
    return Prediction(
        params=params,
        grads=grads,
        optimizer=opt,
        activations=max(stored + working + widened, update_workspace(workload)) + loss_scale_bytes(workload),
        inputs=workload.input_bytes,
        host=host,
    )


def segments(config: TransformerConfig, spec: RematSpec) -> tuple[int, int]:
    """``(k, count)``: the layers of one remat segment (1: every layer is its own) and the
    segments of the stack, as ``nn.segment_sizes`` cuts it (a shorter last segment when k
    does not divide ``n_layers``).

    Example:
        >>> from jaxckpt import nn, remat
        >>> cfg = nn.TransformerConfig.preset("tiny", n_layers=9)
        >>> segments(cfg, remat.get("ratio_0.25")), segments(cfg, remat.get("full")), segments(cfg, "none")
        ((4, 3), (1, 9), (1, 9))
    """
    spec = get_remat(spec)
    k, n_full = segment_sizes(spec, config.n_layers)
    return k, n_full + (config.n_layers > k * n_full)


def stored_bytes(graph: LayerGraph, spec: RematSpec, config: TransformerConfig) -> int:
    """Bytes the layers keep on the device from the forward pass for the backward pass.

    Without remat, every layer's residuals, and its weights cast to the compute dtype when
    that is not the storage dtype (the matmuls' input gradients read the cast).
    """
    n_layers = config.n_layers
    if not spec.enabled:
        return n_layers * (graph.residual_bytes() + weight_casts(graph, config))
    k, count = segments(config, spec)
    x = graph.values["x"].nbytes
    kept = graph.stored_bytes(saved_tags(spec) - spec.offload) - x  # offloaded tags live on the host
    # a segment of k layers keeps its input; its backward pass holds its k layer inputs
    boundaries = count + (k if k > 1 else 0)
    return n_layers * kept + x * boundaries


def weight_casts(graph: LayerGraph, config: TransformerConfig) -> int:
    """Bytes of one layer's weights cast to the compute dtype that autodiff keeps without
    remat: all of them when it is not the storage dtype, none for a quantized base (its
    matmul keeps the codes and dequantizes again in the backward pass).

    Example:
        >>> from jaxckpt import nn, plan
        >>> cfg = nn.TransformerConfig.preset("tiny", lora=4, param_dtype="bfloat16")
        >>> graph = plan.layer_graph(plan.Workload(cfg, 1, 8))
        >>> weight_casts(graph, cfg) == graph.weights, weight_casts(graph, cfg.replace(quantize_base="nf4"))
        (True, 0)
    """
    if config.quantize_base is not None or config.compute_dtype == config.storage_dtype:
        return 0
    return graph.weights


def korthikanti_bytes(config: TransformerConfig, batch: int, seq: int, *, flash: bool) -> int:
    """Per-layer activation bytes of Korthikanti et al. 2022 (Eq. 1), in 16-bit units.

    ``s b h (34 + 5 a s / h)`` bytes for a GPT layer with dropout and 16-bit activations;
    flash attention keeps no ``a s^2`` term, leaving ``34 s b h``. A published formula
    of its own arguments (``batch`` is the batch one device runs), not of a ``Workload``.

    Example:
        >>> from jaxckpt import nn, plan
        >>> cfg = nn.TransformerConfig.preset("gpt2")
        >>> plan.korthikanti_bytes(cfg, 1, 1024, flash=True) == 1024 * 768 * 34
        True
    """
    s, b, h, a = seq, batch, config.d_model, config.n_heads
    return s * b * h * 34 + (0 if flash else 5 * a * s * s * b)
