"""Boundary offload (``offload_full``): the remat boundary lives in host memory between the
forward and the backward pass.

On CPU the numbers are checked bit for bit against the spec that keeps the boundary on the
device, and ``describe`` and the planner against the layer inputs' bytes. The compiled
memory is XLA:GPU's and XLA:TPU's, deviceless (nothing ran on a chip): the step the
planner compiles (``compile_report``, the default GEMM emitters), at two depths, so that
what grows with ``n_layers`` shows. Those compiles are not kept in the persistent cache,
and each takes seconds: they are ``slow`` besides ``gpu_compile`` / ``tpu_compile``, and
each is compiled once per process (``compile_report`` is cached).
"""

import functools

import jax
import jax.numpy as jnp
import pytest
import remat_cases as rc

from jaxckpt import nn, plan, remat
from jaxckpt.plan._compile import compile_report
from jaxckpt.remat import PRESETS, RematSpec, Tag

SEGMENTS_OF_2 = RematSpec(offload={Tag.LAYER_INPUT}, layers_per_checkpoint=2)
"""``ratio_0.5`` with its boundaries offloaded: on ``rc.CONFIG``'s 5 layers, segments of 2 + 2 + 1."""
LAYER_INPUT = rc.B * rc.T * rc.CONFIG.d_model * 4  # fp32


def _needs_pinned_host():
    if not remat.has_pinned_host():
        pytest.skip(f"no pinned_host memory on {jax.devices()[0].platform}")


@functools.cache
def _loss_and_grads(spec: "str | RematSpec"):
    return rc.loss_and_grads(rc.model(), remat.get(spec), rc.tokens())


def test_the_presets_are_full_and_save_attn_with_the_boundary_offloaded():
    assert PRESETS["offload_full"] == RematSpec(offload={Tag.LAYER_INPUT})
    composed = PRESETS["offload_full_save_attn"]
    assert composed.save == PRESETS["save_attn"].save and composed.offload == {Tag.LAYER_INPUT}
    assert composed.offloads_boundary and not PRESETS["full"].offloads_boundary
    assert not RematSpec(enabled=False, offload={Tag.LAYER_INPUT}).offloads_boundary
    names = list(PRESETS)  # beside the other offload presets, after what they offload from
    assert names.index("minimal") < names.index("offload_full") < names.index("offload_qkv")


@pytest.mark.slow  # 2.6-4.1 s each, warm: two train-step programs
@pytest.mark.parametrize(
    "offloaded, kept",
    [("offload_full", "full"), (SEGMENTS_OF_2, "ratio_0.5"), ("offload_full_save_attn", "save_attn")],
    ids=["full", "segments_of_2", "save_attn"],
)
def test_offloading_the_boundary_gives_bit_equal_losses_and_gradients(offloaded, kept):
    _needs_pinned_host()
    loss, grads = _loss_and_grads(offloaded)
    loss0, grads0 = _loss_and_grads(kept)
    assert jnp.array_equal(loss, loss0)
    pairs = zip(jax.tree.leaves(grads), jax.tree.leaves(grads0), strict=True)
    assert all(jnp.array_equal(g, g0) for g, g0 in pairs)


def test_describe_shows_the_boundaries_on_the_host_with_their_bytes():
    report = remat.describe(rc.model(), (rc.B, rc.T), "offload_full")
    n = rc.CONFIG.n_layers
    assert [(r.tag, r.where, r.count, r.nbytes) for r in report.residuals] == [
        (Tag.LAYER_INPUT, "host", n, LAYER_INPUT)
    ]
    assert report.total_bytes("host") == n * LAYER_INPUT and report.total_bytes("device") == 0
    assert f"total on host:   {n * LAYER_INPUT / 2**20:.3f} MiB" in str(report)
    # segments of 2: one boundary a segment, the segment's input (not each layer's)
    segments = remat.describe(rc.model(), (rc.B, rc.T), SEGMENTS_OF_2)
    assert [(r.tag, r.where, r.count) for r in segments.residuals] == [
        (Tag.LAYER_INPUT, "host", 2),
        (Tag.LAYER_INPUT, "host", 1),
    ]
    # composed: save_attn's residuals stay on the device, the boundaries leave it
    kept = remat.describe(rc.model(), (rc.B, rc.T), "save_attn")
    both = remat.describe(rc.model(), (rc.B, rc.T), "offload_full_save_attn")
    assert both.total_bytes("host") == n * LAYER_INPUT
    assert both.total_bytes("device") == kept.total_bytes("device") - n * LAYER_INPUT > 0


