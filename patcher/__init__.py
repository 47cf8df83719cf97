"""Patchbay patcher: the hook-aware ModelPatcher subclass and its registries (planned, issue 3)."""
