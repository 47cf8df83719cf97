"""T1: the extension points AnimateDiff-Evolved and Advanced-ControlNet use keep working on our subclass.

One scenario mimics how those packs register (see their model_injection.py, sampling.py,
control_reference.py): an attachment with ``on_model_patcher_clone``, an additional motion model
with its own ON_LOAD / ON_PRE_RUN / ON_CLEANUP callbacks, a PatcherInjection, keyed OUTER_SAMPLE and
CALC_COND_BATCH wrappers on the patcher, APPLY_MODEL / DIFFUSION_MODEL / PREPARE_SAMPLING wrappers in
model_options, and a WrapperHook plus a hooked-only TransformerOptionsHook on a cond. Our registry
wrapper, step listener and trace are active at the same time. The model is cloned (as every node
does), sampled twice and unloaded; each registration must run the expected number of times, see
what it expects, and leave nothing behind.
"""

from __future__ import annotations

import importlib
import types
from collections import Counter

import pytest
import torch

pytestmark = pytest.mark.t1

CKPT = "patchbay-sd15-tiny-a.safetensors"
STEPS = 2
RUNS = 2


@pytest.fixture(scope="module")
def pb(comfy):
    name = comfy.pack.__name__
    modules = ("registry", "events", "trace", "model_patcher")
    return types.SimpleNamespace(**{m: importlib.import_module(f"{name}.patcher.{m}") for m in modules})


class MotionParams:
    """Like ADE's InjectionParams attachment: copied through on_model_patcher_clone."""

    def __init__(self, counts: Counter, generation: int = 0) -> None:
        self.counts, self.generation = counts, generation

    def on_model_patcher_clone(self) -> MotionParams:
        self.counts["attachment_clone"] += 1
        return MotionParams(self.counts, self.generation + 1)


def ade_like(model, counts: Counter, seen: dict) -> None:
    """Register on ``model`` what AnimateDiff-Evolved registers (same APIs, same argument access)."""
    import comfy.model_management
    import comfy.patcher_extension as ext
    from comfy.model_patcher import ModelPatcher

    def counter(name):
        def callback(*args):
            counts[name] += 1
        return callback

    model.set_attachments("ADE_params", MotionParams(counts))
    motion = ModelPatcher(torch.nn.Linear(4, 4), comfy.model_management.get_torch_device(), "cpu")
    for kind, name in ((ext.CallbacksMP.ON_LOAD, "motion_load"),
                       (ext.CallbacksMP.ON_PRE_RUN, "motion_pre_run"),
                       (ext.CallbacksMP.ON_CLEANUP, "motion_cleanup")):
        motion.add_callback_with_key(kind, "ADE", counter(name))
    model.set_additional_models("ADE", [motion])

    def inject(patcher):
        seen.setdefault("injection", []).append("inject")
        assert not getattr(patcher.model, "ade_injected", False), "inject called twice without eject"
        patcher.model.ade_injected = True

    def eject(patcher):
        seen.setdefault("injection", []).append("eject")
        patcher.model.ade_injected = False

    model.set_injections("ADE", [ext.PatcherInjection(inject=inject, eject=eject)])

    def outer_sample(executor, *args, **kwargs):
        guider = executor.class_obj
        counts["ade_outer_sample"] += 1
        seen["outer_patcher"] = guider.model_patcher
        seen["outer_conds"] = sorted(guider.conds)
        seen["outer_options"] = guider.model_options is not None
        for motion_model in guider.model_patcher.get_additional_models_with_key("ADE"):
            motion_model.pre_run()  # ADE's helper runs its motion models' pre_run itself
        return executor(*args, **kwargs)

    def calc_cond_batch(executor, model_base, conds, x_in, timestep, model_options):
        counts["ade_calc_cond_batch"] += 1
        seen.setdefault("calc_conds", set()).add(len(conds))
        return executor(model_base, conds, x_in, timestep, model_options)

    def apply_model(executor, *args, **kwargs):
        transformer_options = args[5]  # ADE reads it positionally
        counts["ade_apply_model"] += 1
        seen.setdefault("apply_keys", set()).update(
            k for k in ("cond_or_uncond", "sigmas", "sample_sigmas", "uuids") if k in transformer_options)
        return executor(*args, **kwargs)

    def prepare_sampling(executor, patcher, noise_shape, *args, **kwargs):
        counts["ade_prepare_sampling"] += 1
        seen["prepare_patcher"] = patcher
        return executor(patcher, noise_shape, *args, **kwargs)

    model.remove_wrappers_with_key(ext.WrappersMP.OUTER_SAMPLE, "ADE")  # ADE's setters: remove, then add
    model.add_wrapper_with_key(ext.WrappersMP.OUTER_SAMPLE, "ADE", outer_sample)
    model.remove_wrappers_with_key(ext.WrappersMP.CALC_COND_BATCH, "ADE")
    model.add_wrapper_with_key(ext.WrappersMP.CALC_COND_BATCH, "ADE", calc_cond_batch)
    ext.add_wrapper_with_key(ext.WrappersMP.APPLY_MODEL, "ADE_special_model_apply_model", apply_model,
                             model.model_options, is_model_options=True)
    ext.add_wrapper_with_key(ext.WrappersMP.PREPARE_SAMPLING, "ADE_prepare_sampling", prepare_sampling,
                             model.model_options, is_model_options=True)
    for kind, name in ((ext.CallbacksMP.ON_LOAD, "load"), (ext.CallbacksMP.ON_PRE_RUN, "pre_run"),
                       (ext.CallbacksMP.ON_CLEANUP, "cleanup")):
        model.add_callback_with_key(kind, "ADE", counter(name))


