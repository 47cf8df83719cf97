"""T1: LoRA Stacker (nodes/lora_stacker.py) makes the LORA_STACK other packs' stackers make, and LoRA Stack
to Hooks reads it as it reads theirs: one hook per entry at the entry's strengths.

Reference: Comfyroll's CR LoRA Stack (its source: the incoming stack's non-None entries first, then each
slot that names a LoRA as (name, model weight, clip weight)); Efficiency Nodes' LoRA Stacker makes the
same tuples (with the incoming stack after its slots)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.t1

LORA, LOCON = "patchbay-lora-r4.safetensors", "patchbay-locon-r4.safetensors"
LOHA = "patchbay-loha-r4.safetensors"


def slots(*entries):
    out = {}
    for i in range(1, 5):
        name, model, clip = entries[i - 1] if i <= len(entries) else ("None", 1.0, 1.0)
        out.update({f"lora_{i}": name, f"model_strength_{i}": model, f"clip_strength_{i}": clip})
    return out


def test_the_stack_is_the_tuples_a_comfyroll_stack_holds_and_the_input_is_not_changed(comfy):
    node = comfy.pack.NODE_CLASS_MAPPINGS["PatchbayLoraStacker"]()
    incoming = [("None", 1.0, 1.0), (LOHA, 0.5, 0.25)]  # as CR LoRA Stack leaves an unused entry
    unused = ("None", 0.3, 0.3)
    (stack,) = node.execute(lora_stack=incoming, **slots((LORA, 0.8, 1.0), unused, (LOCON, -0.5, 0)))
    assert stack == [(LOHA, 0.5, 0.25), (LORA, 0.8, 1.0), (LOCON, -0.5, 0.0)]
    assert all(type(entry) is tuple and len(entry) == 3 for entry in stack)
    assert incoming == [("None", 1.0, 1.0), (LOHA, 0.5, 0.25)]
    assert node.execute(**slots()).args == ([],)


def test_lora_stack_to_hooks_makes_one_hook_per_entry_at_its_strengths(comfy):
    nodes = comfy.pack.NODE_CLASS_MAPPINGS
    (stack,) = nodes["PatchbayLoraStacker"]().execute(**slots((LORA, 0.8, 1.0), (LOCON, -0.5, 0.25)))
    (hooks,) = nodes["PatchbayLoraStackHooks"]().create(stack, "", "percent")
    assert [(h.strength_model, h.strength_clip) for h in hooks.hooks] == [(0.8, 1.0), (-0.5, 0.25)]
    (scheduled,) = nodes["PatchbayLoraStackHooks"]().create(stack, "2: 0@0, 1@0.5", "percent")
    assert [len(h.hook_keyframe.keyframes) for h in scheduled.hooks] == [0, 2]  # only entry 2 scheduled
