"""Patchbay hook engine: ComfyUI's hook objects run as forward-pass deltas, and the hook makers around it
(LoRA hooks, keyframes, schedules, block weights, regions, FLOATS). Builds on patcher/ (claimer slot,
registry, drawing); imports neither node code nor the merge library. Data flow: docs/architecture.md.
"""
