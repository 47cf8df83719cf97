"""Patchbay merge: recipe-based model merging, a standalone library and command line free of ComfyUI.
Import it with the pack folder on ``sys.path`` (``from merge import recipe``); nothing is imported here,
so that loads only what it needs. Modules and data flow: docs/architecture.md, docs/design-merge.md.
"""
