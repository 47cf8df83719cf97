"""LoRA Stacker: a LORA_STACK made in the graph, in the format other packs' stackers (Efficiency Nodes,
Comfyroll, LoRA Manager) give it, for where none of those packs is installed.
"""

from __future__ import annotations

from . import lora_files

SLOTS = 4
_STRENGTH = {"default": 1.0, "min": -20.0, "max": 20.0, "step": 0.01}


class PatchbayLoraStacker:
    NODE_ID = "PatchbayLoraStacker"
    DISPLAY_NAME = "LoRA Stacker (Patchbay)"
    DESCRIPTION = (f"Up to {SLOTS} LoRAs as a LORA_STACK, (name, model strength, clip strength) each, the "
                   "list Efficiency Nodes', Comfyroll's and LoRA Manager's stackers give; a stack may come "
                   "in front.")
    CATEGORY = "Patchbay/hooks/create"
    FUNCTION = "stack"
    RETURN_TYPES = ("LORA_STACK",)
    RETURN_NAMES = ("lora_stack",)
    OUTPUT_TOOLTIPS = ("The incoming stack's entries, then this node's LoRAs (None slots left out): for any "
                       "LORA_STACK input.",)

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        slots: dict = {}
        for i in range(1, SLOTS + 1):
            slots[f"lora_{i}"] = ([lora_files.NONE, *lora_files.lora_names()],
                                  {"tooltip": f"LoRA {i}, a file in the loras folder (None: slot unused)."})
            slots[f"model_strength_{i}"] = ("FLOAT", {**_STRENGTH, "tooltip": f"LoRA {i}'s strength on the "
                                                                              f"model."})
            slots[f"clip_strength_{i}"] = ("FLOAT", {**_STRENGTH, "tooltip": f"LoRA {i}'s strength on the "
                                                                            f"text encoder."})
        chained = ("LORA_STACK", {"tooltip": "Optional stack (this node's or another pack's) to put in "
                                             "front; not changed."})
        return {"required": slots, "optional": {"lora_stack": chained}}

    def stack(self, lora_stack: list | None = None, **slots) -> tuple:
        entries = [tuple(entry) for entry in lora_stack or () if entry[0] != lora_files.NONE]
        for i in range(1, SLOTS + 1):
            name = slots.get(f"lora_{i}", lora_files.NONE)
            if name != lora_files.NONE:
                entries.append((name, float(slots.get(f"model_strength_{i}", 1.0)),
                                float(slots.get(f"clip_strength_{i}", 1.0))))
        return (entries,)


NODES = [PatchbayLoraStacker]
