"""The merge library, merge/, as ``patchbay_merge`` (the name ``pip install`` of the repo gives it) in a
process without ComfyUI; which name where: devtools/pack_imports.py."""

from pathlib import Path

__path__ = [str(Path(__file__).resolve().parents[3] / "merge")]  # patchbay_merge.recipe is merge/recipe.py
