"""nodes/ as ``patchbay.nodes`` without its registration loop (nodes/__init__.py imports every node module,
the ComfyUI-bound ones too), so that T0 imports ``patchbay.nodes.search_terms`` alone."""

from pathlib import Path

__path__ = [str(Path(__file__).resolve().parents[4] / "nodes")]
