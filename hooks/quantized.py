"""Weights kept quantized (ComfyUI-GGUF's GGUF models): their shape and their values, for the engine.

ComfyUI-GGUF loads a GGUF file's quantized tensors as ``GGMLTensor``: a torch.Tensor subclass whose
storage is the raw GGML blocks (integer dtype, a byte shape), whose ``shape`` property gives the
logical shape, and whose ``tensor_type`` names the GGML type. Its layers (``GGMLLayer``, subclasses
of torch's Linear/Conv2d/...) dequantize the weight in every forward with ``get_weight(tensor,
dtype)``, which also adds the LoRA patches that LoraLoader attached to the tensor (``patches``):
LoRAs are applied at dequantize time, in the compute dtype, never rounded back into the blocks.

What that means for the engine (data flow)::

    hook patches -> plan: shapes from ``weight.shape`` (the logical shape), never from the storage
    LoRA/LoCon   -> forward deltas on the layer's output: no weight needed, so nothing to dequantize
    dense deltas (model-as-LoRA, LoHa, LoKr, DoRA) -> ``plain_weight``: the weight as the layer
        computes with it, by the layer's own ``get_weight`` on a patch-free alias of the same blocks
        (the unpatched weight, as core takes a model-as-LoRA's base), in float32
    rounding "loraloader" -> quantized weights take the compute path: ComfyUI-GGUF's LoraLoader adds
        the LoRA in the compute dtype too, so that is already LoraLoader's weight

Nothing here imports ComfyUI-GGUF: the tensor and layer are used through the attributes above.
"""

from __future__ import annotations

import torch

__all__ = ["QuantizedWeightError", "is_stored_quantized", "plain_weight"]


class QuantizedWeightError(TypeError):
    """A weight stored in a quantized form the engine cannot read back."""


def is_stored_quantized(tensor: torch.Tensor) -> bool:
    """True for a weight kept as quantized blocks (integer storage behind a float layer), such as a
    GGUF Q8_0 or Q4_K tensor; False for float weights, fp8 included, and GGUF's F16/F32 tensors."""
    return isinstance(tensor, torch.Tensor) and not tensor.is_floating_point() and not tensor.is_complex()


def plain_weight(module: torch.nn.Module, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` (a weight or bias of ``module``) as float32 values on ``device``, without any LoRA patch.

    A float tensor is returned cast (a GGUF F16/F32 tensor as a plain torch.Tensor); a quantized one is
    dequantized by ``module`` itself (ComfyUI-GGUF's ``get_weight``), exactly as its forward does, from an
    alias of the same blocks that carries no patches.
    """
    if not is_stored_quantized(tensor):
        if hasattr(tensor, "tensor_type"):  # a GGUF F16/F32 tensor: its clone() returns itself
            tensor = tensor.as_subclass(torch.Tensor)
        return tensor.to(device, torch.float32)
    get_weight = getattr(module, "get_weight", None)
    kind = getattr(tensor, "tensor_type", None)
    if get_weight is None or kind is None:
        raise QuantizedWeightError(
            f"a {type(module).__name__} layer keeps its weight as {tensor.dtype} blocks "
            f"({type(tensor).__name__}) without ComfyUI-GGUF's get_weight: the hook engine cannot "
            "dequantize it for this hook (a model-as-LoRA, LoHa, LoKr or DoRA hook); ComfyUI's own hook path "
            "cannot run on quantized weights either. Load it with LoraLoader, or use a LoRA/LoCon hook.")
    bare = type(tensor)(tensor.as_subclass(torch.Tensor), tensor_type=kind, tensor_shape=tensor.shape,
                        patches=[])
    return get_weight(bare.to(device), torch.float32).to(torch.float32)
