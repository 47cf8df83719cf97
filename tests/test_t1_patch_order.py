"""T1: patch order on Patchbay's patcher in a real ComfyUI: which of object and weight patches comes first.

The object patch here is a plain wrapper module around the UNet: it hides the UNet's modules behind
``.inner.`` exactly as ``torch.compile``'s OptimizedModule hides them behind ``._orig_mod.``, without
the cost of compiling (tests/test_t1_compile.py does the real thing).
"""

from __future__ import annotations

import importlib
from dataclasses import astuple

import pytest
import torch

pytestmark = pytest.mark.t1

CKPT = "patchbay-sd15-tiny-a.safetensors"
LORA = "patchbay-lora-r4.safetensors"
KEY = "input_blocks.1.1.proj_in.weight"  # a UNet weight the LoRA patches


class Wrapper(torch.nn.Module):
    """Stands in for a compiled module (torch's OptimizedModule): same forward, the original one level
    down in the module tree, its attributes reachable through the wrapper."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


@pytest.fixture(scope="module")
def mp(comfy):
    return importlib.import_module(f"{comfy.pack.__name__}.patcher.model_patcher")


@pytest.fixture(scope="module")
def setup(comfy):
    import comfy.model_management as mm

    n = comfy.nodes.NODE_CLASS_MAPPINGS
    model, _clip, _vae = n["CheckpointLoaderSimple"]().load_checkpoint(CKPT)
    (lora,) = n["LoraLoaderModelOnly"]().load_lora_model_only(model, LORA, 1.0)
    unet = model.get_model_object("diffusion_model")
    assert f"diffusion_model.{KEY}" in lora.patches
    yield model, lora, unet
    mm.unload_all_models()


def loaded_weight(patcher, unet: torch.nn.Module) -> torch.Tensor:
    """The UNet weight at KEY after ComfyUI loads ``patcher`` afresh (as sampling does)."""
    import comfy.model_management as mm

    mm.unload_all_models()
    mm.load_models_gpu([patcher])
    return unet.get_parameter(KEY).detach().clone()


def wrapped(patcher, unet: torch.nn.Module):
    clone = patcher.clone()
    clone.add_object_patch("diffusion_model", Wrapper(unet))
    return clone


@pytest.fixture(scope="module")
def weights(setup):
    model, lora, unet = setup
    return loaded_weight(model, unet), loaded_weight(lora, unet)


def test_core_order_skips_the_lora_under_an_object_patch(setup, weights):
    _model, lora, unet = setup
    plain, with_lora = weights
    assert not torch.equal(plain, with_lora), "the LoRA does not touch KEY"
    assert torch.equal(loaded_weight(wrapped(lora, unet), unet), plain), "core now patches through wrappers"


def test_object_patch_first_keeps_core_behaviour(setup, weights, mp):
    _model, lora, unet = setup
    ours = wrapped(mp.set_patch_order(lora, "object_patch_first"), unet)
    assert torch.equal(loaded_weight(ours, unet), weights[0])


def test_weight_patch_first_patches_wrapped_weights_then_installs_the_object_patch(setup, weights, mp):
    model, lora, unet = setup
    ours = wrapped(mp.set_patch_order(lora, "weight_patch_first"), unet)
    assert torch.equal(loaded_weight(ours, unet), weights[1])
    assert isinstance(model.model.diffusion_model, Wrapper), "the object patch is not installed after loading"
    assert model.model.diffusion_model.inner is unet


def test_partial_unload_and_reload_patch_the_lora_once(setup, weights, mp):
    """lowvram: unloading must find the backups by the model's own names, or a reload doubles the LoRA."""
    _model, lora, unet = setup
    ours = wrapped(mp.set_patch_order(lora, "weight_patch_first"), unet)
    assert torch.equal(loaded_weight(ours, unet), weights[1])
    ours.partially_unload(ours.offload_device, memory_to_free=10**15)
    assert torch.equal(unet.get_parameter(KEY), weights[0]), "unloading did not restore the weight"
    ours.partially_load(ours.load_device, extra_memory=10**15)
    assert torch.equal(unet.get_parameter(KEY), weights[1])


def test_switching_order_on_a_loaded_model_repatches_it(comfy, setup, weights, mp):
    import comfy.model_management as mm

    _model, lora, unet = setup
    core = wrapped(lora, unet)
    assert torch.equal(loaded_weight(core, unet), weights[0])
    switched = mp.set_patch_order(core, "weight_patch_first")  # no unload in between
    mm.load_models_gpu([switched])
    assert torch.equal(unet.get_parameter(KEY), weights[1])


