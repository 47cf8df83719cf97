"""Tiny models in ComfyUI's own quantized formats (fp8 scaled, mixed precision), for both versions.

Fast Hooks must be checked on the quantized files ComfyUI's UNETLoader reads (``comfy/quant_ops.py``,
``comfy/ops.py``), and none can be downloaded, so this module quantizes the UNet of
``patchbay-sd15-tiny-a`` (devtools/tiny_models.py) into ``diffusion_models/``:

- ``patchbay-sd15-tiny-a-fp8mixed.safetensors``: the mixed-precision layout ComfyUI 0.3.75 introduced
  and 0.33 still reads: a ``_quantization_metadata`` entry in the file's metadata (``{"format_version":
  "1.0", "layers": {"<layer>": {"format": "float8_e4m3fn"}}}``), each listed layer's ``weight`` in
  float8_e4m3fn with its per-tensor ``weight_scale`` (float32). Both versions load these weights as
  ``comfy.quant_ops.QuantizedTensor`` in ``mixed_precision_ops`` layers.
- ``patchbay-sd15-tiny-a-fp8scaled.safetensors``: the older "scaled fp8" layout (the
  ``*_fp8_scaled`` files): a ``scaled_fp8`` marker tensor (two float8 values: no fp8 input scaling)
  and ``scale_weight`` per layer. ComfyUI 0.3.75 loads it with ``comfy.ops.scaled_fp8_ops`` (a plain
  float8 weight the layer multiplies by ``scale_weight``), 0.33 converts it on load
  (``comfy.utils.convert_old_quants``) into the mixed-precision layout above.

Which layers: every 2-D weight of the transformer blocks (attention and feed-forward linears), as
ComfyUI's fp8 checkpoints quantize the blocks' linears and keep the input, output, time-embedding
and convolution weights in 16 bits. The values are quantized per tensor by ComfyUI's own layout
(``TensorCoreFP8E4M3Layout.quantize`` on 0.33, ``TensorCoreFP8Layout.quantize`` on 0.3.75) with scale
``amax / 448``: a scaled division, a clamp and a cast, so the bytes are the same on both versions and
pinned in ``models.sha256`` like the others.

nvfp4 (ComfyUI 0.33; four-bit values in blocks of 16 with fp8 block scales): ``nvfp4_state_dict``
builds the same UNet in memory with 0.33's own quantizer (see there why it is no file).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

SOURCE, PREFIX = "checkpoints/patchbay-sd15-tiny-a.safetensors", "model.diffusion_model."
STEM = "patchbay-sd15-tiny-a"
FORMATS = ("fp8mixed", "fp8scaled")
FP8 = torch.float8_e4m3fn
GENERATOR = "devtools/tiny_quant.py"
# ComfyUI's SD1.5 detection reads the text-context width from the cross-attention k/v weights' second
# dimension, which nvfp4's packing (two values a byte) halves: they stay float in the nvfp4 model.
NVFP4_KEEP = (".attn2.to_k.weight", ".attn2.to_v.weight")


def quant_rel(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantized format {fmt!r}: use one of {FORMATS}")
    return f"diffusion_models/{STEM}-{fmt}.safetensors"


def all_rels() -> list[str]:
    return [quant_rel(fmt) for fmt in FORMATS]


def quantized_layer(key: str, tensor: torch.Tensor) -> bool:
    """A transformer block's linear weight (what the fp8 files quantize)."""
    return ".transformer_blocks." in key and key.endswith(".weight") and tensor.ndim == 2


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn values, float32 scale) by ComfyUI's own per-tensor fp8 layout, scale amax / 448."""
    import comfy.quant_ops

    scale = weight.abs().amax().to(torch.float32) / torch.finfo(FP8).max
    if hasattr(comfy.quant_ops, "TensorCoreFP8E4M3Layout"):  # ComfyUI 0.33: comfy-kitchen's layouts
        qdata, _ = comfy.quant_ops.TensorCoreFP8E4M3Layout.quantize(weight, scale=scale)
    else:  # 0.3.75
        qdata, _ = comfy.quant_ops.TensorCoreFP8Layout.quantize(weight, scale=scale, dtype=FP8)
    return qdata, scale


