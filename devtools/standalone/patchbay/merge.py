"""Not a name of the merge library: outside ComfyUI it is ``patchbay_merge`` (devtools/pack_imports.py)."""

raise ImportError("patchbay.merge: outside ComfyUI the merge library is patchbay_merge "
                  "(devtools/pack_imports.py)")
