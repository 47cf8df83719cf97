"""Patchbay patcher: the hook-aware ModelPatcher subclass, wrapper/callback registries, sampler
step events, tracing and per-model patch order. See docs/node-authors.md for the API."""
