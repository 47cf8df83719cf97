"""Patchbay hook engine: hook objects, keyframe schedules and their math.

Pure modules (floats, lowrank, cache) import only the standard library and torch; plan and engine
adapt ComfyUI's hook objects (comfy.hooks, comfy.lora) to them. Nothing here imports node code,
the patcher or the merge library (see ../shared/STYLE.md, "Dependency direction").
"""
