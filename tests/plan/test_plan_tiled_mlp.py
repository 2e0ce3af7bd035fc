"""The planner under a tiled MLP (``TransformerConfig.mlp_chunk``): a layer's backward reads and
holds one chunk's MLP intermediates, saved tags keep their whole bytes, the recompute is the
untiled one."""

from jaxckpt import nn, plan
from jaxckpt.remat import Tag

T, CHUNK, F = 512, 64, 768
CONFIG = nn.TransformerConfig.preset("tiny", n_layers=2, ffn_dim=F)
UNTILED = plan.Workload(CONFIG, batch=1, seq=T)
TILED = UNTILED.replace(config=CONFIG.replace(mlp_chunk=CHUNK))


def test_the_backward_reads_and_holds_one_chunk_of_the_mlp():
    """SwiGLU on XLA:CPU: the reads gate, up and the activation, and 3 held internals, each
    ``[rows, F]`` fp32: 6 of them fall from T rows to a chunk's."""
    untiled, tiled = plan.layer_graph(UNTILED), plan.layer_graph(TILED)
    fall = untiled.working_residual_bytes() - tiled.working_residual_bytes()
    assert fall == 6 * (T - CHUNK) * F * 4


def test_saved_tags_and_recompute_are_the_untiled_ones():
    untiled, tiled = plan.layer_graph(UNTILED), plan.layer_graph(TILED)
    for tags in (set(), {Tag.MLP_GATE, Tag.MLP_UP}, {Tag.MLP_ACT}, {Tag.ATTN_OUT, Tag.ATTN_LSE}):
        assert tiled.stored_bytes(tags) == untiled.stored_bytes(tags)
        assert tiled.recompute_flops(tags) == untiled.recompute_flops(tags)


def test_without_remat_no_mlp_intermediate_is_kept():
    untiled, tiled = plan.layer_graph(UNTILED), plan.layer_graph(TILED)
    assert untiled.residual_bytes() - tiled.residual_bytes() >= 3 * T * F * 4
