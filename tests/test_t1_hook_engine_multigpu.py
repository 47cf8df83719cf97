"""T1: Fast Hooks on ComfyUI's multi-GPU work units (0.33+), with two devices emulated on the CPU.

ComfyUI 0.33's MultiGPU node (``comfy.multigpu.create_multigpu_deepclones``) gives the model a copy of
itself per extra device; ``_calc_cond_batch_multigpu`` then spreads the conds of each step over the
devices, each running its own copy's ``apply_model`` in a worker thread. The emulation is core's own
code with one change: ``get_all_torch_devices`` lists ``cpu`` and ``cpu:1`` (a distinct device key
whose tensors live on the CPU; ``set_torch_device`` does nothing for CPU devices). ComfyUI 0.3.75
has no multi-GPU sampling.
"""

from __future__ import annotations

import sys

import pytest
import torch

pytestmark = pytest.mark.t1

CKPT = "patchbay-sd15-tiny-a.safetensors"
LORA = "patchbay-lora-r4.safetensors"


@pytest.fixture(scope="module")
def two_devices(comfy):
    import comfy.model_management as mm

    if not hasattr(sys.modules["comfy.samplers"], "_calc_cond_batch_multigpu"):
        yield None
        return
    devices = [torch.device("cpu"), torch.device("cpu", 1)]
    original = mm.get_all_torch_devices
    mm.get_all_torch_devices = lambda exclude_current=False: devices[1:] if exclude_current else devices
    yield devices
    mm.get_all_torch_devices = original


def test_lora_hooks_apply_on_every_device_copy(comfy, two_devices):
    import comfy.model_management as mm
    import comfy.samplers as samplers

    if two_devices is None:  # ComfyUI 0.3.75: nothing to cover
        assert "comfy.multigpu" not in sys.modules and not hasattr(samplers, "_calc_cond_batch_multigpu")
        return
    import comfy.multigpu as multigpu

    n = comfy.nodes.NODE_CLASS_MAPPINGS
    he = comfy.pack.hooks.enable
    model, clip, _ = n["CheckpointLoaderSimple"]().load_checkpoint(CKPT)
    encode = n["CLIPTextEncode"]().encode
    (hooks,) = n["CreateHookLora"]().create_hook(LORA, 1.0, 1.0)
    props = n["ConditioningSetProperties"]()
    plain = encode(clip, "a knight in armor")[0], encode(clip, "blurry")[0]
    hooked = [props.set_properties(c, 1.0, "default", hooks=hooks)[0] for c in plain]
    (latent,) = n["EmptyLatentImage"]().generate(64, 64, 1)

    def sample(m, conds):
        (out,) = n["KSampler"]().sample(m, 5, 3, 7.0, "euler", "normal", *conds, latent)
        mm.unload_all_models()
        return out["samples"]

    baked, _ = n["LoraLoader"]().load_lora(model, clip, LORA, 1.0, 0.0)
    expected = sample(baked, plain)
    fast = multigpu.create_multigpu_deepclones(he.enable_hook_engine(model), 2)
    copies = fast.get_additional_models_with_key("multigpu")
    assert [c.load_device for c in copies] == [two_devices[1]] and copies[0].model is not fast.model

    seen = []
    original = samplers._calc_cond_batch_multigpu

    def spy(m, conds, x_in, timestep, model_options):
        seen.append(sorted(str(d) for d in model_options["multigpu_clones"]))
        return original(m, conds, x_in, timestep, model_options)

    samplers._calc_cond_batch_multigpu = spy
    try:
        actual = sample(fast, hooked)
    finally:
        samplers._calc_cond_batch_multigpu = original
    assert seen and seen[0] == ["cpu", "cpu:1"], "core did not sample on the two emulated devices"
    tolerance = 1e-4 * expected.abs().max().item()
    assert (actual - expected).abs().max().item() <= tolerance, "a device copy sampled without the LoRA"
    assert not any(m._forward_hooks for c in copies for m in c.model.modules()), "forward hooks left behind"
