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


def test_the_expectations_cover_every_module_named_family(merge_library):
    assert set(COMFY_CLASSES) == {f.id for f in merge_library.architectures.FAMILIES if not f.unet}


@pytest.mark.parametrize("checkpoint", [False, True], ids=["diffusion-model", "checkpoint"])
def test_comfyui_detects_each_tiny_family_file_as_the_table_says(comfy, merge_library, checkpoint):
    io = merge_library.io
    import comfy.supported_models

    prefix = "model.diffusion_model." if checkpoint else ""
    for family, classes in COMFY_CLASSES.items():
        state_dict = tf.state_dict(family, checkpoint=checkpoint)
        infos = {k: io.TensorInfo("F16", tuple(t.shape), 0, 0) for k, t in state_dict.items()}
        assert io.detect_architecture(infos) == (family, not checkpoint)
        expected = next(c for c in classes if hasattr(comfy.supported_models, c))
        assert _comfy_class(state_dict, prefix) == expected, family
    assert _comfy_class(tf.state_dict("unknown"), "") is None


def test_comfyui_and_the_table_agree_on_the_tiny_unets(merge_library, models):
    io = merge_library.io

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


@pytest.mark.once
def test_the_merge_nodes_take_the_architecture_policy(comfy, tmp_path, monkeypatch):
    """Merge, Save Merge, Extract LoRA and Recipe Hook refuse inputs of two families unless their
    architecture_policy input says allow. The nodes pass the option to the library and load no model, so
    the answer is the same on every ComfyUI version."""
    from pathlib import Path

    pack, paths = comfy.pack, comfy.folder_paths
    folder, loras = tmp_path / "ckpts", tmp_path / "loras"
    folder.mkdir()
    loras.mkdir()
    tf.write(folder / "pb-wan.safetensors", "wan21", 2, seed=1)
    tf.write(folder / "pb-ltxv.safetensors", "ltxv", 2, seed=2)
    paths.add_model_folder_path("checkpoints", str(folder))
    extensions = paths.folder_names_and_paths["loras"][1]
    monkeypatch.setitem(paths.folder_names_and_paths, "loras", ([str(loras)], extensions))
    R = pack.merge.recipe

    def node(node_id):
        return pack.NODE_CLASS_MAPPINGS[node_id]()

    refused = r"pb-ltxv.safetensors: is a ltxv model but pb-wan.safetensors is wan21.*policy input"
    try:
        paths.filename_list_cache.pop("checkpoints", None)
        a, b = (R.model(f"checkpoints/pb-{n}.safetensors") for n in ("wan", "ltxv"))
        for node_id in ("PatchbayMerge", "PatchbayMergeSave", "PatchbayMergeExtractLora",
                        "PatchbayRecipeHook"):
            kind, options = node(node_id).INPUT_TYPES()["optional"]["architecture_policy"]
            assert kind == "COMBO" and options["options"] == ["refuse", "allow"], node_id  # a V3 combo
            assert options["default"] == "refuse", node_id
        with pytest.raises(ValueError, match=refused):
            node("PatchbayMerge").merge(R.weighted_sum(a, b, alpha=0.5))
        save, out = node("PatchbayMergeSave"), Path(paths.get_output_directory()) / "checkpoints"
        with pytest.raises(ValueError, match=refused):
            save.save(R.weighted_sum(a, b, alpha=0.5), "checkpoints/pb-policy")
        assert not list(out.glob("pb-policy*"))
        shown = save.save(R.weighted_sum(a, b, alpha=0.5), "checkpoints/pb-policy",
                          architecture_policy="allow")
        assert Path(shown["result"][0]).exists() and "merged key by key" in " ".join(shown["ui"]["text"])
        extract = node("PatchbayMergeExtractLora")
        with pytest.raises(ValueError, match=refused):
            extract.extract(R.subtract(a, b), "pb-policy", rank=2)
        assert not list(loras.iterdir())
        shown = extract.extract(R.subtract(a, b), "pb-policy", rank=2, architecture_policy="allow")
        assert (loras / "pb-policy.safetensors").exists()
        assert "merged key by key" in " ".join(shown["ui"]["text"])
        hook = node("PatchbayRecipeHook")
        with pytest.raises(ValueError, match=refused):
            hook.create(R.subtract(a, b))
        assert len(hook.create(R.subtract(a, b), architecture_policy="allow")[0].hooks) == 1
    finally:
        paths.folder_names_and_paths["checkpoints"][0].remove(str(folder))
        paths.filename_list_cache.pop("checkpoints", None)
