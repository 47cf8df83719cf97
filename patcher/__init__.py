"""Patchbay patcher: the ModelPatcher subclass with one attachment of state, keyed wrapper/callback
registries, sampler step events, tracing and per-model patch order, all on core's extension layer.
API for node authors: docs/node-authors.md; data flow: docs/architecture.md.
"""
