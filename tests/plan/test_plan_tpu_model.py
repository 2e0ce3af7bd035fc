"""The analytic model for XLA:TPU (``plan.predict(target="tpu-*")``) against XLA:TPU's own figures.

The module is marked ``tpu_compile``: ``measure(target=)`` needs libtpu (the ``tpu-aot`` extra).
The sizes are odd and pairwise distinct, so a transposed axis or a wrong head count shows;
a head_dim under 128 shows XLA:TPU's lane padding. TPU compiles are not in the persistent
cache: each case is compiled once for the module (``functools.cache``).
"""

import functools

import pytest

from jaxckpt import nn, plan
from jaxckpt.plan._analytic import compiler_extras, head_working_set, on_tpu
from jaxckpt.plan._layer_costs import attention_implementation, lane_padded

pytestmark = pytest.mark.tpu_compile

TARGET = "tpu-v5e"
BF16 = {"dtype": "bfloat16", "param_dtype": "bfloat16"}
CASES = {
    # GQA (3 query heads on 1), SwiGLU, RMSNorm, RoPE, head_dim 48 (lane-padded to 128)
    "llama-bf16": (
        nn.TransformerConfig.preset(
            "tiny",
            d_model=144,
            n_heads=3,
            n_kv_heads=1,
            head_dim=48,
            ffn_dim=392,
            vocab_size=301,
            n_layers=2,
            **BF16,
        ),
        3,
        272,
        "full",
    ),
}


@functools.cache
def _measured(case: str):
    config, batch, seq, preset = CASES[case]
    workload = plan.Workload(config, batch, seq)
    return workload, preset, plan.measure(workload, preset, target=TARGET)


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="the model misses XLA:TPU here by 29% (11.98 MB predicted, 16.87 MB measured): the "
    "arguments' own lane padding (4.51 MB for 4.29 MB of state) and the part of the VMEM "
    "scratch temp_size_in_bytes counts are not modelled yet",
)
@pytest.mark.parametrize("case", list(CASES))
def test_tpu_prediction_within_10_percent_of_xla_tpu(case):
    workload, preset, measured = _measured(case)
    predicted = plan.predict(workload, preset, target=TARGET)
    assert measured.measured_on == "xla-tpu:v5e"
    assert abs(predicted.total / measured.peak - 1) <= 0.10, (predicted.total, measured.peak)


def test_tpu_terms():
    config = nn.TransformerConfig.preset(
        "tiny",
        d_model=160,
        n_heads=5,
        n_kv_heads=1,
        head_dim=32,
        ffn_dim=424,
        vocab_size=263,
        n_layers=3,
        **BF16,
    )
    w = plan.Workload(config, 3, 112)
    assert on_tpu(TARGET) and not on_tpu("h100-80g") and not on_tpu(None)
    # Splash attention on a TPU: its blocks live in VMEM, no score tile in HBM
    assert attention_implementation(config, TARGET) == "splash"
    graph, gpu = plan.layer_graph(w, target=TARGET), plan.layer_graph(w, target="h100-80g")
    assert graph.attention_tile == 0
    # head_dim 32 is minor in the kernel's operands: padded to 128 lanes, 4x
    assert lane_padded(32) == 128
    for name in ("qr", "kr", "o"):
        assert graph.values[name].nbytes == 4 * gpu.values[name].nbytes, name
    assert graph.values["v"].nbytes == gpu.values["v"].nbytes
    # no cuBLAS workspace; one device: no FSDP shard copies
    assert compiler_extras(w, target=TARGET) == 0 < compiler_extras(w, target="h100-80g")
    # the head: fp32 logits and a 16-bit buffer when trained, two fp32 buffers under LoRA
    logits = w.local_tokens * config.vocab_size
    assert head_working_set(w, target=TARGET) == 6 * logits
    lora = w.replace(config=config.replace(lora=4))
    assert (
        head_working_set(lora, target=TARGET)
        == 8 * logits
        == head_working_set(lora, target="h100-80g") + 2 * logits
    )
    # bf16 kernels: no fp32 copy of the weight stacks
    assert plan.widened_bytes(w, target=TARGET) == 0 < plan.widened_bytes(w)
