"""Patchbay hook engine: hook objects, keyframe schedules and their math.

Pure modules here import only the standard library and torch; they never import node code,
the patcher or the merge library (see ../shared/STYLE.md, "Dependency direction").
"""
