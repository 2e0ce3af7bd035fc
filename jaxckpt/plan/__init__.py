"""Memory planning: what a train step really needs, measured from XLA's compiled step.

Example:
    >>> from jaxckpt import nn, plan
    >>> report = plan.measure(nn.TransformerConfig.preset("tiny", n_layers=1), batch=1, seq=32, remat="full")
    >>> report.alias > 0  # the state is donated
    True
"""

from jaxckpt.plan._measure import CPU_CAVEAT, OPTIMIZERS, abstract_train_state, measure, tree_bytes

__all__ = ["CPU_CAVEAT", "OPTIMIZERS", "abstract_train_state", "measure", "tree_bytes"]
