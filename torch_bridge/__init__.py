"""torch_bridge: PyTorch / Hugging Face checkpoints in and out of jaxckpt.

Will hold (issue 5): ``load_hf`` / ``save_hf`` for LLaMA, GPT-2 and the seed's
block, declarative invertible conversion tables, and DLPack-based ``call_torch``
to run differentiable torch kernels from jitted JAX. torch is imported lazily.
"""

__all__: list[str] = []
