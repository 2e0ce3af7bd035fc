"""``by_cost``: the seed article's "smart checkpoint" rule, made precise.

The seed saves an op's output when its measured cost exceeds a fixed 10 ms. Here the
cost is per byte kept: a tag is saved when the FLOPs of recomputing it, per byte it
would occupy, exceed ``threshold``. The rule looks at one tag at a time; the planner
(``plan_memory``) weighs them together under a budget and does better
(``benchmarks/bench_planner.py``).
"""

from jaxckpt._tags import Tag
from jaxckpt.nn import TransformerConfig
from jaxckpt.plan._layer_graph import layer_graph
from jaxckpt.plan._workload import Workload
from jaxckpt.remat import RematSpec


def tag_flops_per_byte(config: TransformerConfig, seq: int) -> dict[Tag, float]:
    """For each tag of one layer: forward FLOPs of the ops producing it per byte of it.

    The ratio does not depend on the batch size (both scale with it), so it takes the
    model and the sequence length only.

    Example:
        >>> from jaxckpt import nn, plan, remat
        >>> ratios = plan.tag_flops_per_byte(nn.TransformerConfig.preset("tiny"), seq=256)
        >>> ratios[remat.Tag.Q_PROJ] > ratios[remat.Tag.NORM_OUT]  # a matmul, then a norm
        True
    """
    graph = layer_graph(Workload(config, batch=1, seq=seq))
    flops: dict[Tag, float] = {}
    nbytes: dict[Tag, int] = {}
    for op in graph.ops:
        for name in op.outputs:
            tag = graph.values[name].tag
            if tag is None or tag == Tag.LAYER_INPUT:
                continue
            flops[tag] = flops.get(tag, 0) + op.flops
            nbytes[tag] = nbytes.get(tag, 0) + graph.values[name].nbytes
    return {tag: flops[tag] / nbytes[tag] for tag in flops}


def by_cost(threshold: float, config: TransformerConfig, seq: int) -> RematSpec:
    """Saves every tag whose recompute FLOPs per byte exceed ``threshold``.

    Args:
        threshold: FLOPs per byte (>= 0). 0 saves every tag; a huge value saves none.
        config: the ``jaxckpt.nn.TransformerConfig``. seq: the sequence length
            (attention's FLOPs per byte grow with it).

    Returns:
        A per-layer ``RematSpec``.

    Raises:
        ValueError: for a threshold that is not a number >= 0.

    Example:
        >>> from jaxckpt import nn, plan
        >>> spec = plan.by_cost(50.0, nn.TransformerConfig.preset("tiny"), seq=256)
        >>> sorted(map(str, spec.save))  # matmul outputs and attention, not the cheap norms
        ['attn_lse', 'attn_out', 'k_proj', 'mlp_down', 'mlp_gate', 'mlp_up', 'out_proj', 'q_proj', 'v_proj']
    """
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not threshold >= 0:
        raise ValueError(f"by_cost: threshold={threshold!r} must be a number of FLOPs per byte >= 0")
    ratios = tag_flops_per_byte(config, seq)
    return RematSpec(save={tag for tag, ratio in ratios.items() if ratio > threshold})