def test_lora_loader_on_a_model_with_installed_object_patch(comfy, setup, mp):
    """While the wrapped model is loaded, core's LoraLoader sees ``.inner.`` keys and loads none."""
    import comfy.model_management as mm

    model, _lora, unet = setup
    n = comfy.nodes.NODE_CLASS_MAPPINGS
    ours = wrapped(mp.set_patch_order(model, "weight_patch_first"), unet)
    mm.unload_all_models()
    mm.load_models_gpu([ours])
    assert model.object_patches_backup, "the object patch should be installed now"
    (core_lora,) = n["LoraLoaderModelOnly"]().load_lora_model_only(model, LORA, 1.0)
    (our_lora,) = n["LoraLoaderModelOnly"]().load_lora_model_only(ours, LORA, 1.0)
    assert len(core_lora.patches) == 0
    assert f"diffusion_model.{KEY}" in our_lora.patches and len(our_lora.patches) == 84
    mm.unload_all_models()


@pytest.mark.parametrize(("mode", "expected"), [("auto", True), ("enabled", True), ("disabled", False)])
def test_full_load_reaches_core_load(comfy, setup, mp, mode, expected):
    from comfy.patcher_extension import CallbacksMP

    model, _lora, unet = setup
    ours = mp.set_patch_order(model, "object_patch_first", mode)
    seen = []
    ours.add_callback(CallbacksMP.ON_LOAD, lambda _patcher, *args: seen.append(args[-1]))
    loaded_weight(ours, unet)  # on the CPU core asks for a full load (budget 1e32)
    ours.unpatch_model()
    ours.patch_model(lowvram_model_memory=0)  # the direct path: core would say full_load=True
    ours.unpatch_model()
    assert seen == [expected, expected]


@pytest.mark.parametrize("source", ["checkpoint", "gguf"])
def test_full_load_found_by_name_however_load_is_called(comfy, setup, mp, source):
    """The override finds full_load by core's signature (patcher/calls.py), passed by position or by
    keyword, also through ComfyUI-GGUF's load, which takes ``*args`` and passes them on to core's."""
    import gguf_sampling
    from comfy.model_patcher import ModelPatcher
    from comfy.patcher_extension import CallbacksMP

    if source == "gguf":
        gguf_sampling.load_comfyui_gguf()
        model = gguf_sampling.shared_gguf("sd15", "Q8_0")
        assert type(model).load is not ModelPatcher.load  # GGUF's own override
    else:
        model = setup[0]
    ours = mp.set_patch_order(model, "object_patch_first", "enabled")
    seen = []
    ours.add_callback(CallbacksMP.ON_LOAD, lambda _patcher, *args: seen.append(args[-1]))
    cpu = torch.device("cpu")
    calls = [((cpu,), {"full_load": False}), ((cpu,), {})]
    # by position up to full_load (ComfyUI-GGUF's own load refuses force_patch_weights by position)
    calls.append(((cpu, 0), {"force_patch_weights": False, "full_load": False}) if source == "gguf"
                 else ((cpu, 0, False, False), {}))
    for args, kwargs in calls:
        ours.load(*args, **kwargs)
        ours.unpatch_model()
    assert seen == [True, True, True]  # "enabled" replaced the caller's False each time


def test_set_patch_order_leaves_the_input_alone(setup, mp):
    model, lora, _unet = setup
    before = (type(lora), lora.patches_uuid, dict(lora.attachments), dict(lora.object_patches))
    ours = mp.set_patch_order(lora, "weight_patch_first", "enabled")
    assert ours is not lora and mp.is_upgraded(ours) and not mp.is_upgraded(lora)
    assert (type(lora), lora.patches_uuid, dict(lora.attachments), dict(lora.object_patches)) == before
    assert astuple(ours.patchbay.order) == ("weight_patch_first", "enabled")
    assert ours.patches_uuid != lora.patches_uuid, "a changed order must re-patch a loaded model"
    again = mp.set_patch_order(ours, "weight_patch_first", "enabled")
    assert again.patches_uuid == ours.patches_uuid, "the same order must not force a reload"
    assert again.clone().patchbay.order.patch_order == "weight_patch_first", "the order must survive clone()"


@pytest.mark.parametrize(("args", "message"), [
    (("weights_first", "auto"), r"patch_order='weights_first'.*did you mean 'weight_patch_first'.*"
                                r"object_patch_first, weight_patch_first"),
    (("weight_patch_first", "on"), r"full_load='on'.*auto, enabled, disabled"),
])
def test_bad_options_name_the_allowed_values(comfy, setup, mp, args, message):
    errors = importlib.import_module(f"{comfy.pack.__name__}.patcher.patch_order")
    with pytest.raises(errors.PatchOrderError, match=message):
        mp.set_patch_order(setup[0], *args)


def test_patch_order_node(comfy, setup):
    node = comfy.pack.NODE_CLASS_MAPPINGS["PatchbayPatchOrder"]  # a V3 node: execute is a classmethod
    (out,) = node.execute(setup[1], "weight_patch_first", "disabled")
    assert astuple(out.patchbay.order) == ("weight_patch_first", "disabled")
    assert out.patches == setup[1].patches
    with pytest.raises(ValueError, match="full_load='always'"):
        node.execute(setup[1], "weight_patch_first", "always")
    with pytest.raises(TypeError, match="connect the MODEL output"):
        node.execute("not a model", "weight_patch_first", "auto")