def acn_like(model, counts: Counter, seen: dict):
    """Register what Advanced-ControlNet registers; returns the HookGroup to put on a cond."""
    import comfy.hooks
    import comfy.patcher_extension as ext

    def diffusion_model(executor, x, *args, **kwargs):
        control, transformer_options = args[3], args[4]  # ACN: x apart, control at 3, options at 4
        counts["acn_diffusion_model"] += 1
        seen.setdefault("control", set()).add(control is None)
        seen.setdefault("dm_cond_or_uncond", []).append(tuple(transformer_options["cond_or_uncond"]))
        return executor(x, *args, **kwargs)

    ext.add_wrapper_with_key(ext.WrappersMP.DIFFUSION_MODEL, "ACN_refcn_diffusion_model", diffusion_model,
                             model.model_options, is_model_options=True)

    def acn_outer_sample(executor, *args, **kwargs):
        counts["acn_outer_sample"] += 1
        seen["acn_guider_patcher"] = executor.class_obj.model_patcher
        return executor(*args, **kwargs)

    def should_register(hook, patcher, model_options, target, registered):
        key = "ACN_outer_sample_wrapper"
        return not ext.get_wrappers_with_key(ext.WrappersMP.OUTER_SAMPLE, key, model_options,
                                             is_model_options=True)

    wrappers: dict = {}
    ext.add_wrapper_with_key(ext.WrappersMP.OUTER_SAMPLE, "ACN_outer_sample_wrapper", acn_outer_sample,
                             transformer_options=wrappers)
    wrapper_hook = comfy.hooks.WrapperHook(wrappers)
    wrapper_hook.hook_id = "ACN_outer_sample_wrapper"
    wrapper_hook.custom_should_register = should_register

    def hooked_only_apply_model(executor, *args, **kwargs):
        counts["hooked_only_apply_model"] += 1
        seen.setdefault("hooked_cond_or_uncond", set()).add(tuple(args[5]["cond_or_uncond"]))
        return executor(*args, **kwargs)

    options_hook = comfy.hooks.TransformerOptionsHook(
        {"wrappers": {ext.WrappersMP.APPLY_MODEL: {"hooked_only": [hooked_only_apply_model]}}},
        hook_scope=comfy.hooks.EnumHookScope.HookedOnly)
    group = comfy.hooks.HookGroup()
    group.add(wrapper_hook)
    group.add(options_hook)
    return group


@pytest.fixture(scope="module", params=["patcher", "fast_hooks"])
def scenario(request, comfy, models, pb):
    """``fast_hooks``: the same, with Patchbay's hook engine on and a LoRA hook in the cond's group."""
    from comfy import model_management

    n = comfy.nodes.NODE_CLASS_MAPPINGS
    base, clip, _ = n["CheckpointLoaderSimple"]().load_checkpoint(CKPT)
    (positive,) = n["CLIPTextEncode"]().encode(clip, "a knight")
    (negative,) = n["CLIPTextEncode"]().encode(clip, "blurry")
    (latent,) = n["EmptyLatentImage"]().generate(64, 64, 1)
    counts, seen = Counter(), {}

    m = pb.model_patcher.upgrade(base)
    if request.param == "fast_hooks":
        m = importlib.import_module(f"{comfy.pack.__name__}.hooks.enable").enable_hook_engine(m)
    ade_like(m, counts, seen)
    group = acn_like(m, counts, seen)
    if request.param == "fast_hooks":
        (lora_hooks,) = n["CreateHookLora"]().create_hook("patchbay-lora-r4.safetensors", 1.0, 1.0)
        group = group.clone_and_combine(lora_hooks)
    (hooked_positive,) = n["ConditioningSetProperties"]().set_properties(positive, 1.0, "default",
                                                                          hooks=group)

    def ours(executor, *args, **kwargs):
        counts["patchbay_predict_noise"] += 1
        return executor(*args, **kwargs)

    pb.registry.add_wrapper(m, "predict_noise", "contract", ours, priority=5)
    steps_seen: list = []
    pb.events.on_step_end(m, "contract", lambda event: steps_seen.append((event.step, event.total_steps)))
    pb.trace.enable_trace(m)

    sampled = m.clone()  # what every node does before changing a MODEL
    registered_before = pb.registry.registrations(sampled)
    options_before = {k: dict(v) for k, v in sampled.model_options["transformer_options"]["wrappers"].items()}
    model_management.unload_all_models()
    outputs = [n["KSampler"]().sample(sampled, 1, STEPS, 2.0, "euler", "normal", hooked_positive, negative,
                                      latent)[0]["samples"] for _ in range(RUNS)]
    model_management.unload_all_models()
    return types.SimpleNamespace(m=m, sampled=sampled, counts=counts, seen=seen, steps_seen=steps_seen,
                                 outputs=outputs, registered_before=registered_before,
                                 options_before=options_before, kind=request.param)


