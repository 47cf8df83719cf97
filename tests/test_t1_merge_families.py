"""T1: ComfyUI's own detection (``comfy.model_detection``) takes each tiny family file for the family the
merge library's table (merge/architectures.py) names.

The tiny files (devtools/tiny_families.py) carry only the keys a family's detection reads; ComfyUI picks
its model config from them without building a model. Two deliberate differences: a tiny Z-Image is
Lumina2 to ComfyUI, which tells them apart by the width alone (dim 3840, too large for a tiny file),
and a ComfyUI older than a family (0.3.75 has no Anima and no LTX-2) takes the file for the family it
derives from. The UNet families are checked on the real tiny SD1.5 checkpoint and SDXL UNet.
"""

from __future__ import annotations

import pytest
import tiny_families as tf
import torch

pytestmark = pytest.mark.t1

# family -> ComfyUI's model config class for it, then the one a ComfyUI without that class picks
COMFY_CLASSES = {
    "sd3": ("SD3",),
    "flux": ("Flux",),
    "flux2": ("Flux2",),
    "chroma": ("Chroma",),
    "hunyuan_video": ("HunyuanVideo",),
    "hunyuan_video15": ("HunyuanVideo15",),
    "hunyuan_image21": ("HunyuanImage21",),
    "ltxv": ("LTXV",),
    "ltxav": ("LTXAV", "LTXV"),
    "cosmos": ("CosmosT2V",),
    "cosmos_predict2": ("CosmosT2IPredict2",),
    "anima": ("Anima", "CosmosT2IPredict2"),
    "lumina2": ("Lumina2",),
    "z_image": ("Lumina2",),  # ComfyUI: ZImage only at dim 3840
    "hidream": ("HiDream",),
    "qwen_image": ("QwenImage",),
    "wan21": ("WAN21_T2V",),
    "wan22_5b": ("WAN22_T2V",),
}


def _comfy_class(state_dict: dict, prefix: str) -> str | None:
    import comfy.model_detection

    config = comfy.model_detection.model_config_from_unet(state_dict, prefix)
    return None if config is None else type(config).__name__


def test_the_expectations_cover_every_module_named_family():
    from merge import architectures

    assert set(COMFY_CLASSES) == {f.id for f in architectures.FAMILIES if not f.unet}


@pytest.mark.parametrize("checkpoint", [False, True], ids=["diffusion-model", "checkpoint"])
def test_comfyui_detects_each_tiny_family_file_as_the_table_says(comfy, checkpoint):
    import comfy.supported_models

    from merge import io

    prefix = "model.diffusion_model." if checkpoint else ""
    for family, classes in COMFY_CLASSES.items():
        state_dict = tf.state_dict(family, checkpoint=checkpoint)
        infos = {k: io.TensorInfo("F16", tuple(t.shape), 0, 0) for k, t in state_dict.items()}
        assert io.detect_architecture(infos) == (family, not checkpoint)
        expected = next(c for c in classes if hasattr(comfy.supported_models, c))
        assert _comfy_class(state_dict, prefix) == expected, family
    assert _comfy_class(tf.state_dict("unknown"), "") is None


def test_comfyui_and_the_table_agree_on_the_tiny_unets(comfy, models):
    from merge import io

    files = {
        "sd15": models.checkpoints["patchbay-sd15-tiny-a"],
        "sdxl": models.root / "diffusion_models" / "patchbay-sdxl-tiny.safetensors",
    }
    for family, path in files.items():
        opened = io.SafetensorsFile(path)
        assert opened.arch == family
        prefix = "" if opened.unet_only else "model.diffusion_model."
        meta = {
            k: torch.empty(info.shape, dtype=info.torch_dtype, device="meta")
            for k, info in opened.tensors.items()
            if k.startswith(prefix)
        }
        assert _comfy_class(meta, prefix) in {"sd15": ("SD15",), "sdxl": ("SDXL", "KOALA_700M")}[family]
