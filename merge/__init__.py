"""Patchbay merge: recipe-based model merging, a standalone library free of ComfyUI (issue 6).

- ``recipe``: the frozen recipe graph (node types in ``graph``), checked builders, ``bind``.
- ``registry``: ``@merge_method``, ``get``, ``all_methods``, ``scope``; ``methods/`` the built-ins.
- ``context``: ``KeyContext``, what a method sees besides its tensors.
- ``blocks``: block and component of a key (sd15, sdxl, flux), per-block literal resolution.
- ``mecha_text``: sd-mecha's ``.mecha`` text, read and written.
- ``io``, ``lora``, ``execute``, ``extract``, ``cli``: files, LoRA inputs, the streaming merge,
  LoRA extraction and the command line; ``lora_keys`` names LoRA modules from fixed UNet layouts.

Nothing is imported here: ``from patchbay.merge import recipe`` loads only what it needs.
"""
