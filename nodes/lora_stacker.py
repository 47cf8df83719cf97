"""LoRA Stacker: a LORA_STACK made in the graph, in the format other packs' stackers (Efficiency Nodes,
Comfyroll, LoRA Manager) give it, for where none of those packs is installed.
"""

from __future__ import annotations

from comfy_api.latest import io

from . import lora_files, v3

SLOTS = 4
_STRENGTH = {"default": 1.0, "min": -20.0, "max": 20.0, "step": 0.01}


class PatchbayLoraStacker(v3.Node):
    NODE_ID = "PatchbayLoraStacker"
    DISPLAY_NAME = "LoRA Stacker (Patchbay)"

    @classmethod
    def define_schema(cls) -> io.Schema:
        slots: list[io.Input] = []
        for i in range(1, SLOTS + 1):
            slots += [
                io.Combo.Input(f"lora_{i}", options=[lora_files.NONE, *lora_files.lora_names()],
                               tooltip=f"LoRA {i}, a file in the loras folder (None: slot unused)."),
                io.Float.Input(f"model_strength_{i}", **_STRENGTH,
                               tooltip=f"LoRA {i}'s strength on the model."),
                io.Float.Input(f"clip_strength_{i}", **_STRENGTH,
                               tooltip=f"LoRA {i}'s strength on the text encoder."),
            ]
        chained = v3.LORA_STACK.Input("lora_stack", optional=True,
                                      tooltip="Optional stack (this node's or another pack's) to put in "
                                              "front; not changed.")
        return v3.schema(
            cls, category="Patchbay/hooks/create",
            description=(f"Up to {SLOTS} LoRAs as a LORA_STACK, (name, model strength, clip strength) each, "
                         "the list Efficiency Nodes', Comfyroll's and LoRA Manager's stackers give; a stack "
                         "may come in front."),
            inputs=[*slots, chained],
            outputs=[v3.output(v3.LORA_STACK, "lora_stack", "The incoming stack's entries, then this node's "
                                                            "LoRAs (None slots left out): for any LORA_STACK "
                                                            "input.")])

    @classmethod
    def execute(cls, lora_stack: list | None = None, **slots) -> io.NodeOutput:
        entries = [tuple(entry) for entry in lora_stack or () if entry[0] != lora_files.NONE]
        for i in range(1, SLOTS + 1):
            name = slots.get(f"lora_{i}", lora_files.NONE)
            if name != lora_files.NONE:
                entries.append((name, float(slots.get(f"model_strength_{i}", 1.0)),
                                float(slots.get(f"clip_strength_{i}", 1.0))))
        return io.NodeOutput(entries)


NODES = [PatchbayLoraStacker]