def test_every_registration_ran_the_expected_number_of_times(scenario):
    evaluations = STEPS * RUNS
    passes = 2 * evaluations  # cfg 2: the hooked positive and the negative are separate forward passes
    expected = {
        "ade_outer_sample": RUNS, "acn_outer_sample": RUNS, "ade_prepare_sampling": RUNS,
        "ade_calc_cond_batch": evaluations, "patchbay_predict_noise": evaluations,
        "ade_apply_model": passes, "acn_diffusion_model": passes, "hooked_only_apply_model": evaluations,
        "pre_run": RUNS, "cleanup": RUNS, "motion_pre_run": RUNS, "motion_cleanup": RUNS,
        "load": 1, "motion_load": 1,  # loaded once, reused by the second run
    }
    assert {k: scenario.counts[k] for k in expected} == expected
    assert all(torch.isfinite(out).all() for out in scenario.outputs)


def test_clone_copies_attachments_and_additional_models(scenario, pb):
    assert scenario.counts["attachment_clone"] == 1  # our explicit clone; sampling clones nothing
    assert scenario.sampled.get_attachment("ADE_params").generation == 1
    assert scenario.m.get_attachment("ADE_params").generation == 0
    original = scenario.m.get_additional_models_with_key("ADE")[0]
    copied = scenario.sampled.get_additional_models_with_key("ADE")[0]
    assert copied is not original and copied.model is original.model
    assert isinstance(scenario.sampled, pb.model_patcher.PatchbayPatcherMixin)


def test_wrappers_saw_what_they_expect(scenario):
    seen = scenario.seen
    assert seen["outer_patcher"] is scenario.sampled and seen["acn_guider_patcher"] is scenario.sampled
    assert seen["prepare_patcher"] is scenario.sampled
    assert seen["outer_conds"] == ["negative", "positive"] and seen["outer_options"]
    assert seen["calc_conds"] == {2}
    assert seen["apply_keys"] == {"cond_or_uncond", "sigmas", "sample_sigmas", "uuids"}
    assert seen["control"] == {True}  # no ControlNet here: control is None at args[3]
    assert set(seen["dm_cond_or_uncond"]) == {(0,), (1,)}
    assert seen["hooked_cond_or_uncond"] == {(0,)}  # only the hooked (positive) cond's passes


def test_injections_stay_idempotent(scenario):
    sequence = scenario.seen["injection"]
    assert sequence[0] == "inject" and sequence[-1] == "eject"
    assert all(a != b for a, b in zip(sequence, sequence[1:], strict=False)), sequence
    assert not scenario.sampled.is_injected and not scenario.sampled.model.ade_injected


def test_our_events_and_trace_ran_alongside(scenario, pb):
    assert scenario.steps_seen == [(0, STEPS), (1, STEPS)] * RUNS
    trace = pb.trace.last_trace(scenario.sampled)
    assert trace is pb.trace.last_trace(scenario.m) and trace.total_steps == STEPS
    hooks = {e.name for e in trace.events if e.kind == "hook"}
    assert {"ACN_outer_sample_wrapper", "TransformerOptionsHook 2"} <= hooks
    assert len(hooks) == (3 if scenario.kind == "fast_hooks" else 2)
    wrappers = {e.name for e in trace.events if e.kind == "wrapper"}
    assert {"outer_sample ADE", "outer_sample ACN_outer_sample_wrapper", "calc_cond_batch ADE",
            "predict_noise patchbay.contract", "diffusion_model ACN_refcn_diffusion_model"} <= wrappers


def test_nothing_is_left_behind(scenario, pb):
    sampled = scenario.sampled
    assert pb.registry.registrations(sampled) == scenario.registered_before
    assert {k: dict(v) for k, v in sampled.model_options["transformer_options"]["wrappers"].items()} \
        == scenario.options_before
    assert sampled.hook_patches == {} and sampled.current_hooks is None
    assert "registered_hooks" not in sampled.model_options
    assert not any(module._forward_hooks for module in sampled.model.modules())
