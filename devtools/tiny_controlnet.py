"""A tiny SD1.5 ControlNet that ComfyUI's ControlNet loader detects, for the tiny SD1.5 checkpoints.

The T2 tests chain Advanced-ControlNet's and core's ControlNet apply nodes with hooks; no ControlNet
can be downloaded, so this module makes one the way tiny_models makes the checkpoints (weights,
hashing and the manifest are tiny_models'; ``ensure_models`` covers this file too).

``controlnet/patchbay-sd15-tiny-controlnet.safetensors``: ``comfy.cldm.cldm.ControlNet`` built from the
UNet config ComfyUI detects for the tiny checkpoints (tiny_models.TINY_UNET: the zero convs must match
that UNet's input blocks and middle block), a 3-channel hint (an RGB image), keys in the original
``control_model.`` layout of the lllyasviel ``.pth`` files. ComfyUI's ``load_controlnet_state_dict``
detects it through ``model_detection.model_config_from_unet`` as SD15 and builds the same class. The
zero convs are not zero (uniform like every other weight), so the control moves the latent.
"""

from __future__ import annotations

import tiny_models
import torch
from tiny_weights import Tensors

STEM = "patchbay-sd15-tiny-controlnet"
PREFIX = "control_model."
HINT_CHANNELS = 3
GENERATOR = "devtools/tiny_controlnet.py"


def controlnet_rel() -> str:
    return f"controlnet/{STEM}.safetensors"


def all_rels() -> list[str]:
    return [controlnet_rel()]


class ControlNetModels:
    """ComfyUI's ControlNet class on the meta device, configured for the tiny SD1.5 UNet."""

    def __init__(self) -> None:
        tiny_models.import_comfy_on_cpu()
        import comfy.cldm.cldm
        import comfy.model_detection
        import comfy.supported_models

        config = dict(comfy.supported_models.SD15(tiny_models.TINY_UNET).unet_config)
        config.pop("out_channels")  # what comfy.controlnet does with the detected config
        with torch.device("meta"):
            self.model = comfy.cldm.cldm.ControlNet(**config, hint_channels=HINT_CHANNELS)
        layout = {PREFIX + key: value for key, value in self.model.state_dict().items()}
        detected = comfy.model_detection.model_config_from_unet(layout, PREFIX, True)
        if type(detected) is not comfy.supported_models.SD15:
            raise RuntimeError(f"ComfyUI detects the tiny ControlNet as {type(detected).__name__}, not SD15.")

    def build(self, rel: str) -> tuple[Tensors, dict[str, str]]:
        """Tensors and safetensors metadata of the file at ``rel`` (the one ControlNet)."""
        if rel != controlnet_rel():
            raise ValueError(f"{rel} is not made by tiny_controlnet; it makes {controlnet_rel()}")
        tensors = tiny_models.init_module(self.model, PREFIX, f"{STEM}/control")
        return tensors, tiny_models.model_metadata(STEM, "stable-diffusion-v1/controlnet", GENERATOR)
