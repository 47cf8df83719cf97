"""LoRA hook nodes (HOOKS): LoRA, model-as-LoRA, a stack with schedules, another pack's LORA_STACK as hooks,
and Scheduled LoRA in one node."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..comfy_merge import files
from ..hooks import enable as fast_hooks
from ..hooks import lora_hooks, lora_stack, schedule_text
from ..hooks.keyframes import keyframes_from_points
from . import lora_files

if TYPE_CHECKING:
    from comfy.hooks import HookGroup, HookKeyframeGroup
    from comfy.model_patcher import ModelPatcher
    from comfy.sd import CLIP

CATEGORY = "Patchbay/hooks/create"
STACK_SLOTS = 4
_HOOKS_TIP = "Hooks for Cond Set Props, Set CLIP Hooks or any node taking HOOKS."
_STRENGTH = {"min": -20.0, "max": 20.0, "step": 0.01}
_PREV = ("HOOKS", {"tooltip": "Optional hooks to add this one to (not changed)."})
_KF = ("HOOK_KEYFRAMES", {"tooltip": "Optional schedule for this hook (Patchbay or core keyframe nodes)."})
_UNET = ("FLOAT", {**_STRENGTH, "default": 1.0, "tooltip": "Strength on the UNet."})
_CLIP = ("FLOAT", {**_STRENGTH, "default": 1.0,
                   "tooltip": "Strength on the text encoder (with Set CLIP Hooks)."})
_UNIT_TIP = "Schedule positions: percent (0 first step .. 1 last), step numbers (0 = first) or sigmas."
_SCHEDULE_TIP = "strength@position items, e.g. 0@0, 1@0.3, 0.2@1; empty = full strength throughout."


_STACK_TIP = ("A LoRA stack from another pack (Efficiency Nodes' LoRA Stacker, Comfyroll's CR LoRA Stack, "
              "LoRA Manager's Lora Stacker): (name, model strength, clip strength) entries.")


def keyframes_for(text: str, unit: str) -> HookKeyframeGroup | None:
    """Keyframes for a schedule text, None for an empty one."""
    if not text.split("#", 1)[0].strip():
        return None
    return keyframes_from_points(schedule_text.parse_schedule(text, unit), unit)


def stack_hooks(files: lora_files.LoraFiles, stack: list | None, schedules: str = "",
                positions: str = "percent", prev: HookGroup | None = None) -> HookGroup:
    """``prev``'s hooks plus one LoRA hook per LORA_STACK entry at its model and clip strength, scheduled
    by its ``LABEL: schedule`` line of ``schedules`` (hooks/lora_stack.py)."""
    entries = lora_stack.stack_entries(stack)
    texts = lora_stack.entry_schedules(schedules, entries)
    hooks = lora_hooks.combine(prev)
    for entry in entries:
        where = f"LORA_STACK entry {entry.position} ({entry.name!r})"
        try:
            name, lora = files.lora(entry.name)
            keyframes = keyframes_for(texts.get(entry.position, ""), positions)
        except ValueError as error:
            raise type(error)(f"{where}: {error}") from None
        hooks = lora_hooks.lora_hook(lora, entry.strength_model, entry.strength_clip, keyframes, hooks, name)
    return hooks


class _Hook(lora_files.ReadsLoras):
    FUNCTION = "create"
    RETURN_TYPES = ("HOOKS",)
    RETURN_NAMES = ("hooks",)
    OUTPUT_TOOLTIPS = (_HOOKS_TIP,)
    CATEGORY = CATEGORY


class PatchbayHookLora(_Hook):
    NODE_ID = "PatchbayHookLora"
    DISPLAY_NAME = "LoRA Hook (Patchbay)"
    DESCRIPTION = ("A LoRA as a hook: it applies only to the conds that carry it, at its model and CLIP "
                   "strength.")

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {
            "required": {
                "lora_name": (lora_files.lora_names(), {"tooltip": "A file in the loras folder."}),
                "strength_model": _UNET,
                "strength_clip": _CLIP,
            },
            "optional": {"prev_hooks": _PREV, "hook_kf": _KF},
        }

    def create(self, lora_name: str, strength_model: float, strength_clip: float,
               prev_hooks: HookGroup | None = None, hook_kf: HookKeyframeGroup | None = None) -> tuple:
        name, lora = self.files.lora(lora_name)
        return (lora_hooks.lora_hook(lora, strength_model, strength_clip, hook_kf, prev_hooks, name),)


class PatchbayHookModelAsLora(_Hook):
    NODE_ID = "PatchbayHookModelAsLora"
    DISPLAY_NAME = "Model as LoRA Hook (Patchbay)"
    DESCRIPTION = ("Another checkpoint as a hook: the conds that carry it sample with that checkpoint's "
                   "weights, scaled by strength (1 = that model, 0.5 = halfway).")

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {
            "required": {
                "ckpt_name": (files.names("checkpoints"),
                              {"tooltip": "A file in the checkpoints folder."}),
                "strength_model": _UNET,
                "strength_clip": _CLIP,
            },
            "optional": {"prev_hooks": _PREV, "hook_kf": _KF},
        }

    def create(self, ckpt_name: str, strength_model: float, strength_clip: float,
               prev_hooks: HookGroup | None = None, hook_kf: HookKeyframeGroup | None = None) -> tuple:
        weights_model, weights_clip = self.files.checkpoint_weights(ckpt_name)
        return (lora_hooks.model_as_lora_hook(weights_model, weights_clip, strength_model, strength_clip,
                                              hook_kf, prev_hooks, ckpt_name),)


class PatchbayHookLoraStack(_Hook):
    NODE_ID = "PatchbayHookLoraStack"
    DISPLAY_NAME = "LoRA Hook Stack (Patchbay)"
    DESCRIPTION = (f"Up to {STACK_SLOTS} LoRAs as hooks in one node, each with its own strength and schedule "
                   "text; one HOOKS output carrying them all.")

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        slots: dict = {}
        for i in range(1, STACK_SLOTS + 1):
            slots[f"lora_{i}"] = ([lora_files.NONE, *lora_files.lora_names()],
                                  {"tooltip": f"LoRA {i} (None: slot unused)."})
            slots[f"strength_{i}"] = ("FLOAT", {**_STRENGTH, "default": 1.0,
                                                "tooltip": f"LoRA {i}'s strength on model and CLIP."})
            slots[f"schedule_{i}"] = ("STRING", {"default": "", "tooltip": f"LoRA {i}: {_SCHEDULE_TIP}"})
        return {
            "required": {**slots, "positions": (list(schedule_text.UNITS), {"tooltip": _UNIT_TIP})},
            "optional": {"prev_hooks": _PREV,
                         "lora_stack": ("LORA_STACK", {"tooltip": f"{_STACK_TIP} Added after the slots, "
                                                                  "each at constant strength."})},
        }

    def create(self, positions: str = "percent", prev_hooks: HookGroup | None = None,
               lora_stack: list | None = None, **slots) -> tuple:
        hooks = lora_hooks.combine(prev_hooks)
        for i in range(1, STACK_SLOTS + 1):
            name = slots.get(f"lora_{i}", lora_files.NONE)
            if name == lora_files.NONE:
                continue
            name, lora = self.files.lora(name)
            strength = slots.get(f"strength_{i}", 1.0)
            keyframes = keyframes_for(slots.get(f"schedule_{i}", ""), positions)
            hooks = lora_hooks.lora_hook(lora, strength, strength, keyframes, hooks, name)
        return (stack_hooks(self.files, lora_stack, prev=hooks),)


class PatchbayLoraStackHooks(_Hook):
    NODE_ID = "PatchbayLoraStackHooks"
    DISPLAY_NAME = "LoRA Stack to Hooks (Patchbay)"
    DESCRIPTION = ("Another pack's LORA_STACK as hooks: one LoRA hook per entry at its model and clip "
                   "strength, each with its own schedule text.")
    FILES_KEPT = 8

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {
            "required": {
                "lora_stack": ("LORA_STACK", {"tooltip": _STACK_TIP}),
                "schedules": ("STRING", {"default": "", "multiline": True,
                                         "tooltip": "One line per scheduled LoRA, LABEL: schedule; LABEL is "
                                                    "its position in the stack (1 = first) or its name, e.g. "
                                                    "'1: 0@0, 1@0.5' or 'my_lora: 1@0, 0@0.6'. LoRAs no line "
                                                    "names keep their strength throughout."}),
                "positions": (list(schedule_text.UNITS), {"tooltip": _UNIT_TIP}),
            },
            "optional": {"prev_hooks": _PREV},
        }

    @classmethod
    def VALIDATE_INPUTS(cls, schedules: str | None = None, positions: str | None = None) -> bool | str:
        for line in (schedules or "").splitlines():
            try:
                keyframes_for(line.split("#", 1)[0].rpartition(":")[2].strip(), positions or "percent")
            except schedule_text.ScheduleError as error:
                return f"schedules line {line!r}: {error}"
        return True

    def create(self, lora_stack: list, schedules: str = "", positions: str = "percent",
               prev_hooks: HookGroup | None = None) -> tuple:
        return (stack_hooks(self.files, lora_stack, schedules, positions, prev_hooks),)


class PatchbayScheduledLora(lora_files.ReadsLoras):
    NODE_ID = "PatchbayScheduledLora"
    DISPLAY_NAME = "Scheduled LoRA (Patchbay)"
    DESCRIPTION = ("One node for a scheduled LoRA: the CLIP it returns makes conds carrying the LoRA hook "
                   "with its schedule; the model it returns runs hooks on the fast engine.")
    CATEGORY = "Patchbay/hooks"
    FUNCTION = "apply"
    RETURN_TYPES = ("MODEL", "CLIP", "HOOKS")
    RETURN_NAMES = ("model", "clip", "hooks")
    OUTPUT_TOOLTIPS = ("A clone of the model on Patchbay's Fast Hooks engine.",
                       "A clone of the CLIP: every prompt encoded with it carries the scheduled LoRA hook.",
                       "The scheduled LoRA hook, for other conds.")

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {
            "required": {
                "model": ("MODEL", {"tooltip": "The model the sampler uses; cloned, never changed."}),
                "clip": ("CLIP", {"tooltip": "Encode the prompts with the CLIP this node returns."}),
                "lora_name": (lora_files.lora_names(), {"tooltip": "A file in the loras folder."}),
                "strength_model": _UNET,
                "strength_clip": _CLIP,
                "schedule": ("STRING", {"default": "0@0, 1@0.5", "multiline": True,
                                        "tooltip": _SCHEDULE_TIP}),
                "positions": (list(schedule_text.UNITS), {"tooltip": _UNIT_TIP}),
                "schedule_clip": ("BOOLEAN", {"default": False,
                                              "tooltip": "Schedule the CLIP strength too (one encoding per "
                                                         "keyframe range; percent positions only)."}),
            },
        }

    @classmethod
    def VALIDATE_INPUTS(cls, schedule: str | None = None, positions: str | None = None) -> bool | str:
        try:
            if schedule is not None:
                keyframes_for(schedule, positions or "percent")
        except schedule_text.ScheduleError as error:
            return str(error)
        return True

    def apply(self, model: ModelPatcher, clip: CLIP, lora_name: str, strength_model: float,
              strength_clip: float, schedule: str, positions: str = "percent",
              schedule_clip: bool = False) -> tuple:
        if schedule_clip and positions != "percent":
            raise schedule_text.ScheduleError(f"schedule_clip needs positions in percent (CLIP schedules are "
                                              f"ranges of percent), got {positions!r}; switch one of them.")
        name, lora = self.files.lora(lora_name)
        lora_hooks.check_lora_fits(lora, name, model, clip)
        hooks = lora_hooks.lora_hook(lora, strength_model, strength_clip, keyframes_for(schedule, positions),
                                     name=name)
        clip = lora_hooks.set_clip_hooks(clip, hooks, schedule_clip)
        return (fast_hooks.enable_hook_engine(model), clip, hooks)


NODES = [PatchbayHookLora, PatchbayHookModelAsLora, PatchbayHookLoraStack, PatchbayLoraStackHooks,
         PatchbayScheduledLora]
