"""Where the two fused-attention ops come from: torch_npu, or the plain-torch contract
reference (``npu_backend.emulator``) that CPU tests inject in its place."""

import dataclasses
import functools
from collections.abc import Callable

from npu_backend._availability import torch_npu_module


@dataclasses.dataclass(frozen=True)
class FusionOps:
    """``npu_fusion_attention`` and ``npu_fusion_attention_grad`` with their device.

    Attributes:
        name: for messages (``"torch_npu"`` or ``"reference"``).
        forward: a function with ``torch_npu.npu_fusion_attention``'s signature.
        backward: a function with ``torch_npu.npu_fusion_attention_grad``'s signature.
        manual_seed: seeds the generator the forward draws its dropout seed from.
        device: where the tensors go before the call (``"npu"`` or ``"cpu"``).

    Example:
        >>> import npu_backend
        >>> ops = npu_backend.reference_ops()
        >>> isinstance(ops, npu_backend.FusionOps), ops.name, ops.device
        (True, 'reference', 'cpu')
    """

    name: str
    forward: Callable
    backward: Callable
    manual_seed: Callable[[int], None]
    device: str


@functools.cache
def torch_npu_ops() -> FusionOps:
    """The real CANN kernels through torch_npu.

    Raises:
        RuntimeError: with the exact reason when torch_npu cannot run here.

    Example:
        >>> import npu_backend
        >>> try:
        ...     ops = npu_backend.torch_npu_ops()
        ... except RuntimeError as err:
        ...     ops = None
        >>> ops is None or ops.device == "npu"
        True
    """
    torch_npu = torch_npu_module()
    return FusionOps(
        "torch_npu",
        torch_npu.npu_fusion_attention,
        torch_npu.npu_fusion_attention_grad,
        torch_npu.npu.manual_seed,
        "npu",
    )


@functools.cache
def reference_ops() -> FusionOps:
    """The plain-torch reference of the op contract, on the CPU (for tests and notebooks).

    Example:
        >>> reference_ops().device
        'cpu'
    """
    # Imported here, not at the top: npu_backend.emulator imports torch, and
    # `import npu_backend` (which registers the implementations) must not.
    from npu_backend import emulator as reference

    return FusionOps(
        "reference",
        reference.npu_fusion_attention,
        reference.npu_fusion_attention_grad,
        reference.manual_seed,
        "cpu",
    )