def quantized_unet(source: dict[str, torch.Tensor], fmt: str) -> tuple[dict, dict[str, str]]:
    """The UNet of the checkpoint state dict ``source`` in ``fmt``: (tensors, metadata entries).

    fmt: one of FORMATS, or "nvfp4" (ComfyUI 0.33 only: its per-layer ``comfy_quant`` layout, weights
    quantized by ``QuantizedTensor.from_float(..., "TensorCoreNVFP4Layout")``, comfy-kitchen's eager
    kernels on the CPU).
    """
    unet = {key.removeprefix(PREFIX): value for key, value in source.items() if key.startswith(PREFIX)}
    layers = {key.removesuffix(".weight") for key, value in unet.items()
              if quantized_layer(key, value) and not (fmt == "nvfp4" and key.endswith(NVFP4_KEEP))}
    return quantize_layers(unet, fmt, layers)


def quantize_layers(tensors: dict[str, torch.Tensor], fmt: str,
                    layers: set[str]) -> tuple[dict, dict[str, str]]:
    """A diffusion model's state dict ``tensors`` with the weights of ``layers`` (module names) in ``fmt``:
    (tensors, metadata entries, as a file's header gives them to ``load_diffusion_model_state_dict``)."""
    import comfy.quant_ops

    if fmt not in (*FORMATS, "nvfp4"):
        raise ValueError(f"unknown quantized format {fmt!r}: use one of {(*FORMATS, 'nvfp4')}")
    if fmt == "nvfp4" and "nvfp4" not in comfy.quant_ops.QUANT_ALGOS:
        raise ValueError("this ComfyUI has no nvfp4 format (comfy.quant_ops.QUANT_ALGOS): ComfyUI 0.33 has")
    out: dict[str, torch.Tensor] = {}
    listed: dict[str, dict] = {}
    for key, value in sorted(tensors.items()):
        layer = key.removesuffix(".weight")
        if not key.endswith(".weight") or layer not in layers:
            out[key] = value
            continue
        if fmt == "nvfp4":
            weight = comfy.quant_ops.QuantizedTensor.from_float(value.to(torch.float32),
                                                                "TensorCoreNVFP4Layout")
            out.update(weight.state_dict(key))  # weight, weight_scale (blocks), weight_scale_2
            conf = json.dumps({"format": "nvfp4"}).encode()
            out[f"{layer}.comfy_quant"] = torch.tensor(list(conf), dtype=torch.uint8)
            continue
        out[key], scale = quantize_fp8(value.to(torch.float32))
        if fmt == "fp8mixed":
            out[f"{layer}.weight_scale"] = scale
            listed[layer] = {"format": "float8_e4m3fn"}
        else:
            out[f"{layer}.scale_weight"] = scale
    metadata = {}
    if fmt == "fp8mixed":
        metadata["_quantization_metadata"] = json.dumps({"format_version": "1.0", "layers": listed},
                                                        sort_keys=True)
    elif fmt == "fp8scaled":
        out["scaled_fp8"] = torch.zeros(2, dtype=FP8)  # two values: no fp8 input scaling
    return out, metadata


class QuantModels:
    """Writes the quantized files from the tiny SD1.5 checkpoint (made before them: ``all_rels`` order)."""

    def __init__(self) -> None:
        import tiny_models

        tiny_models.import_comfy_on_cpu()

    def write(self, out_dir: Path, rel: str) -> str:
        """Write ``out_dir / rel`` and return its sha256."""
        import tiny_models

        fmt = next((f for f in FORMATS if quant_rel(f) == rel), None)
        if fmt is None:
            raise ValueError(f"{rel} is not made by tiny_quant; it makes {all_rels()}")
        source = out_dir / SOURCE
        if not source.is_file():
            raise FileNotFoundError(f"{rel} is made from {source}, which is missing: generate it first "
                                    f"(python devtools/tiny_models.py --out {out_dir}).")
        tensors, metadata = quantized_unet(load_file(source), fmt)
        metadata.update(tiny_models.model_metadata(f"{STEM}-{fmt}", "stable-diffusion-v1", GENERATOR))
        return tiny_models.write_safetensors(out_dir / rel, tensors, metadata)


def nvfp4_state_dict(models_dir: Path) -> dict[str, torch.Tensor]:
    """The tiny SD1.5 UNet in ComfyUI 0.33's nvfp4 layout, made in this process (for
    ``comfy.sd.load_diffusion_model_state_dict``).

    Not a file: ComfyUI 0.3.75 has neither nvfp4 nor comfy-kitchen, and the generator must make every
    file on either version; so the tests build it with ComfyUI 0.33's own quantizer when they need it.
    """
    return quantized_unet(load_file(Path(models_dir) / SOURCE), "nvfp4")[0]
