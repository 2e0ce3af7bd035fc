"""npu_backend: Ascend NPU attention through ``torch_npu.npu_fusion_attention``.

Will hold (issue 6): ``is_available()`` / ``info()`` probes that never import
torch_npu unguarded, ``fusion_attention`` with a custom VJP over
``npu_fusion_attention_grad``, a CPU reference of the op contract, and the
registration of ``implementation="npu"`` in ``jaxckpt.attention``.
"""

__all__: list[str] = []
