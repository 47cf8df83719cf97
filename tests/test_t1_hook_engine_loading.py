"""T1: the hook engine on lowvram (partial) loading and fp8 weight storage.

The engine never writes weights, so how the weights are streamed does not matter to it. How they
are stored does, in one way: LoraLoader (fully loaded) and core hooks round W + delta to the stored
dtype; the engine adds the delta in the compute dtype unless asked to round like LoraLoader.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import SD15_CHECKPOINT as CKPT
from tiny_models import SD15_LORA as LORA

pytestmark = pytest.mark.t1


@pytest.fixture(scope="module")
def env(comfy, sd15):
    n, model, clip, latent = sd15.nodes, sd15.model, sd15.clip, sd15.latent
    hooks = sd15.lora_hooks()
    pos, neg = sd15.encode("a knight in armor"), sd15.encode("blurry")
    hooked = [sd15.hooked(c, hooks) for c in (pos, neg)]
    he = comfy.pack.hooks.enable

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


@pytest.fixture(scope="module")
def fp8(env):
    """The checkpoint's UNet stored in fp8_e4m3fn (fp32 compute: ComfyUI's manual cast on the CPU), and
    an fp32 clone of the plain model that holds the same fp8-rounded weights."""
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
    return fp8, rounded


def comfyui_run(sample):
    """``sample`` as ComfyUI's executor runs a prompt, in inference mode (full-load LoraLoader's fp8
    rounding refuses tensors that require grad)."""
    def run(*args):
        with torch.inference_mode():
            return sample(*args)
    return run


def effect_fraction(latent, reference, base):
    """|latent - reference| at its largest, as a fraction of the LoRA's largest effect |reference - base|."""
    return ((latent - reference).abs().max() / (reference - base).abs().max()).item()


def test_fp8_weight_storage_adds_the_lora_in_the_compute_dtype(env, fp8):
    """fp8_e4m3fn storage, fp32 compute, rounding "compute" (the default): the engine adds the LoRA's
    delta in fp32 to the fp8 weights, which is what LoraLoader does under lowvram (patches applied at
    cast time) and equals LoraLoader on an fp32 copy of the fp8 weights. Full-load LoraLoader and core
    hooks instead write W + delta back into fp8 (LoraLoader with stochastic rounding, core hooks to the
    nearest value), so their images differ from the engine's by a large part of the LoRA's effect."""
    n, model, clip, plain_conds, hooked, sample, he = env
    sample = comfyui_run(sample)
    fp8_model, rounded = fp8
    baked, _ = n["LoraLoader"]().load_lora(rounded, clip, LORA, 1.0, 0.0)
    expected = sample(baked, plain_conds)
    actual = sample(he.enable_hook_engine(fp8_model), hooked)
    assert_close(actual, expected, "engine on fp8 weights vs LoraLoader on the same weights in fp32")
    base = sample(fp8_model, plain_conds)
    full_load, _ = n["LoraLoader"]().load_lora(fp8_model, clip, LORA, 1.0, 0.0)
    full_load_latent = sample(full_load, plain_conds)
    core = sample(fp8_model, hooked)
    for name, latent in (("full-load LoraLoader", full_load_latent), ("core hooks", core)):
        assert effect_fraction(actual, latent, base) > 0.1, f"{name} no longer rounds to fp8: update the docs"


def test_fp8_rounding_like_loraloader_gives_its_latent_bit_for_bit(env, fp8):
    """rounding "loraloader": each hooked weight is W + delta rounded to fp8 exactly as full-load
    LoraLoader rounds it (``comfy.float.stochastic_rounding`` seeded by the key), and the hooked rows
    are recomputed with that weight, so a hook on every prompt gives full-load LoraLoader's latent
    bit for bit. The model's own weights stay untouched."""
    import comfy.model_management as mm

    n, model, clip, plain_conds, hooked, sample, he = env
    sample = comfyui_run(sample)
    fp8_model = fp8[0]
    before = {k: v.clone() for k, v in fp8_model.model.diffusion_model.state_dict().items()}
    full_load, _ = n["LoraLoader"]().load_lora(fp8_model, clip, LORA, 1.0, 0.0)
    expected = sample(full_load, plain_conds)
    mm.unload_all_models()
    fast = he.enable_hook_engine(fp8_model, rounding="loraloader")
    actual = sample(fast, hooked)
    assert torch.equal(actual, expected), f"max |diff| {(actual - expected).abs().max().item():.3g}"
    assert not torch.equal(sample(he.enable_hook_engine(fp8_model), hooked), expected)
    mm.unload_all_models()
    after = fp8_model.model.diffusion_model.state_dict()
    assert all(torch.equal(after[k].view(torch.uint8), v.view(torch.uint8)) for k, v in before.items()
               if v.dtype == torch.float8_e4m3fn)
    assert he.hook_engine_of(fast).cache.bytes > 0, "the rounded deltas did not go through the cache"


def test_rounding_is_checked(env):
    n, model, clip, plain_conds, hooked, sample, he = env
    with pytest.raises(ValueError, match=r"rounding must be one of \('compute', 'loraloader'\), got 'fp8'"):
        he.enable_hook_engine(model, rounding="fp8")
