"""The seed's experiment, ``jaxckpt compare`` (the project's main job): every attention
implementation against every remat preset on one model, with each row's compiled peak memory,
its median step time and its loss and gradients against the first row's.

Call path: ``jaxckpt compare`` (``jaxckpt.cli``) -> ``compare.compare`` -> ``jaxckpt.train``'s
``Trainer`` and ``memory_report`` for each row. It sits above ``train`` and imports nothing
above it.

"""

from jaxckpt.compare._experiment import compare

__all__ = ["compare"]