PLANNED = nn.TransformerConfig.preset(
    "tiny", d_model=48, n_heads=3, n_kv_heads=1, head_dim=16, ffn_dim=80, n_layers=7, vocab_size=97
)


@pytest.mark.parametrize("target", [None, "h100-80g"])
def test_the_planner_moves_the_boundaries_to_the_host_and_prices_their_traffic(target):
    w = plan.Workload(PLANNED, batch=3, seq=41)
    n, x = PLANNED.n_layers, plan.layer_graph(w, target=target).values["x"].nbytes
    assert x == 3 * 41 * 48 * 4
    full, off = (plan.choice(w, name, target=target) for name in ("full", "offload_full"))
    assert off.predicted.host == off.predicted.host_activations == n * x and full.predicted.host == 0
    assert full.predicted.total - off.predicted.total == n * x  # the device holds none of them
    assert off.recompute_flops == full.recompute_flops
    assert off.transfer_bytes == 2 * n * x  # each boundary goes out and comes back once a step
    h100, step = plan.DEVICES["h100-80g"], plan.step_flops(w)
    link = off.step_seconds(h100, step) - full.step_seconds(h100, step)
    assert link == pytest.approx(2 * n * x / h100.host_bandwidth)
    row = plan.PresetRow("offload_full", off, True, 0.0).to_dict()
    assert row["host_bytes"] == n * x and row["total_bytes"] == off.predicted.total
    # composed with save_attn: its device bytes less the boundaries
    attn, both = (plan.predict(w, name, target=target) for name in ("save_attn", "offload_full_save_attn"))
    assert attn.total - both.total == n * x and both.host == n * x
    # micro-batches: one micro-batch's boundaries on the host at a time, each crossing the link
    micro = plan.choice(w.replace(micro_batches=2), "offload_full", target=target)  # [M, B, T + 1]
    assert micro.predicted.host == n * x and micro.transfer_bytes == 2 * 2 * n * x


def test_the_planner_offloads_one_boundary_a_scanned_segment():
    w = plan.Workload(PLANNED, batch=3, seq=41)  # 7 layers in segments of 2: 3 scanned + 1
    x = plan.layer_graph(w).values["x"].nbytes
    ratio, off = plan.predict(w, "ratio_0.5"), plan.predict(w, SEGMENTS_OF_2)
    assert off.host == 3 * x and ratio.total - off.total == 3 * x
    assert plan.choice(w, SEGMENTS_OF_2).transfer_bytes == 2 * 3 * x
    assert plan.choice(w, SEGMENTS_OF_2).recompute_flops == plan.choice(w, "ratio_0.5").recompute_flops


def test_the_solver_offloads_the_boundaries_only_below_full_remat_and_when_allowed():
    w = plan.Workload(PLANNED, batch=3, seq=41)
    full = plan.predict(w, "full").total
    fast_link = plan.DevicePreset("fast-link", 2**40, flops=1e9, host_bandwidth=1e12)
    assert plan.solve(w, full - 1) is None  # no offload: nothing fits below full remat
    below = plan.solve(w, full - 1, offload=True, device=fast_link)
    assert below.offloads_boundary and plan.predict(w, below).total <= full - 1
    assert plan.solve(w, full - 1, offload=True, device=fast_link, tags=[Tag.MLP_ACT]) is None
    # above full remat the boundaries stay: their traffic buys nothing there on an H100
    assert not plan.solve(w, full, offload=True, device=plan.DEVICES["h100-80g"]).offloads_boundary


BF16 = {"dtype": "bfloat16", "param_dtype": "bfloat16"}
COMPILED = nn.TransformerConfig.preset(
    "tiny", d_model=64, n_heads=2, n_kv_heads=1, head_dim=32, ffn_dim=96, vocab_size=67, max_len=1024, **BF16
)
"""Narrow and long, so that the layer inputs are a large share of the step (B=3, T=662: T is
even because cuDNN's training kernel refuses an odd length with a bias)."""
BATCH, SEQ, DEPTHS = 3, 662, (3, 9)
BOUNDARY = BATCH * SEQ * COMPILED.d_model * 2
SLACK = 16 * 2**10
"""What the compiled differences below may be off by: XLA:GPU's buffer offsets (measured 256 and
8,192 bytes), against 6 boundaries of 254,208 bytes."""


