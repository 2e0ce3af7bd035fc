"""The temporaries a train step holds at once, beside what its layers keep: one layer's
backward pass (``layer_working_set``), the output head and its loss (``head_working_set``,
``head_branch``), and what a compiler adds whatever is saved (``compiler_extras``). The
analytic model (``predict``) and the solver's budget rows (``_milp``) take the larger of the
two branches.
"""

from jaxckpt.attention import splash_block
from jaxckpt.nn import Positions
from jaxckpt.plan._compilers import GEMM_WORKSPACE, compiled_by, on_tpu
from jaxckpt.plan._layer_costs import attention_implementation, lane_padded
from jaxckpt.plan._layer_graph import layer_graph
from jaxckpt.plan._state import layer_trainable_bytes, trainable_bytes, transposed_bytes
from jaxckpt.plan._targets import Target
from jaxckpt.plan._workload import Workload
from jaxckpt.train._loss import chunk_count


def layer_working_set(workload: Workload, *, target: "str | Target | None" = None) -> int:
    """Bytes in flight while one layer runs its backward pass under full remat.

    Its recomputed residuals, its weight-gradient slice, one cotangent of width F and
    one of width D, and one attention tile, for one device's batch. (Before the dense
    projections took their weight gradient from a materialised ``x^T``
    (``nn._dense.dense_dot_general``), XLA:CPU held two of each: every family's measured
    peak fell by one ``[n, F + D]`` pair with it, at 3,072 tokens 9.9 MiB of 130 to 870.)
    Under FSDP nothing is added for the layer's gathered parameters: with it the
    prediction was one layer's parameters over XLA's peak (small, 8 devices); without
    it, ``tiny`` and ``small`` over 2-8 devices are within 6% of XLA.

    For a GPU ``target`` the residuals are XLA:GPU's (``layer_graph(target=)``: no score
    tile under cuDNN, fewer internals held).
    """
    config = workload.config
    graph = layer_graph(workload, target=target)
    n, e = workload.local_tokens, config.compute_dtype.itemsize
    cotangents = n * (config.ffn_dim + config.d_model) * e
    weight_grads = layer_trainable_bytes(config)
    # XLA:TPU, a quantized base: the layer's weights dequantized to the compute dtype, twice
    # (the QLoRA ``llama3.1-8b`` step's live peak is 2.5 layers' dequantized weights over
    # the model without them; see the module)
    dequantized = 2 * graph.weights if on_tpu(target) and config.quantize_base is not None else 0
    working = graph.working_residual_bytes() + weight_grads + cotangents + graph.attention_tile + dequantized
    # XLA:TPU: the RoPE backward is a phase of its own, whose fp32 buffers may hold more
    return max(working, rope_backward_bytes(workload, target=target))


