"""Sample the tiny SDXL and Flux models (devtools/tiny_arch.py) through ComfyUI's own loaders and sampler.

For tests of the hook engine on more than SD1.5. The text encoders of SDXL (CLIP-L + CLIP-G) and
Flux (CLIP-L + T5-XXL) are too large to build here, so conditioning is synthesized with the shapes
the models take: SDXL cross-attention (77 x 2048), pooled_output (1280) and the size keys its ADM
embedding reads; Flux text tokens (8 x context_in_dim), pooled vector (vec_in_dim) and guidance.
The 2026 families of devtools/tiny_dits.py (in-memory models, LoRAs as tensors) take their shapes
from its COND_SHAPES and ``sample(..., latent_shape=family.latent)``.
Everything else is core: ``UNETLoader``, ``LoraLoaderModelOnly``, ``comfy.hooks`` (what the core
hook nodes call), ``nodes.common_ksampler`` (what KSampler calls). Results are deterministic: a
fixed seed gives a bit-identical latent on the CPU.

Needs ComfyUI imported in-process (devtools/comfy_inprocess.py, the tests' ``comfy`` fixture)::

    model = load_model("flux")
    hooks = hook_lora(FLUX_LORAS[0], 1.0)
    positive = make_cond("flux", seed=1, hooks=hooks)
    negative = make_cond("flux", seed=2, hooks=hooks)
    latent = sample(model, positive, negative, seed=0)
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import logging.handlers
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import tiny_arch
import tiny_dits
import torch

if TYPE_CHECKING:
    from comfy.hooks import HookGroup
    from comfy.model_patcher import ModelPatcher

ARCHES = ("sdxl", "flux")
UNET_FILES = {"sdxl": f"{tiny_arch.SDXL_STEM}.safetensors", "flux": f"{tiny_arch.FLUX_STEM}.safetensors"}
SDXL_LORAS = (f"{tiny_arch.SDXL_LORA}.safetensors",)
FLUX_LORAS = tuple(f"{stem}.safetensors" for stem in (tiny_arch.FLUX_KOHYA, tiny_arch.FLUX_DIFFUSERS))
FLUX_BFL_LORA = f"{tiny_arch.FLUX_BFL}.safetensors"  # a control LoRA: widens img_in
FLUX_BFL_KEEP_LORA = f"{tiny_arch.FLUX_BFL_KEEP}.safetensors"  # BFL layout, img_in keeps its shape
# Text tokens, token width and pooled width per architecture ("sd15": for UNet-only SD1.5 files, such
# as the GGUF ones of devtools/tiny_gguf.py; its model ignores the pooled vector).
COND_SHAPES = {
    "sd15": (77, 768, 768),
    "sdxl": (77, 2048, 1280),
    "flux": (8, tiny_arch.FLUX_DIT["context_in_dim"], tiny_arch.FLUX_DIT["vec_in_dim"]),
    **tiny_dits.COND_SHAPES,  # the 2026 families (devtools/tiny_dits.py)
}
LATENT_SIZE = {"sd15": 16, "sdxl": 16, "flux": 8}  # latent pixels: 128x128 and 64x64 images
Conditioning = list[list[Any]]  # ComfyUI's CONDITIONING: [[cross_attn, {"pooled_output": ..., ...}]]
Tensors = dict[str, torch.Tensor]  # a LoRA's tensors, as a file holds them


def _check_arch(arch: str, known: tuple[str, ...] = ARCHES) -> None:
    if arch not in known:
        raise ValueError(f"unknown architecture {arch!r}: use one of {known}")


@contextlib.contextmanager
def logged(level: int = logging.WARNING) -> Iterator[list[logging.LogRecord]]:
    """The records of ``level`` and above that reach the root logger (ComfyUI's) while the block runs."""
    handler = logging.handlers.BufferingHandler(capacity=1 << 20)
    handler.setLevel(level)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield handler.buffer
    finally:
        root.removeHandler(handler)


def load_model(arch: str) -> ModelPatcher:
    """The tiny ``arch`` model through the UNETLoader node (``comfy.sd.load_diffusion_model``)."""
    import nodes

    _check_arch(arch)
    return nodes.UNETLoader().load_unet(UNET_FILES[arch], "default")[0]


@functools.cache
def shared_model(arch: str) -> ModelPatcher:
    """One ``load_model(arch)`` per process, for tests that only clone it (LoraLoader, hooks, samplers do).

    Loading Flux takes seconds and 2 GiB; never add patches or options to this patcher itself.
    """
    return load_model(arch)


atexit.register(shared_model.cache_clear)  # while comfy is still importable: ModelPatcher.__del__ needs it


def without_hook_cache(model: ModelPatcher) -> ModelPatcher:
    """A clone of ``model`` on which core's hook path keeps no patched copy per hook group.

    Core's default (``EnumHookMode.MaxSpeed``) caches each group's patched weights to switch groups
    faster; ``MinVram`` (what core's sampler picks itself when the conds hold one group) patches them
    again at each switch: the same weights, computed by the same code, without one copy of every
    patched weight per group (1.3 GB less for two LoRA groups on the tiny Flux). For references
    that run core's hook path on the tiny Flux beside another lane's tests."""
    import comfy.hooks

    clone = model.clone()
    clone.set_hook_mode(comfy.hooks.EnumHookMode.MinVram)
    return clone


def load_lora(model: ModelPatcher, lora: str | Tensors, strength: float = 1.0) -> ModelPatcher:
    """``model`` with a LoRA (a file in ``loras/``, or its tensors) through LoraLoaderModelOnly (a patched
    clone); tensors go through ``comfy.sd.load_lora_for_models``, the node's body after it reads the file."""
    import comfy.sd

    import nodes

    if isinstance(lora, dict):
        return comfy.sd.load_lora_for_models(model, None, lora, strength, 0.0)[0]
    return nodes.LoraLoaderModelOnly().load_lora_model_only(model, lora, strength)[0]


def lora_state_dict(lora_name: str) -> dict[str, torch.Tensor]:
    """A LoRA file from ``loras/`` as the core CreateHookLora node reads it (no key conversion)."""
    import comfy.utils
    import folder_paths

    path = folder_paths.get_full_path_or_raise("loras", lora_name)
    return comfy.utils.load_torch_file(path, safe_load=True)


def hook_lora(lora: str | Tensors, strength: float = 1.0) -> HookGroup:
    """A core LoRA hook, as CreateHookLoraModelOnly makes it: ``comfy.hooks.create_hook_lora`` (of a file
    in ``loras/``, or of the LoRA's tensors)."""
    import comfy.hooks

    tensors = lora if isinstance(lora, dict) else lora_state_dict(lora)
    return comfy.hooks.create_hook_lora(tensors, strength, strength)


def make_cond(
    arch: str,
    seed: int,
    hooks: HookGroup | None = None,
    mask: torch.Tensor | None = None,
    strength: float = 1.0,
    set_cond_area: str = "default",
    timesteps_range: tuple[float, float] | None = None,
    image_side: int | None = None,
    shape: tuple[int, int, int] | None = None,
) -> Conditioning:
    """Synthesized conditioning for ``arch`` (std-1 normal tensors from ``seed``), core properties set.

    ``hooks``, ``mask`` (``(H, W)`` or ``(B, H, W)``, any size: ComfyUI resizes it to the latent),
    ``strength`` (the mask's), ``set_cond_area`` and ``timesteps_range`` are applied with
    ``comfy.hooks.set_conds_props``, i.e. exactly as the core "Cond Set Props" / ConditioningSetMask
    nodes do. ``image_side`` sets SDXL's size keys (default: 8 * LATENT_SIZE, the image tests sample).
    ``shape``: (text tokens, their width, the pooled vector's width) of another model of the family (the
    benchmarks' real-width Flux.1), instead of COND_SHAPES[arch].
    """
    import comfy.hooks

    _check_arch(arch, tuple(COND_SHAPES))
    tokens, width, pooled_width = shape or COND_SHAPES[arch]
    generator = torch.Generator().manual_seed(seed)
    cross_attn = torch.randn((1, tokens, width), generator=generator)
    extra: dict[str, Any] = {"pooled_output": torch.randn((1, pooled_width), generator=generator)}
    if arch == "sdxl":  # what CLIPTextEncodeSDXL adds for model_base.SDXL.encode_adm
        size = image_side or 8 * LATENT_SIZE[arch]
        extra.update(width=size, height=size, crop_w=0, crop_h=0, target_width=size, target_height=size)
    elif arch == "flux":
        extra["guidance"] = 3.5  # FluxGuidance's default
    elif arch == "ltxv":  # LTXV's forward takes the text encoder's attention mask (every token kept)
        extra["attention_mask"] = torch.ones((1, tokens), dtype=torch.long)
    cond = [[cross_attn, extra]]
    return comfy.hooks.set_conds_props([cond], strength, set_cond_area, mask, hooks, timesteps_range)[0]


def sample(
    model: ModelPatcher,
    positive: Conditioning,
    negative: Conditioning,
    seed: int = 0,
    steps: int = 3,
    cfg: float = 2.0,
    sampler_name: str = "euler",
    scheduler: str = "simple",
    latent_size: int | None = None,
    denoise: float = 1.0,
    latent_shape: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """The latent ``nodes.common_ksampler`` (KSampler's body) makes from an empty latent.

    ``latent_size`` defaults to LATENT_SIZE of the model's architecture; the channel count comes from
    the model's latent format (4 for SDXL, 16 for Flux). ``latent_shape`` (one sample, channels first:
    ``(C, T, H, W)`` for video) replaces both.
    """
    import comfy.model_base

    import nodes

    size = latent_size or LATENT_SIZE["flux" if isinstance(model.model, comfy.model_base.Flux) else "sdxl"]
    shape = latent_shape or (model.model.latent_format.latent_channels, size, size)
    empty = {"samples": torch.zeros((1, *shape))}
    out = nodes.common_ksampler(model, seed, steps, cfg, sampler_name, scheduler, positive, negative, empty,
                                denoise=denoise)
    return out[0]["samples"]
