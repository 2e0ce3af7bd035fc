"""The analytic model for XLA:GPU (``plan.predict(target=)``) against XLA:GPU's own figures.

Every test is marked ``gpu_compile``: ``measure(target=)`` needs the ``gpu-aot`` extra (the
others use the target's name, which the model alone needs, and run with it for the same
reason the model exists: to be checked against that compiler). The sizes are odd and
pairwise distinct, so a transposed axis or a wrong head count shows.
"""

import pytest

from jaxckpt import nn, plan
from jaxckpt.plan._layer_costs import attention_implementation
from jaxckpt.plan._state import transposed_bytes
from jaxckpt.plan._working_set import head_working_set, unwritten_grads

TARGET = "h100-80g"
BF16 = {"dtype": "bfloat16", "param_dtype": "bfloat16"}
CASES = {
    # GQA (3 query heads on 1), SwiGLU, RMSNorm, RoPE; cuDNN attention
    "llama-bf16": (
        nn.TransformerConfig.preset(
            "tiny",
            d_model=96,
            n_heads=3,
            n_kv_heads=1,
            head_dim=32,
            ffn_dim=200,
            vocab_size=301,
            n_layers=3,
            **BF16,
        ),
        3,
        80,
        1,
        "full",
    ),
    # fp32 compute: the blockwise kernel and its score tile on the GPU too
    "llama-fp32": (
        nn.TransformerConfig.preset(
            "tiny", d_model=80, n_heads=5, n_kv_heads=5, head_dim=16, ffn_dim=176, vocab_size=263, n_layers=2
        ),
        3,
        56,
        1,
        "none",
    ),
    # LayerNorm, GELU, tied embeddings, biases; FSDP over 2
    "gpt2-fsdp2": (
        nn.TransformerConfig.preset(
            "gpt2",
            d_model=96,
            n_heads=3,
            n_kv_heads=3,
            head_dim=32,
            ffn_dim=384,
            vocab_size=1001,
            n_layers=3,
            **BF16,
        ),
        6,
        48,
        2,
        "save_attn",
    ),
}
# the llama step with its layer inputs in host memory (boundary offload): measured (the larger
# of the two GEMM emitters) 7,909,416 bytes on the device, 7,640,036 predicted (3.4% under),
# and 138,240 on the host, the 3 boundaries, as predicted
CASES["llama-bf16-offload_full"] = (*CASES["llama-bf16"][:4], "offload_full")


@pytest.mark.gpu_compile
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_prediction_within_10_percent_of_xla_gpu(case):
    config, batch, seq, devices, preset = CASES[case]
    workload = plan.Workload(config, batch, seq, devices=devices)
    measured = plan.measure(workload, preset, target=TARGET)
    predicted = plan.predict(workload, preset, target=TARGET)
    assert measured.measured_on == f"xla-gpu:{TARGET}"
    assert abs(predicted.total / measured.peak - 1) <= 0.10, (predicted.total, measured.peak)
    assert predicted.host_activations == measured.host_temp  # offloaded residuals: none, or the boundaries


@pytest.mark.gpu_compile
def test_gpu_and_cpu_predictions_differ_by_their_mechanisms():
    config = nn.TransformerConfig.preset(
        "small", n_heads=7, n_kv_heads=7, head_dim=64, d_model=448, n_layers=3, **BF16
    )
    w = plan.Workload(config, 5, 96)
    cpu, gpu = plan.predict(w, "full"), plan.predict(w, "full", target=TARGET)
    assert (cpu.params, cpu.grads, cpu.optimizer, cpu.inputs) == (
        gpu.params,
        gpu.grads,
        gpu.optimizer,
        gpu.inputs,
    )
    # XLA:CPU widens bf16 stacks to fp32 copies; XLA:GPU has bf16 kernels
    assert plan.widened_bytes(w) > 0 and plan.widened_bytes(w, target=TARGET) == 0
    assert gpu.total < cpu.total
    # cuDNN attention on the GPU: no blockwise score tile
    assert attention_implementation(config, TARGET) == "cudnn"
    assert plan.layer_graph(w, target=TARGET).attention_tile == 0 < plan.layer_graph(w).attention_tile
    # the fused head keeps 6 bytes a bf16 logit, not 12, and the layers' gradients come after it
    logits = w.local_tokens * config.vocab_size
    assert (head_working_set(w), head_working_set(w, target=TARGET)) == (12 * logits, 6 * logits)
    assert unwritten_grads(w) == 0 < unwritten_grads(w, target=TARGET) < plan.trainable_bytes(w)
    # a recomputed norm holds its statistics alone on the GPU (fused), its fp32 input on the CPU
    held = plan.layer_graph(w).recompute_internals - plan.layer_graph(w, target=TARGET).recompute_internals
    assert held >= 2 * w.local_tokens * config.d_model * 4


@pytest.mark.gpu_compile
def test_gpu_keeps_kept_tags_in_the_working_set_and_transposes_minor_shards():
    config = nn.TransformerConfig.preset("tiny", n_layers=3, **BF16)
    w = plan.Workload(config, 4, 48, devices=2)
    # XLA:CPU's working set shrinks by what a layer keeps; XLA:GPU's slices are copies
    cpu = plan.predict(w, "minimal").activations - plan.predict(w, "full").activations
    gpu = (
        plan.predict(w, "minimal", target=TARGET).activations
        - plan.predict(w, "full", target=TARGET).activations
    )
    assert gpu > cpu > 0
    # FSDP splits gate and up along F (a layer's minor axis): XLA:GPU keeps transposed shard copies
    f = config.n_layers * config.d_model * config.ffn_dim * 2 // w.devices
    assert transposed_bytes(w) == 0 and transposed_bytes(w, target=TARGET) == 2 * f
    assert transposed_bytes(w.replace(devices=1), target=TARGET) == 0


@pytest.mark.gpu_compile
def test_unknown_target_is_refused_by_name():
    w = plan.Workload(nn.TransformerConfig.preset("tiny", n_layers=1), 1, 8)
    with pytest.raises(ValueError, match="target='h100' is not a compile target"):
        plan.predict(w, "full", target="h100")
    with pytest.raises(ValueError, match="target='h100' is not a compile target"):
        plan.choice(w, "full", target="h100")
