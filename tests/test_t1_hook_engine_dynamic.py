"""T1: Fast Hooks under ComfyUI's dynamic VRAM, emulated on the CPU the way core decides.

On ComfyUI 0.33 ``main.py`` makes ``ModelPatcherDynamic`` the default patcher whenever comfy-aimdo
starts (NVIDIA GPUs), and ``CFGGuider.inner_set_conds`` swaps a patcher whose ``is_dynamic()`` is True
for its ``get_non_dynamic_delegate()`` as soon as a cond carries hooks: a plain ModelPatcher with the
checkpoint loaded again from disk (``cached_patcher_init``). Core decides by ``is_dynamic()`` alone, so
the emulation is a patcher class whose ``is_dynamic()`` returns True and whose delegate is core's own
``ModelPatcherDynamic.get_non_dynamic_delegate`` (only the GPU-only parts of ModelPatcherDynamic, its
aimdo buffers, are left out). ComfyUI 0.3.75 has no dynamic VRAM and never swaps.
"""

from __future__ import annotations

import types

import pytest
import torch
from tiny_models import SD15_LORA

pytestmark = pytest.mark.t1


@pytest.fixture(scope="module")
def rig(comfy, sd15):
    import comfy.model_patcher as model_patcher

    n = comfy.nodes.NODE_CLASS_MAPPINGS
    dynamic_class = getattr(model_patcher, "ModelPatcherDynamic", None)  # ComfyUI 0.33+
    core_delegate = getattr(dynamic_class, "get_non_dynamic_delegate", None)

    class EmulatedDynamic(model_patcher.ModelPatcher):
        non_dynamic_delegate_model = None
        dynamic = True

        def is_dynamic(self):
            return self.dynamic

        if core_delegate is not None:
            get_non_dynamic_delegate = core_delegate

    model, clip, hooks = sd15.model, sd15.clip, sd15.lora_hooks()
    plain = sd15.encode("a knight in armor"), sd15.encode("blurry")
    hooked = [sd15.hooked(c, hooks) for c in plain]
    he = comfy.pack.hooks.enable
    mp = comfy.pack.patcher.model_patcher
    return types.SimpleNamespace(n=n, model=model, clip=clip, plain=plain, hooked=hooked, he=he, mp=mp,
                                 emulated=EmulatedDynamic, has_delegate=core_delegate is not None)


def dynamic_fast(rig, loads: list):
    """A Fast Hooks model whose patcher reports itself dynamic; ``loads`` counts checkpoint reloads."""
    model = rig.model.clone()
    model.__class__ = rig.emulated
    init = getattr(model, "cached_patcher_init", None)
    if init is not None:  # ComfyUI 0.33: how the delegate reloads the checkpoint
        def counted(*args, **kwargs):
            loads.append(kwargs)
            return init[0](*args, **kwargs)
        model.cached_patcher_init = (counted, *init[1:])
    fast = rig.he.enable_hook_engine(model)
    assert fast.is_dynamic() and isinstance(fast, rig.emulated)
    return fast


def sample(rig, model, conds):
    (latent,) = rig.n["EmptyLatentImage"]().generate(64, 64, 1)
    (out,) = rig.n["KSampler"]().sample(model, 5, 3, 7.0, "euler", "normal", *conds, latent)
    return out["samples"]


def test_a_dynamic_model_stays_on_the_engine_with_no_second_load(rig):
    import comfy.model_management as mm
    import comfy.samplers

    loads: list = []
    fast = dynamic_fast(rig, loads)
    guider = comfy.samplers.CFGGuider(fast)
    guider.set_conds(*rig.hooked)  # where 0.33 swaps in the non-dynamic delegate
    assert guider.model_patcher is fast and guider.model_patcher.model is rig.model.model
    assert loads == [], "the checkpoint was loaded a second time"

    # The hooks are claimed by the engine on the dynamic patcher: none becomes a core hook patch.
    import comfy.hooks

    group = rig.hooked[0][0][1]["hooks"]
    options = {"transformer_options": {}}
    target = {"target": comfy.hooks.EnumWeightTarget.Model}
    registered = fast.register_all_hook_patches(group, target, options)
    assert set(registered.hooks) == set(group.hooks) and not fast.hook_patches
    plans = rig.he.hook_engine_of(fast).plans_built

    # Sampling (the aimdo-only loading steps of a real dynamic patcher cannot run on a CPU) equals
    # LoraLoader, through the engine.
    fast.dynamic = False
    baked, _ = rig.n["LoraLoader"]().load_lora(rig.model, rig.clip, SD15_LORA, 1.0, 0.0)
    expected = sample(rig, baked, rig.plain)
    mm.unload_all_models()
    actual = sample(rig, fast, rig.hooked)
    mm.unload_all_models()
    tolerance = 1e-4 * expected.abs().max().item()
    assert (actual - expected).abs().max().item() <= tolerance
    assert rig.he.hook_engine_of(fast).plans_built == plans, "the run did not reuse the engine's plan"


def test_hooks_only_core_can_run_on_a_dynamic_model_are_refused_with_the_fix(rig):
    """A hook the engine hands to core (a nested patch list) cannot run on a dynamic patcher, whose
    own hook path raises a bare RuntimeError mid-sampling on 0.33: refused at registration instead."""
    import comfy.hooks

    fast = dynamic_fast(rig, [])
    hook = comfy.hooks.WeightHook()
    key = next(k for k in rig.model.model.state_dict() if k.endswith("attn2.to_k.weight"))
    weight = rig.model.model.state_dict()[key]
    hook.weights = {key: [("diff", (torch.zeros_like(weight),))]}  # nested: core's path only
    hook.need_weight_init = False
    group = comfy.hooks.HookGroup()
    group.add(hook)
    target = {"target": comfy.hooks.EnumWeightTarget.Model}
    with pytest.raises(rig.mp.DynamicHookError, match=r"--disable-dynamic-vram, or remove the Fast Hooks"):
        fast.register_all_hook_patches(group, target, {"transformer_options": {}})
    assert not fast.hook_patches


def test_where_the_delegate_is_needed_it_keeps_patchbay_and_the_engine(rig):
    """On a model compiled through an object patch (not by TorchCompileModel) the engine leaves hooks to
    core, whose hook path needs the delegate; the delegate then keeps Patchbay's patcher class, the
    engine and its wrappers."""
    import comfy.model_patcher
    import comfy.samplers
    from comfy.patcher_extension import WrappersMP

    loads: list = []
    fast = dynamic_fast(rig, loads)
    fast.add_object_patch("diffusion_model", torch.compile(fast.get_model_object("diffusion_model")))
    # (compiled lazily: nothing here calls it)
    assert not rig.he.hook_engine_of(fast).runs_hooks_on(fast)
    guider = comfy.samplers.CFGGuider(fast)
    guider.set_conds(*rig.hooked)
    delegate = guider.model_patcher
    if not rig.has_delegate:  # ComfyUI 0.3.75: no dynamic VRAM, nothing is swapped
        assert delegate is fast and not hasattr(comfy.model_patcher, "ModelPatcherDynamic")
        return
    assert delegate is not fast and not delegate.is_dynamic() and len(loads) == 1
    assert rig.mp.is_upgraded(delegate)
    assert rig.he.hook_engine_of(delegate) is rig.he.hook_engine_of(fast)
    assert rig.he.WRAPPER_KEY in delegate.wrappers[WrappersMP.APPLY_MODEL]
