"""The pack's ComfyUI-free files (hooks/, patcher/, nodes/search_terms.py) as ``patchbay.*``, without the
pack's ``__init__.py`` (it registers every node, and nodes import ComfyUI); T0 only.
devtools/pack_imports.py."""

from pathlib import Path

# This folder first: its nodes/ and merge.py stand in for the repo's; everything else is the repo's.
__path__ = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[3])]
