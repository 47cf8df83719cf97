"""ComfyUI-GGUF in the tests: the vendored pack unpacked and loaded into ComfyUI, the tiny GGUF models.

The hook engine is tested on UNets that ComfyUI-GGUF's own ``UnetLoaderGGUF`` node loads, from the
files devtools/tiny_gguf.py makes. The pack comes from ``ComfyUI-GGUF.tar.gz`` in the shared vendor
folder (commit 795e451, sha256-pinned in devtools/vendor_packs.py), is unpacked once into the cache
outside the clone (``$PATCHBAY_CACHE/vendor``, never into the repo) and is loaded by ComfyUI's own
custom-node loader, as a user's ``custom_nodes/ComfyUI-GGUF`` is. It needs the ``gguf`` package (pinned
in the lock files).
Conditioning and sampling are devtools/arch_sampling.py's ("sd15" and "flux" conds)::

    load_comfyui_gguf()                      # once per process, after ComfyUI is imported
    model = shared_gguf("sd15", "Q4_K")      # a GGUFModelPatcher; clone it, never patch it
    reference = dequantized_copy(model, "sd15")  # core's layers, float32, the GGUF layers' weights
"""

from __future__ import annotations

import asyncio
import atexit
import functools
from pathlib import Path
from typing import TYPE_CHECKING

import tiny_gguf
import torch
from vendor_packs import COMFYUI_GGUF, ensure_unpacked

if TYPE_CHECKING:
    from comfy.model_patcher import ModelPatcher

LOADER = "UnetLoaderGGUF"
STEMS = {"sd15": "patchbay-sd15-tiny-a", "flux": "patchbay-flux-tiny"}
QTYPES = tiny_gguf.QTYPES


def load_comfyui_gguf() -> None:
    """Load ComfyUI-GGUF into the ComfyUI imported in this process (devtools/comfy_inprocess.py)."""
    import nodes

    if LOADER in nodes.NODE_CLASS_MAPPINGS:
        return
    pack = ensure_unpacked(COMFYUI_GGUF)
    if not asyncio.run(nodes.load_custom_node(str(pack))) or LOADER not in nodes.NODE_CLASS_MAPPINGS:
        raise RuntimeError(f"ComfyUI did not load {pack}; its log says why (is the gguf package installed?)")


def gguf_name(arch: str, qtype: str) -> str:
    """The file name UnetLoaderGGUF lists for the tiny ``arch`` model in ``qtype``."""
    if arch not in STEMS or qtype not in QTYPES:
        raise ValueError(f"no tiny GGUF model {arch!r} {qtype!r}: architectures {tuple(STEMS)}, "
                         f"types {QTYPES}")
    return Path(tiny_gguf.gguf_rel(STEMS[arch], qtype)).name


def load_gguf(arch: str, qtype: str) -> ModelPatcher:
    """The tiny ``arch`` model in ``qtype`` through ComfyUI-GGUF's UnetLoaderGGUF node."""
    import nodes

    return nodes.NODE_CLASS_MAPPINGS[LOADER]().load_unet(gguf_name(arch, qtype))[0]


@functools.cache
def shared_gguf(arch: str, qtype: str) -> ModelPatcher:
    """One ``load_gguf`` per process, for tests that only clone it (never patch this patcher itself)."""
    return load_gguf(arch, qtype)


atexit.register(shared_gguf.cache_clear)  # while comfy is still importable: ModelPatcher.__del__ needs it


def is_quantized(tensor: torch.Tensor) -> bool:
    """A weight ComfyUI-GGUF keeps as GGML blocks (Q8_0, Q4_K ...), not as a float tensor."""
    return not tensor.is_floating_point()


def dequantized_weights(model: ModelPatcher):
    """``(name, float32 tensor)`` for each diffusion-model weight, dequantized by its GGUF layer's
    ``get_weight``: the values its forward computes with (no LoRA patch is attached to a freshly loaded
    model). One at a time, so that no second copy of the whole model exists."""
    for name, module in model.model.diffusion_model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            key = f"{name}.{param_name}" if name else param_name
            if is_quantized(param):
                value = module.get_weight(param, torch.float32)
            else:
                value = param.as_subclass(torch.Tensor).to(torch.float32)
            yield key, value.as_subclass(torch.Tensor).detach()


def dequantized_copy(model: ModelPatcher, arch: str) -> ModelPatcher:
    """A plain ComfyUI model of the same architecture (core's layers, float32 weights) holding the values
    ``model``'s GGUF layers compute with: what core's own hook path can run, as a reference.

    The float file the tiny ``arch`` GGUF files were made from (devtools/tiny_gguf.py) is loaded in
    float32 and each weight is overwritten in place with the GGUF layer's value, one at a time (a whole
    dequantized state dict loaded beside its copy held the tiny Flux twice: 2.3 GB more at the peak)."""
    import comfy.sd
    import folder_paths

    folder, name = tiny_gguf.LAYOUTS[STEMS[arch]].source.split("/", 1)
    path = folder_paths.get_full_path_or_raise(folder, name)
    options = {"dtype": torch.float32}
    if folder == "checkpoints":
        copy = comfy.sd.load_checkpoint_guess_config(path, output_vae=False, output_clip=False,
                                                     output_clipvision=False, model_options=options)[0]
    else:
        copy = comfy.sd.load_diffusion_model(path, model_options=options)
    targets = dict(copy.model.diffusion_model.named_parameters())
    with torch.no_grad():
        for key, value in dequantized_weights(model):
            target = targets.pop(key)
            if target.dtype != torch.float32 or target.shape != value.shape:
                raise RuntimeError(f"{path}: {key} is {target.dtype} {tuple(target.shape)} in the float "
                                   f"copy, {tuple(value.shape)} in the GGUF model; regenerate the tiny "
                                   "models")
            target.copy_(value)
    if targets:
        raise RuntimeError(f"{path}: weights the GGUF model lacks: {sorted(targets)[:5]}")
    return copy
