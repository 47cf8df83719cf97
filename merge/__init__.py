"""Patchbay merge: recipe-based model merging, a standalone library and command line free of ComfyUI.
Outside ComfyUI it is ``patchbay_merge`` (``pip install`` of the repo, or devtools/standalone on
``sys.path``; devtools/pack_imports.py), inside it the pack's ``merge``; nothing is imported here, so
that loads only what it needs. Modules and data flow: docs/architecture.md, docs/design-merge.md.
"""
