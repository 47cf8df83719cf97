"""LoRA hooks made the way core's hook nodes make them, plus the checks core leaves out (a file that
patches nothing, shapes of another model). Sees state dicts only: loading files is the node layer's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import comfy.hooks
import comfy.lora
import comfy.utils

from .delta_plan import has_tensor, misfit_message, misfitting, split_key

if TYPE_CHECKING:
    import torch
    from comfy.model_patcher import ModelPatcher
    from comfy.sd import CLIP

__all__ = ["LoraMismatchError", "check_lora_fits", "combine", "encode", "lora_hook", "model_as_lora_hook",
           "set_clip_hooks"]


class LoraMismatchError(ValueError):
    """A LoRA whose keys patch nothing in the model it is used with."""


def combine(*groups: comfy.hooks.HookGroup | None) -> comfy.hooks.HookGroup:
    """One new HookGroup holding (clones of) every hook of ``groups``; None entries are skipped."""
    out = comfy.hooks.HookGroup()
    for group in groups:
        if group is not None:
            out = out.clone_and_combine(group)
    return out


def lora_hook(lora: dict[str, torch.Tensor], strength_model: float, strength_clip: float,
              keyframes: comfy.hooks.HookKeyframeGroup | None = None,
              prev: comfy.hooks.HookGroup | None = None, name: str | None = None) -> comfy.hooks.HookGroup:
    """``prev``'s hooks plus a new LoRA WeightHook (core's create_hook_lora), scheduled by ``keyframes``.

    Strengths 0 and 0 add nothing, as in core's CreateHookLora. ``name`` becomes the hook's hook_id
    (shown by the schedule preview).

    Nothing here changes its inputs: groups are combined into new ones, CLIPs cloned.
    """
    if strength_model == 0 and strength_clip == 0:
        return combine(prev)
    hook = comfy.hooks.create_hook_lora(lora=lora, strength_model=strength_model, strength_clip=strength_clip)
    return combine(prev, _finish(hook, keyframes, name))


def _finish(group: comfy.hooks.HookGroup, keyframes: comfy.hooks.HookKeyframeGroup | None,
            name: str | None) -> comfy.hooks.HookGroup:
    if keyframes is not None:
        group.set_keyframes_on_hooks(keyframes)
    for hook in group.hooks:
        hook.hook_id = name
    return group


def model_as_lora_hook(weights_model: dict | None, weights_clip: dict | None, strength_model: float,
                       strength_clip: float, keyframes: comfy.hooks.HookKeyframeGroup | None = None,
                       prev: comfy.hooks.HookGroup | None = None, name: str | None = None
                       ) -> comfy.hooks.HookGroup:
    """``prev``'s hooks plus a model-as-LoRA WeightHook (another checkpoint's weights as a full delta)."""
    hook = comfy.hooks.create_hook_model_as_lora(weights_model=weights_model, weights_clip=weights_clip,
                                                 strength_model=strength_model, strength_clip=strength_clip)
    return combine(prev, _finish(hook, keyframes, name))


def check_lora_fits(lora: dict[str, torch.Tensor], name: str, model: ModelPatcher | None = None,
                    clip: CLIP | None = None) -> int:
    """How many of the model's (and CLIP's) weights ``lora`` patches; raises LoraMismatchError at 0."""
    key_map: dict[str, str] = {}
    if model is not None:
        key_map = comfy.lora.model_lora_keys_unet(model.model, key_map)
    if clip is not None:
        key_map = comfy.lora.model_lora_keys_clip(clip.cond_stage_model, key_map)
    loaded = comfy.lora.load_lora(lora, key_map, log_missing=False)
    if loaded and model is not None:
        unet = {k: v for k, v in loaded.items() if has_tensor(model.model, split_key(k).key)}
        if misfits := misfitting(model.model, unet):
            raise LoraMismatchError(misfit_message(f"LoRA {name!r}", misfits, len(loaded), model.model))
    if not loaded:
        sample = ", ".join(sorted(lora)[:3]) or "(the file holds no tensor)"
        arch = type(model.model).__name__ if model is not None else "this CLIP"
        raise LoraMismatchError(
            f"LoRA {name!r}: none of its {len(lora)} keys (e.g. {sample}) matches a weight of the model "
            f"({arch}); it was made for another model architecture. Pick a LoRA trained for this model.")
    return len(loaded)


def set_clip_hooks(clip: CLIP, hooks: comfy.hooks.HookGroup, schedule_clip: bool = False) -> CLIP:
    """A clone of ``clip`` whose encodings carry ``hooks`` (core's SetClipHooks with apply_to_conds).

    schedule_clip: the CLIP weights follow the hooks' keyframes too (one encoding per keyframe range);
    otherwise the CLIP gets each hook at its base strength_clip.
    """
    clip = clip.clone()
    clip.apply_hooks_to_conds = hooks
    clip.patcher.forced_hooks = hooks.clone()
    clip.use_clip_schedule = schedule_clip
    if not schedule_clip:
        clip.patcher.forced_hooks.set_keyframes_on_hooks(None)
    target = comfy.hooks.create_target_dict(comfy.hooks.EnumWeightTarget.Clip)
    clip.patcher.register_all_hook_patches(hooks, target)
    return clip


def encode(clip: CLIP, text: str) -> list:
    """CONDITIONING for ``text`` as CLIPTextEncode makes it (with the CLIP's hooks and schedule)."""
    return clip.encode_from_tokens_scheduled(clip.tokenize(text))