def rope_backward_bytes(workload: Workload, *, target: "str | Target | None" = None) -> int:
    """Bytes XLA:TPU holds while one layer runs its RoPE backward pass (0 without RoPE, or
    for another compiler): a phase of the layer's backward whose working set can exceed the
    rest of it (``layer_working_set`` takes the larger).

    ``nn.apply_rope`` rotates in float32, so its backward holds, for the queries and the keys,
    the float32 cotangent of the rotated dims and its two halves, ``[B, T, heads, rotary]``
    and ``[B, T, heads, rotary / 2]``, each with that minor dimension padded to 128 lanes
    (``lane_padded``; 4x the values' bytes for a half of 32). Beside them: the queries and
    keys as the attention kernel reads them (head_dim lane-padded: the graph's ``qr``, ``kr``),
    and four ``[B, T, D]`` activations in the compute dtype: the layer's input and the next
    one's, copied out of the stack ahead of use, the residual stream's cotangent, and the
    attention output's cotangent (``[B, T, heads x head_dim]``).

    Read off the buffer assignment of the bf16 ``small`` step (B=8, T=1024, 8 heads of 64,
    ``full``, v5e, libtpu 0.0.42.1) at its live peak, in HBM and VMEM (``fusion.382``, the
    split of a cotangent into its halves): ``f32[8,1024,8,64]{3,1,2,0:T(8,128)}`` once,
    ``f32[8,1024,8,32]{3,1,2,0:T(8,128)}`` four times and one of them copied in four batch
    slices ``f32[2,1024,8,32]``, 192 MiB for 48 MiB of values (three buffers of 32 MiB per
    rotated tensor); ``bf16[8,8,1024,64]`` twice (16 MiB each); ``bf16[8,1024,512]`` twice and
    ``bf16[1,8,1024,512]`` twice: 256 MiB of the peak's 369.1 (the rest: the stacked layer
    inputs and the gradients). Outside the RoPE buffers' lifetimes the step peaks at 301.6
    MiB (``fusion.378``, the MLP's backward), and the model's sum over the rest of the
    layer's backward is 217.8 MiB.

    Example:
        >>> from jaxckpt import nn, plan
        >>> cfg = nn.TransformerConfig.preset("small", dtype="bfloat16", param_dtype="bfloat16")
        >>> w = plan.Workload(cfg, 8, 1024)
        >>> rope_backward_bytes(w, target="tpu-v5e") // 2**20, rope_backward_bytes(w, target="h100-80g")
        (256, 0)
    """
    config = workload.config
    roped = config.positions == Positions.ROPE and any(kind.rope for kind in config.layer_kinds)
    if not on_tpu(target) or not roped:
        return 0
    graph = layer_graph(workload, target=target)
    n, e, rotary = workload.local_tokens, config.compute_dtype.itemsize, config.rotary_dim
    heads = config.n_heads + config.n_kv_heads
    fp32 = n * heads * (lane_padded(rotary) + 2 * lane_padded(rotary // 2)) * 4
    operands = graph.values["qr"].nbytes + graph.values["kr"].nbytes
    activations = n * (3 * config.d_model + config.n_heads * config.head_dim) * e
    return fp32 + operands + activations


def head_chunks(workload: Workload) -> int:
    """Chunks along T the step's loss cuts the head into (``train._loss.chunk_count``: 1 while
    a micro-batch's fp32 logits ``[B, T, V]`` fit ``CHUNK_LOGITS_BYTES``, 64 MiB).

    Example:
        >>> from jaxckpt import nn, plan
        >>> cfg = nn.TransformerConfig.preset("llama3.2-1b")
        >>> head_chunks(plan.Workload(cfg, 4, 2048)), head_chunks(plan.Workload(cfg, 1, 64))
        (64, 1)
    """
    return chunk_count(workload.batch, workload.seq, workload.config.vocab_size)


def head_working_set(workload: Workload, *, target: "str | Target | None" = None) -> int:
    """The output head: the fp32 logits the loss reads and their gradient, ``[B, T, V]``
    each; in a 16-bit compute dtype also the logits and their gradient in it. A logit soft
    cap (``config.logits_softcap``) adds the capped logits and their gradient in fp32
    (measured on XLA:CPU: 14.6 bytes per logit for 16 predicted); in 16 bits XLA fuses
    the cap into the conversion and it adds nothing (11.6 bytes measured, 12 predicted,
    with or without it). Over several devices, also the head's weights gathered whole
    and their full gradient.

    XLA:GPU (a GPU ``target``) fuses the log-softmax into the reductions that read the
    logits: of the four buffers it keeps the fp32 gradient and one 16-bit buffer, the
    logits and then (in the same place) their gradient cast to the compute dtype:
    ``4 + e`` bytes a logit (8 in fp32), 6 in 16 bits (measured on ``gpt2`` at 8,192
    tokens: ``f32[8,1024,50257]`` and ``bf16[8192,50257]`` at the peak, nothing else of
    that size). XLA:TPU does the same for a trained head; under LoRA (a frozen head) it
    held two fp32 buffers, the logits and a flattened copy the loss reads, 8 bytes a logit
    (QLoRA ``llama3.1-8b`` at B=1, T=8192 before the loss was chunked: ``f32[1,8192,128256]``
    and ``f32[1050673152]{0:T(1024)}``, 4,008 MiB each).

    The chunked loss (``head_chunks`` > 1, ``train._loss.chunked_loss_sum``) holds those
    per-logit bytes for one chunk of ``ceil(T / chunks)`` positions, beside what it keeps
    from every chunk: the gradient towards the hidden states (``[B, T, D]`` in the compute
    dtype) and, when the head trains, the fp32 sum of its weight gradient and the chunk's
    own (two ``[V, D]`` fp32; over FSDP each device sums its shard).

    Example:
        >>> from jaxckpt import nn, plan
        >>> cfg = nn.TransformerConfig.preset("tiny")
        >>> w = plan.Workload(cfg, batch=2, seq=64)
        >>> head_working_set(w) == 2 * 64 * cfg.vocab_size * 8  # fp32: the logits and their gradient
        True
        >>> head_working_set(w.replace(config=cfg.replace(logits_softcap=30.0))) == 2 * head_working_set(w)
        True
        >>> bf16 = w.replace(config=cfg.replace(dtype="bfloat16"))
        >>> head_working_set(bf16, target="h100-80g") == 2 * 64 * cfg.vocab_size * 6
        True
    """
    config = workload.config
    gathered = 2 * config.vocab_size * config.d_model * config.storage_dtype.itemsize
    e = config.compute_dtype.itemsize
    if on_tpu(target) and config.lora is not None and config.logits_softcap is None:
        per_logit = 8  # XLA:TPU, frozen head: two fp32 buffers (see the docstring)
    elif compiled_by(target) is not None and config.logits_softcap is None:
        per_logit = 4 + e
    else:
        per_logit = 8 + (2 * e if e != 4 else 8 if config.logits_softcap is not None else 0)
    chunks = head_chunks(workload)
    if chunks == 1:
        head = workload.local_tokens * config.vocab_size * per_logit
    else:
        size = -(-workload.seq // chunks) // workload.seq_shards  # a chunk's share of T on one device
        head = workload.local_batch * size * config.vocab_size * per_logit
        head += workload.local_batch * chunks * size * config.d_model * e  # g_x, every chunk's
        if config.lora is None:  # the fp32 sum of the head's weight gradient, and the chunk's
            head += 2 * config.vocab_size * config.d_model * 4 // workload.devices
    return head + (gathered if workload.devices > 1 else 0)


def unwritten_grads(workload: Workload, *, target: "str | Target | None" = None) -> int:
    """Gradient bytes not yet allocated while the head runs its backward pass.

    XLA:CPU's peak holds every gradient with the head's working set (0 here). XLA:GPU
    allocates the layer stacks' gradients when the backward scan first writes them, after
    the head: the head's logits and the layers' gradients share addresses (``gpt2``: the
    gradient stacks lie inside the freed ``f32[B, T, V]``). Only the head's own weight
    gradient is live with it (under LoRA no gradient is: the head is frozen).

    Example:
        >>> from jaxckpt import nn, plan
        >>> w = plan.Workload(nn.TransformerConfig.preset("tiny"), batch=2, seq=64)
        >>> unwritten_grads(w), 0 < unwritten_grads(w, target="h100-80g") < plan.trainable_bytes(w)
        (0, True)
    """
    if compiled_by(target) is None:
        return 0
    config = workload.config
    head = (
        0 if config.lora is not None else config.vocab_size * config.d_model * config.storage_dtype.itemsize
    )
    return max(0, trainable_bytes(workload, target=target) - head // workload.devices)


def head_branch(workload: Workload, *, target: "str | Target | None" = None) -> int:
    """The head's side of the activation model's ``max``: its working set, less the gradients
    not yet written while it runs (``predict`` and the solver's budget rows)."""
    return head_working_set(workload, target=target) - unwritten_grads(workload, target=target)


def compiler_extras(workload: Workload, *, target: "str | Target | None" = None) -> int:
    """What a GPU target's step holds beside the model's branches, whatever is saved: one
    cuBLAS workspace and FSDP's transposed shards (``transposed_bytes``); 0 on XLA:CPU and
    XLA:TPU."""
    if compiled_by(target) is None:
        return 0
    if on_tpu(target):  # XLA:TPU lays the shards out split axis major: no copies (see the module)
        return 0
    return GEMM_WORKSPACE + transposed_bytes(workload, target=target)


def kernel_hbm_scratch(workload: Workload, *, target: "str | Target | None" = None) -> int:
    """Bytes of the attention kernel's scratch that XLA:TPU holds in HBM, whatever fits VMEM.

    The Splash kernel runs once per sequence (``vmap`` over the batch), so its forward's
    running max, running sum and output accumulator, VMEM scratch of one block of queries
    inside the kernel, become the custom call's HBM outputs with a batch dimension:
    ``f32[B, block_q, 128]`` twice and ``f32[B, block_q, head_dim]`` (lane-padded). In the
    buffer assignment of ``tiny`` (B=8, T=1024, head_dim 32, ``full`` and ``full`` with int8
    layer inputs, v5e) they are the only temporaries in HBM at its peak:
    ``f32[8,512,128]`` twice and ``f32[8,512,32]{2,1,0:T(8,128)}``, 6 MiB; everything else is
    in VMEM. 0 for other kernels and compilers.

    Example:
        >>> from jaxckpt import nn, plan
        >>> cfg = nn.TransformerConfig.preset("tiny", dtype="bfloat16", param_dtype="bfloat16")
        >>> kernel_hbm_scratch(plan.Workload(cfg, 8, 1024), target="tpu-v5e") // 2**20
        6
        >>> kernel_hbm_scratch(plan.Workload(cfg, 8, 1024), target="h100-80g")
        0
    """
    config = workload.config
    if not on_tpu(target) or attention_implementation(config, target, workload.attention) != "splash":
        return 0
    block_q = splash_block(workload.seq)  # the kernel's own choice, as it runs the step
    return workload.local_batch * block_q * (2 * 128 + lane_padded(config.head_dim)) * 4
