"""Test-only ComfyUI nodes (never part of Patchbay): stand-ins for what cannot be made tiny.

Loaded next to the pack by the test server and the demo (devtools/stand_ins.py), under the folder
name ``patchbay-stand-ins``. ``TinyTextConditioning`` gives a prompt the conditioning a text encoder
would, at the width the model needs (4096 for Wan's umT5-XXL), from the prompt's bytes: the same
text gives the same tensor, another text another one. No language model: it exists so that a graph
whose real text encoder has billions of parameters can run on tiny diffusion models.
"""

import hashlib

import torch

TOKENS = 8


class TinyTextConditioning:
    DESCRIPTION = ("Test stand-in for a text encoder that cannot be made tiny (umT5-XXL): deterministic "
                   "conditioning of the given width from the prompt text.")
    CATEGORY = "testing"
    FUNCTION = "encode"
    RETURN_TYPES = ("CONDITIONING",)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "text": ("STRING", {"multiline": True, "tooltip": "The prompt; its bytes seed the tensor."}),
            "width": ("INT", {"default": 4096, "min": 1, "max": 16384,
                              "tooltip": "Token width the model's text input takes (Wan: 4096)."}),
        }}

    def encode(self, text, width):
        seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
        generator = torch.Generator().manual_seed(seed)
        cond = torch.randn((1, TOKENS, width), generator=generator)
        return ([[cond, {}]],)


NODE_CLASS_MAPPINGS = {"TinyTextConditioning": TinyTextConditioning}
NODE_DISPLAY_NAME_MAPPINGS = {"TinyTextConditioning": "Tiny Text Conditioning (test stand-in)"}
