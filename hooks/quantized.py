"""Weights kept quantized (ComfyUI's fp8 / nvfp4, ComfyUI-GGUF's GGUF): their logical shapes and the values
the layer computes with, so the engine works on them without importing ComfyUI-GGUF.
"""

from __future__ import annotations

import comfy.quant_ops
import torch

__all__ = ["QuantizedWeightError", "is_stored_quantized", "kept_quantized", "plain_weight"]

# comfy.quant_ops.QuantizedTensor (0.3.75's own class, comfy-kitchen's on 0.33; a placeholder class
# there when comfy-kitchen is missing, which then matches nothing)
_QUANTIZED_TENSOR = getattr(comfy.quant_ops, "QuantizedTensor", ())


class QuantizedWeightError(TypeError):
    """A weight stored in a quantized form the engine cannot read back."""


def is_stored_quantized(tensor: torch.Tensor) -> bool:
    """True for a weight kept as quantized blocks (integer storage behind a float layer), such as a
    GGUF Q8_0 or Q4_K tensor; False for float weights, fp8 included, and GGUF's F16/F32 tensors."""
    return isinstance(tensor, torch.Tensor) and not tensor.is_floating_point() and not tensor.is_complex()


def kept_quantized(module: torch.nn.Module | None, tensor: torch.Tensor) -> bool:
    """True where ``tensor`` (a weight of ``module``) holds other values than the layer computes with:
    a ComfyUI ``QuantizedTensor``, a scaled fp8 weight (0.3.75's ``scale_weight``) or GGML blocks."""
    if isinstance(tensor, _QUANTIZED_TENSOR) or is_stored_quantized(tensor):
        return True
    return getattr(module, "scale_weight", None) is not None and tensor is getattr(module, "weight", None)


def plain_weight(module: torch.nn.Module, key: str, tensor: torch.Tensor,
                 device: torch.device) -> torch.Tensor:
    """``tensor`` (the weight or bias ``key`` of ``module``) as float32 values on ``device``, without any
    LoRA patch.

    ComfyUI's quantized layers convert it with their own ``convert_weight`` (the dequantized or scaled
    weight: what LoraLoader patches, ``comfy.model_patcher.get_key_weight``); a GGUF-quantized tensor is
    dequantized by ``module`` itself (ComfyUI-GGUF's ``get_weight``), exactly as its forward does, from
    an alias of the same blocks that carries no patches; any other is cast (a GGUF F16/F32 tensor as a
    plain torch.Tensor).

    Three stored forms, each read back only by the layer that holds it:

    - ComfyUI's mixed-precision layers (``comfy.ops.mixed_precision_ops``, ComfyUI 0.3.75 and 0.33: fp8
      and, on 0.33, nvfp4 ...): the weight is a ``comfy.quant_ops.QuantizedTensor`` (a tensor subclass
      whose ``shape`` is the logical shape), the layer a plain Module with Linear's attributes (not a
      ``torch.nn.Linear``), and ``convert_weight`` dequantizes it;
    - ComfyUI 0.3.75's older scaled fp8 layers (``comfy.ops.scaled_fp8_ops``): a plain float8 weight that
      the layer multiplies by its ``scale_weight``; ``convert_weight`` does that;
    - ComfyUI-GGUF's layers: a ``GGMLTensor`` (integer storage of GGML blocks, logical ``shape``, the GGML
      type in ``tensor_type``), dequantized in every forward by the layer's ``get_weight(tensor, dtype)``,
      which also adds the LoRA patches LoraLoader attached to the tensor (``patches``).

    What that means for the engine (data flow)::

        hook patches -> plan: shapes from ``weight.shape`` (the logical shape), never from the storage
        LoRA/LoCon   -> forward deltas on the layer's output: no weight needed, so nothing is dequantized
                        and the weights stay as they are stored
        dense deltas (model-as-LoRA, LoHa, LoKr, DoRA) -> ``plain_weight``: the weight as the layer
            computes with it, by ComfyUI's own ``convert_weight`` (what LoraLoader's patch path takes as
            the base: ``comfy.model_patcher.get_key_weight``) or ComfyUI-GGUF's ``get_weight`` on a
            patch-free alias of the same blocks (the unpatched weight, as core takes a model-as-LoRA's
            base), in float32
        rounding "loraloader" -> quantized weights take the compute path (``kept_quantized``): ComfyUI-GGUF's
            LoraLoader adds the LoRA in the compute dtype too; ComfyUI's requantizes W + delta, which
            differs from the compute path by that weight's quantization noise

    ComfyUI-GGUF's tensor and layer are used through the attributes above (nothing imports it).
    """
    convert = getattr(module, f"convert_{key.rsplit('.', 1)[-1]}", None)
    if convert is not None:
        try:
            return convert(tensor.to(device), inplace=False).to(torch.float32)
        except Exception as error:  # a format this device cannot dequantize
            why = f"its convert_weight failed: {error}"
            raise QuantizedWeightError(_cannot(key, module, tensor, why)) from error
    if not is_stored_quantized(tensor):
        if hasattr(tensor, "tensor_type"):  # a GGUF F16/F32 tensor: its clone() returns itself
            tensor = tensor.as_subclass(torch.Tensor)
        return tensor.to(device, torch.float32)
    get_weight = getattr(module, "get_weight", None)
    kind = getattr(tensor, "tensor_type", None)
    if get_weight is None or kind is None:
        why = "the layer has neither ComfyUI-GGUF's get_weight nor ComfyUI's convert_weight"
        raise QuantizedWeightError(_cannot(key, module, tensor, why))
    bare = type(tensor)(tensor.as_subclass(torch.Tensor), tensor_type=kind, tensor_shape=tensor.shape,
                        patches=[])
    return get_weight(bare.to(device), torch.float32).to(torch.float32)


def _cannot(key: str, module: torch.nn.Module, tensor: torch.Tensor, why: str) -> str:
    return (f"{key} ({type(module).__name__}) keeps its weight as {tensor.dtype} {type(tensor).__name__} "
            f"and {why}: the hook engine cannot dequantize it for this hook (a model-as-LoRA, LoHa, LoKr or "
            "DoRA hook needs the weight), and ComfyUI's own hook path cannot run on quantized weights "
            "either. Use a LoRA/LoCon hook (no weight needed), or load it with LoraLoader.")
