"""Patchbay merge: recipe-based model merging, a standalone library free of ComfyUI (planned, issue 6)."""