TPU_SEQ = 150
"""XLA:TPU's sequence: its claims are exact (one padded boundary a layer on the host) or hold
at any size (no growth of the HBM temp with depth), and its compile time grows with T (two
compiles at T=662: 18 s of CPU; at T=150: 9.5 s). 150 is off the 128 rows, so the padding shows."""


def _compiled(target: str, n_layers: int, name: str, seq: int = SEQ):
    workload = plan.Workload(COMPILED.replace(n_layers=n_layers), BATCH, seq)
    return compile_report(workload, remat.get(name), plan.compile_target(target))


def _grads(n_layers: int, seq: int = SEQ) -> int:
    return plan.trainable_bytes(plan.Workload(COMPILED.replace(n_layers=n_layers), BATCH, seq))


@pytest.mark.slow
@pytest.mark.gpu_compile
def test_xla_gpu_keeps_the_boundaries_in_host_memory_and_not_on_the_device():
    """XLA:GPU (h100-80g, deviceless, default GEMM emitters), B=3 T=662 d=64, 3 and 9 layers:

    | | full temp | offload_full temp | host |
    |---|---|---|---|
    | 3 layers | 6,070,184 | 7,142,824 | 762,624 (3 boundaries) |
    | 9 layers | 7,974,056 | 7,513,256 | 2,287,872 (9 boundaries) |

    ``offload_full``'s device temp grows with depth by the added layers' gradients alone,
    ``full``'s by those and the added boundaries, so the device's saving grows by one
    boundary a layer. At the same depth the saving is the boundaries less about 1 MB that
    does not depend on depth (XLA's buffer packing: at 3 layers offload_full needs more
    than full, at 9 less).
    """
    full = {n: _compiled("h100-80g", n, "full") for n in DEPTHS}
    off = {n: _compiled("h100-80g", n, "offload_full") for n in DEPTHS}
    low, high = DEPTHS
    for n in DEPTHS:
        assert off[n].host_temp == n * BOUNDARY and full[n].host_temp == 0
    added = _grads(high) - _grads(low)
    assert abs(off[high].temp - off[low].temp - added) <= SLACK  # no boundary on the device
    assert abs(full[high].temp - full[low].temp - added - (high - low) * BOUNDARY) <= SLACK
    saved = {n: full[n].peak - off[n].peak for n in DEPTHS}
    assert abs(saved[high] - saved[low] - (high - low) * BOUNDARY) <= SLACK
    assert saved[high] > 0


@pytest.mark.slow
@pytest.mark.tpu_compile
def test_xla_tpu_keeps_the_boundaries_in_host_memory():
    """XLA:TPU (tpu-v5e, deviceless), the same model at ``TPU_SEQ``, ``offload_full`` at 3 and
    9 layers: the host holds one boundary a layer in XLA:TPU's layout, T padded to 128 rows
    (``3 x 256 x 64`` bf16: 98,304 bytes for 57,600 of values; at T=662, ``3 x 768 x 64``:
    294,912 for 254,208), and the HBM temp does not grow with depth (5,084,160 bytes at 3
    layers, 5,018,112 at 9; at T=662, 5,409,792 at both). What differs from XLA:GPU: at T=662
    ``full``'s temp does not grow either (4,760,064 at both depths): its stacked boundaries
    sit in the 112 MiB VMEM scratch (``plan._compilers.VMEM_SCRATCH``), so the HBM saving only
    shows once they exceed it.
    """
    off = {n: _compiled("tpu-v5e", n, "offload_full", TPU_SEQ) for n in DEPTHS}
    padded = BATCH * (-(-TPU_SEQ // 128) * 128) * COMPILED.d_model * 2
    assert padded > BATCH * TPU_SEQ * COMPILED.d_model * 2  # the padding shows
    for n in DEPTHS:
        assert off[n].host_temp == n * padded
    low, high = DEPTHS
    assert off[high].temp - off[low].temp <= _grads(high, TPU_SEQ) - _grads(low, TPU_SEQ)
