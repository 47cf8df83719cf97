"""Patchbay hook engine: hook objects, keyframe schedules and their math.

Pure modules (floats, lowrank, cache) import only the standard library and torch; plan and engine
adapt ComfyUI's hook objects (comfy.hooks, comfy.lora) to them. Hooks build on the patcher (its
claimer slot, wrapper registry, step state and drawing) and import neither node code nor the merge
library: docs/architecture.md has the arrows, tests/test_t0_architecture.py enforces them.
"""
