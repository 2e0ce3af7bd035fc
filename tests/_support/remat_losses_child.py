"""Training losses under several remat presets, in a process that compiles with XLA's default
fusion code generator; ``tests/torch_bridge/test_families.py`` starts it.

Usage: ``python remat_losses_child.py IN_JSON OUT_JSON``. ``IN_JSON`` holds ``{"checkpoints":
{family: save_pretrained directory}, "batch": [[[token, ...]]], "remat": {family: [preset, ...]},
"steps": N}``; ``OUT_JSON`` gets ``{family: {preset: [loss, ...]}}``.

Why a process of its own: the suite compiles with ``xla_cpu_use_fusion_emitters=false``
(``tests/conftest.py``), which is faster to compile but fuses a recomputed value differently
from a saved one, so remat changes the last bits of the gradients there. With XLA's
defaults, the ones users run, remat changes no bit, and that is the claim the test checks.
"""

import json
import sys


def main(spec: dict) -> dict:
    import numpy as np

    import torch_bridge
    from jaxckpt import train

    batch = np.asarray(spec["batch"], np.int32)
    losses = {}
    for family, path in spec["checkpoints"].items():
        losses[family] = {}
        for remat in spec["remat"][family]:
            trainer = train.Trainer(torch_bridge.load_hf(path), remat=remat)
            losses[family][remat] = [float(trainer.step(batch)) for _ in range(spec["steps"])]
    return losses


if __name__ == "__main__":
    from gc_tuning import tune_gc  # beside this file

    tune_gc()
    source, out = sys.argv[1:]
    with open(source) as f:
        result = main(json.load(f))
    with open(out, "w") as f:
        json.dump(result, f)
