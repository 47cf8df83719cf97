"""Tiny Wan 2.2 14B files (two experts, two LoRAs, a Wan 2.1 VAE) for the bundled two-stage workflow.

The workflow "Wan 2.2, LoRA on high noise" is what a user wires for Wan 2.2 14B text-to-video: two
UNETLoaders, a Wan 2.1 VAE, LoRA hooks. No real file can be downloaded here, so this module writes
files ComfyUI's own loaders detect as those (weights, hashing and the manifest are tiny_models';
``ensure_models`` covers these files too):

- ``diffusion_models/patchbay-wan22-tiny-{high,low}-noise.safetensors``: the two experts, each a Wan
  2.1-layout model (ComfyUI detects each as WAN21_T2V, model class WAN21), built by devtools/tiny_dits.py
  (``state_dict(FAMILIES["wan21"], "high")``): one block, 128 wide (detection makes heads = dim / 128);
  the text embedding keeps umT5-XXL's 4096 inputs, which detection does not read but the conditioning
  needs.
- ``loras/patchbay-wan-high-noise-r4.safetensors``: a rank-4 LoRA in musubi-tuner's (kohya) names
  (``lora_unet_blocks_0_self_attn_q``), the one the workflow hooks on the high-noise stage only.
- ``loras/patchbay-wan-style-r4.safetensors``: a rank-4 LoRA in ai-toolkit's names
  (``diffusion_model.blocks.0.self_attn.q.lora_A``), scheduled by sigma across both stages.
- ``vae/patchbay-wan21-tiny-vae.safetensors``: ComfyUI's Wan 2.1 VAE class (``comfy.ldm.wan.vae.WanVAE``)
  at dim 8 instead of 96: comfy/sd.py reads the width from ``decoder.head.0.gamma`` (both versions), and
  the 16 latent channels and 8x spatial / 4x temporal scale stay Wan 2.1's; 0.9 M parameters.

What cannot be tiny: the text encoder. ``CLIPLoader`` type ``wan`` builds umT5-XXL from a fixed config
(comfy/text_encoders/wan.py, 5.7 B parameters), so the tests give the workflow's two prompts 4096-wide
conditioning from a test-only node instead (devtools/stand_ins.py).
"""

from __future__ import annotations

import math

import tiny_dits
import tiny_models
import torch
from tiny_weights import Tensors, uniform

GENERATOR = "devtools/tiny_wan.py"
EXPERTS = {"high": "patchbay-wan22-tiny-high-noise", "low": "patchbay-wan22-tiny-low-noise"}
LORAS = {"patchbay-wan-high-noise-r4": "kohya", "patchbay-wan-style-r4": "ai-toolkit"}
VAE_STEM = "patchbay-wan21-tiny-vae"
VAE_DIM = 8  # Wan 2.1's VAE is 96 wide; ComfyUI reads the width from decoder.head.0.gamma
VAE_CONFIG = dict(dim=VAE_DIM, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                  temperal_downsample=[False, True, True], dropout=0.0)  # comfy/sd.py's, Wan 2.1


def expert_rel(variant: str) -> str:
    return f"diffusion_models/{EXPERTS[variant]}.safetensors"


def lora_rel(stem: str) -> str:
    return f"loras/{stem}.safetensors"


def vae_rel() -> str:
    return f"vae/{VAE_STEM}.safetensors"


def all_rels() -> list[str]:
    return [expert_rel(v) for v in EXPERTS] + [lora_rel(s) for s in LORAS] + [vae_rel()]


def _vae_init(key: str, shape: tuple[int, ...], seed: str) -> torch.Tensor:
    """RMS norm gains 1, biases 0, convolutions uniform with std 1/sqrt(fan_in)."""
    if key.endswith(".gamma"):
        return torch.ones(shape, dtype=torch.float16)
    if key.endswith(".bias"):
        return torch.zeros(shape, dtype=torch.float16)
    return uniform(f"{seed}/{key}", shape, 1.0 / math.sqrt(math.prod(shape[1:])))


class WanModels:
    """Builds the files of ``all_rels`` (ComfyUI imported on the CPU, models on the meta device)."""

    def __init__(self) -> None:
        tiny_models.import_comfy_on_cpu()
        self.family = tiny_dits.FAMILIES["wan21"]
        self._expert = None

    def _loaded(self):
        if self._expert is None:  # the LoRA names and shapes come from a loaded expert
            self._expert = tiny_dits.load(self.family, "high")
        return self._expert

    def vae(self) -> Tensors:
        import comfy.ldm.wan.vae

        with torch.device("meta"):
            model = comfy.ldm.wan.vae.WanVAE(**VAE_CONFIG)
        return {key: _vae_init(key, tuple(t.shape), VAE_STEM) for key, t in model.state_dict().items()}

    def build(self, rel: str) -> tuple[Tensors, dict[str, str]]:
        """Tensors and safetensors metadata of the file at ``rel``."""
        for variant, stem in EXPERTS.items():
            if rel == expert_rel(variant):
                tiny_dits.load(self.family, variant)  # refuses a wrong detection or a key mismatch
                return (tiny_dits.state_dict(self.family, variant),
                        tiny_models.model_metadata(stem, "wan-2.2-t2v-14b", GENERATOR))
        for stem, fmt in LORAS.items():
            if rel == lora_rel(stem):
                lora_format = next(f for f in self.family.loras if f.name == fmt)
                tensors = tiny_dits.lora(self.family, self._loaded(), lora_format)
                return tensors, tiny_models.model_metadata(stem, "wan-2.2-t2v-14b/lora", GENERATOR)
        if rel == vae_rel():
            return self.vae(), tiny_models.model_metadata(VAE_STEM, "wan-2.1-vae", GENERATOR)
        raise ValueError(f"{rel} is not made by tiny_wan; it makes {all_rels()}")
