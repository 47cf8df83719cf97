"""Patchbay merge: recipe-based model merging, a standalone library free of ComfyUI.

- ``recipe``: the frozen recipe graph (node types in ``graph``), checked builders, ``bind``.
- ``registry``: ``@merge_method``, ``get``, ``all_methods``, ``scope``; ``methods/`` the built-ins,
  declared with ``declare.builtin_method`` and registered when the registry is imported.
  ``names``: merge spaces and "did you mean".
- ``context``: ``KeyContext``, what a method sees besides its tensors.
- ``blocks``: block and component of a key (sd15, sdxl, flux), per-block literal resolution.
- ``mecha_text``: sd-mecha's ``.mecha`` text, read and written.
- ``execute``: ``merge(recipe, out, MergeOptions(...))``, the entry point; ``plan`` the options,
  report and per-key plans; ``steps``, ``stream``, ``pipeline`` the compiled recipe, one key's
  evaluation and the reader/writer threads.
- ``io``, ``lora``, ``extract``, ``cli``: files, LoRA inputs, LoRA extraction and the command line;
  ``lora_keys`` names LoRA modules from fixed UNet layouts; ``fingerprint`` what the cache knows a
  file by (``sources``, ``session``, ``cache``: what the ComfyUI nodes embed).

Import it with the pack folder on ``sys.path``: ``from merge import recipe``. Nothing is imported
here, so that loads only what it needs.
"""
