"""T1: the hook engine where core hooks fail: lowvram (partial) loading and fp8 weight storage.

The engine never writes weights, so how the weights are stored or streamed does not matter to it.
References are LoraLoader results on an fp32, fully loaded model with the same (rounded) weights.
"""

from __future__ import annotations

import sys

import pytest
import torch

pytestmark = pytest.mark.t1

CKPT = "patchbay-sd15-tiny-a.safetensors"
LORA = "patchbay-lora-r4.safetensors"


@pytest.fixture(scope="module")
def env(comfy):
    n = comfy.nodes.NODE_CLASS_MAPPINGS
    model, clip, _ = n["CheckpointLoaderSimple"]().load_checkpoint(CKPT)
    encode = n["CLIPTextEncode"]().encode
    (hooks,) = n["CreateHookLora"]().create_hook(LORA, 1.0, 1.0)
    props = n["ConditioningSetProperties"]()
    pos, neg = encode(clip, "a knight in armor")[0], encode(clip, "blurry")[0]
    hooked = [props.set_properties(c, 1.0, "default", hooks=hooks)[0] for c in (pos, neg)]
    (latent,) = n["EmptyLatentImage"]().generate(64, 64, 1)
    he = sys.modules[comfy.pack.__name__ + ".patcher.hook_engine"]

    def sample(model, conds):
        (out,) = n["KSampler"]().sample(model, 5, 3, 7.0, "euler", "normal", *conds, latent)
        return out["samples"]

    return n, model, clip, (pos, neg), hooked, sample, he


def assert_close(actual, expected, what):
    tolerance = 1e-4 * expected.abs().max().item()
    diff = (actual - expected).abs().max().item()
    assert diff <= tolerance, f"{what}: max |diff| {diff:.3g} > {tolerance:.3g}"


def test_lowvram_partial_loading(env, monkeypatch):
    """ComfyUI's own lowvram path (what a small GPU gets), taken on the CPU: NO_VRAM and a load device
    ComfyUI does not treat as the CPU, so every layer is cast on the fly (comfy_cast_weights)."""
    import comfy.model_management as mm

    n, model, clip, plain_conds, hooked, sample, he = env
    baked, _ = n["LoraLoader"]().load_lora(model, clip, LORA, 1.0, 0.0)
    mm.unload_all_models()
    expected = sample(baked, plain_conds)
    fast = he.enable_hook_engine(model)
    mm.unload_all_models()
    monkeypatch.setattr(mm, "vram_state", mm.VRAMState.NO_VRAM)
    monkeypatch.setattr(mm, "is_device_cpu", lambda device: False)
    actual = sample(fast, hooked)
    assert getattr(fast.model, "model_lowvram", False), "the model was not partially loaded"
    monkeypatch.undo()
    mm.unload_all_models()
    assert_close(actual, expected, "engine under lowvram vs LoraLoader fully loaded")


def test_fp8_weight_storage_with_manual_cast(env):
    """fp8_e4m3fn storage, fp32 compute: the engine equals LoraLoader on an fp32 copy of the rounded
    weights; core hooks write W + delta back into fp8 and lose most of the LoRA's precision."""
    import comfy.sd
    import folder_paths

    n, model, clip, plain_conds, hooked, sample, he = env
    path = folder_paths.get_full_path("checkpoints", CKPT)
    fp8 = comfy.sd.load_checkpoint_guess_config(path, output_vae=False, output_clip=False,
                                                model_options={"dtype": torch.float8_e4m3fn})[0]
    rounded = model.clone()
    sd = fp8.model.diffusion_model.state_dict()
    for key, value in sd.items():
        if value.dtype == torch.float8_e4m3fn:
            rounded.add_object_patch(f"diffusion_model.{key}", torch.nn.Parameter(value.float(), False))
    assert any(v.dtype == torch.float8_e4m3fn for v in sd.values())
    baked, _ = n["LoraLoader"]().load_lora(rounded, clip, LORA, 1.0, 0.0)
    expected = sample(baked, plain_conds)
    actual = sample(he.enable_hook_engine(fp8), hooked)
    assert_close(actual, expected, "engine on fp8 weights vs LoraLoader on the same weights in fp32")
    core = sample(fp8, hooked)
    assert (core - expected).abs().max() > 10 * 1e-4 * expected.abs().max(), "core hooks are exact on fp8"
