"""T1: Patchbay's hook and keyframe nodes against the equivalent chain of ComfyUI's own hook nodes.

Each node's output is sampled on the fast engine and on core's hook path and compared with the core
chain on core's path (KSampler latents within 1e-4 x max |latent|, fp32). Where Patchbay's keyframes
differ from core's on purpose (a keyframe at percent 1 starts on the last step; steps and sigmas),
the core chain places its keyframe at a percent that starts on the same step.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from hook_rig import Rig as EngineRig
from hook_rig import assert_close

pytestmark = pytest.mark.t1

CKPT_B = "patchbay-sd15-tiny-b.safetensors"
LORA = "patchbay-lora-r4.safetensors"
LOCON = "patchbay-locon-r4.safetensors"
STEPS = 4


class Rig(EngineRig):
    """The engine tests' rig (tiny checkpoint, prompts, 4-step euler) plus core chains and traces."""

    def __init__(self, comfy):
        super().__init__(comfy)
        self.fast_model = self.fast()
        self.preview = importlib.import_module(comfy.pack.__name__ + ".hooks.preview")

    def node(self, node_id):
        return self.n[node_id]()

    def encode_with(self, clip, text):
        return self.n["CLIPTextEncode"]().encode(clip, text)[0]

    def core_hook(self, lora=LORA, strength=1.0, kf=None):
        (hooks,) = self.node("CreateHookLora").create_hook(lora, strength, strength)
        return hooks if kf is None else self.node("SetHookKeyframes").set_hook_keyframes(hooks, kf)[0]

    def core_keyframes(self, points):
        kf = None
        for strength, percent in points:
            (kf,) = self.node("CreateHookKeyframe").create_hook_keyframe(strength, percent, prev_hook_kf=kf)
        return kf

    def sigmas(self, steps=STEPS):
        return self.preview.sampling_sigmas(self.model, steps, "normal")

    def percent_starting_at(self, step, steps=STEPS):
        """A core keyframe percent that is first reached on ``step`` (0-based) of a ``steps``-step run."""
        sigmas = self.sigmas(steps)
        sampling = self.model.get_model_object("model_sampling")
        target = float((sigmas[step] * sigmas[step - 1]) ** 0.5)
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if sampling.percent_to_sigma(mid) > target else (lo, mid)
        return hi

    def trace(self, hooks, steps=STEPS):
        return [t.strengths for t in self.preview.strength_trace(hooks, self.model, self.sigmas(steps))]

    def keyframed(self, kf, lora=LORA):
        return self.node("PatchbayHookLora").create(lora, 1.0, 1.0, hook_kf=kf)[0]


@pytest.fixture(scope="module")
def rig(comfy):
    return Rig(comfy)


def assert_same_as_core(rig, hooks, core_hooks, what, neg_too=False):
    """Ours on the fast engine and on core's path equal the core chain on core's path."""
    def conds(h):
        return rig.with_hooks(rig.pos, h), (rig.with_hooks(rig.neg, h) if neg_too else rig.neg)

    expected = rig.sample(rig.model, *conds(core_hooks))
    plain = rig.plain()
    assert (expected - plain).abs().max() > 1e-3 * plain.abs().max(), f"{what}: the hook has no effect"
    assert_close(rig.sample(rig.model, *conds(hooks)), expected, f"{what} on core's path")
    assert_close(rig.sample(rig.fast_model, *conds(hooks)), expected, f"{what} on the fast engine")


# --- keyframes -------------------------------------------------------------------------------------

def test_floats_keyframes_reach_the_last_value_where_cores_never_do(rig):
    floats = [0.0, 0.25, 0.75, 1.0]
    (core_kf,) = rig.node("CreateHookKeyframesFromFloats").create_hook_keyframes(floats, 0.0, 1.0)
    (ours_kf,) = rig.node("PatchbayHookKeyframesFromFloats").execute(floats, 0.0, 1.0)
    assert rig.trace(rig.core_hook(kf=core_kf), steps=8) == [(0, 0, 0, 0.25, 0.25, 0.75, 0.75, 0.75)]
    assert rig.trace(rig.keyframed(ours_kf), steps=8) == [(0, 0, 0, 0.25, 0.25, 0.75, 0.75, 1.0)]
    # a fade-out reaches 0 on the last step
    (fade,) = rig.node("PatchbayHookKeyframesFromFloats").execute([1.0, 0.5, 0.0], 0.0, 1.0)
    assert rig.trace(rig.keyframed(fade), steps=8)[0][-1] == 0.0


def test_floats_keyframes_equal_core_chain(rig):
    floats = [0.25, 1.0, 0.5]
    (ours,) = rig.node("PatchbayHookKeyframesFromFloats").execute(floats, 0.0, 1.0)
    last = rig.percent_starting_at(STEPS - 1)
    core = rig.core_keyframes([(0.25, 0.0), (1.0, 0.5), (0.5, last)])
    assert rig.trace(rig.keyframed(ours)) == rig.trace(rig.core_hook(kf=core))
    assert_same_as_core(rig, rig.keyframed(ours), rig.core_hook(kf=core), "keyframes from FLOATS")


def test_floats_keyframes_before_the_end_are_cores(rig):
    (ours,) = rig.node("PatchbayHookKeyframesFromFloats").execute([1.0, 0.0], 0.0, 0.6)
    (core,) = rig.node("CreateHookKeyframesFromFloats").create_hook_keyframes([1.0, 0.0], 0.0, 0.6)
    assert rig.trace(rig.keyframed(ours), 8) == rig.trace(rig.core_hook(kf=core), 8)
    assert_same_as_core(rig, rig.keyframed(ours), rig.core_hook(kf=core), "FLOATS keyframes ending at 0.6")


def test_interpolated_keyframes_equal_cores_before_the_end(rig):
    args = (0.0, 1.0, "ease_in_out", 0.0, 0.7, 4)
    (ours,) = rig.node("PatchbayHookKeyframesInterpolated").execute(*args)
    (core,) = rig.node("CreateHookKeyframesInterpolated").create_hook_keyframes(*args)
    assert rig.trace(rig.keyframed(ours), 8)[0] == pytest.approx(rig.trace(rig.core_hook(kf=core), 8)[0])
    assert_same_as_core(rig, rig.keyframed(ours), rig.core_hook(kf=core), "interpolated keyframes")
    (to_end,) = rig.node("PatchbayHookKeyframesInterpolated").execute(1.0, 0.0, "linear", 0.0, 1.0, 3)
    assert rig.trace(rig.keyframed(to_end), 8)[0][-1] == 0.0


def test_single_keyframe_chains_with_cores(rig):
    (kf,) = rig.node("PatchbayHookKeyframe").execute(0.3, 0.0)
    (kf,) = rig.node("CreateHookKeyframe").create_hook_keyframe(1.0, 0.5, prev_hook_kf=kf)
    (kf,) = rig.node("PatchbayHookKeyframe").execute(0.0, 1.0, prev_hook_kf=kf)
    assert type(kf).__name__ == "KeyframeGroup", "core's node adds to a clone of our group"
    core = rig.core_keyframes([(0.3, 0.0), (1.0, 0.5), (0.0, rig.percent_starting_at(STEPS - 1))])
    assert rig.trace(rig.keyframed(kf)) == rig.trace(rig.core_hook(kf=core))
    assert rig.trace(rig.keyframed(kf))[0][-1] == 0.0
    assert_same_as_core(rig, rig.keyframed(kf), rig.core_hook(kf=core), "single keyframes")


def test_text_keyframes_by_percent_step_and_sigma(rig):
    make = rig.node("PatchbayHookKeyframesFromText").execute
    sigmas = rig.sigmas()
    core = rig.core_keyframes([(0.2, 0.0), (1.0, rig.percent_starting_at(2))])
    expected = rig.trace(rig.core_hook(kf=core))
    assert expected == [(0.2, 0.2, 1.0, 1.0)]
    by_step = make("0.2@0, 1@2", "step")[0]
    by_sigma = make(f"0.2@{float(sigmas[0]) * 2:.4f}, 1@{float(sigmas[2]) * 1.01:.6f}", "sigma")[0]
    for kf, what in ((by_step, "steps"), (by_sigma, "sigmas")):
        assert rig.trace(rig.keyframed(kf)) == expected, what
    assert_same_as_core(rig, rig.keyframed(by_step), rig.core_hook(kf=core), "text keyframes by step")
    (loractl,) = make("0@0, 1@0.3, 0.2@1", "percent")
    trace = rig.trace(rig.keyframed(loractl), 8)[0]
    assert trace[0] == 0.0 and 1.0 in trace and trace[-1] == 0.2


def test_a_step_past_the_run_is_never_reached(rig):
    (kf,) = rig.node("PatchbayHookKeyframesFromText").execute("1@0, 0@10", "step")
    assert rig.trace(rig.keyframed(kf)) == [(1.0,) * STEPS]


def test_text_errors_at_validation_time(rig):
    cls = rig.n["PatchbayHookKeyframesFromText"]
    assert cls.validate_inputs("0@0, 1@0.5", "percent") is True
    message = cls.validate_inputs("0@0, 1@1.5", "percent")
    assert "column 8 is outside [0, 1]" in message


@pytest.mark.parametrize(("node_id", "args", "needle"), [
    ("PatchbayHookKeyframesFromFloats", ([], 0.0, 1.0), "the FLOATS list is empty"),
    ("PatchbayHookKeyframesFromFloats", ([1.0], 0.0, 1.5), "end_percent 1.5 is outside [0, 1]"),
    ("PatchbayHookKeyframe", (1.0, -0.2), "start_percent -0.2 is outside [0, 1]"),
])
def test_keyframe_errors(rig, node_id, args, needle):
    with pytest.raises(ValueError, match=None) as info:
        rig.node(node_id).execute(*args)
    assert needle in str(info.value)


# --- LoRA hooks ------------------------------------------------------------------------------------

def test_lora_hook_equals_create_hook_lora(rig):
    (ours,) = rig.node("PatchbayHookLora").create(LOCON, 0.8, 0.8)
    assert_same_as_core(rig, ours, rig.core_hook(LOCON, 0.8), "LoRA hook", neg_too=True)


def test_model_as_lora_hook_equals_core(rig):
    (ours,) = rig.node("PatchbayHookModelAsLora").create(CKPT_B, 0.5, 0.0)
    (core,) = rig.node("CreateHookModelAsLoraModelOnly").create_hook_model_only(CKPT_B, 0.5)
    assert_same_as_core(rig, ours, core, "model-as-LoRA hook")


def test_lora_stack_equals_two_core_hooks_combined(rig):
    slots = {"lora_1": LORA, "strength_1": 1.0, "schedule_1": "0@0, 1@0.5",
             "lora_2": "None", "strength_2": 1.0, "schedule_2": "",
             "lora_3": LOCON, "strength_3": 0.6, "schedule_3": "",
             "lora_4": "None", "strength_4": 1.0, "schedule_4": ""}
    (ours,) = rig.node("PatchbayHookLoraStack").create(positions="percent", **slots)
    assert len(ours) == 2
    a = rig.core_hook(LORA, 1.0, rig.core_keyframes([(0.0, 0.0), (1.0, 0.5)]))
    b = rig.core_hook(LOCON, 0.6)
    (core,) = rig.node("CombineHooks2").combine_hooks(a, b)
    assert_same_as_core(rig, ours, core, "LoRA stack")
    assert [t.name for t in rig.preview.strength_trace(ours, rig.model, rig.sigmas())] == [LORA, LOCON]


def test_scheduled_lora_equals_core_chain(rig):
    model, clip, hooks = rig.node("PatchbayScheduledLora").apply(rig.model, rig.clip, LORA, 1.0, 1.0,
                                                                  "0@0, 1@0.5", "percent", False)
    assert rig.comfy.pack.NODE_CLASS_MAPPINGS["PatchbayHookEngine"] and model is not rig.model
    engine_of = rig.comfy.pack.hooks.enable.hook_engine_of
    assert engine_of(model) is not None, "the model comes back on the fast engine"
    core_hooks = rig.core_hook(LORA, 1.0, rig.core_keyframes([(0.0, 0.0), (1.0, 0.5)]))
    (core_clip,) = rig.node("SetClipHooks").apply_hooks(rig.clip, False, True, core_hooks)
    expected = rig.sample(rig.model, rig.encode_with(core_clip, "a knight in armor"),
                          rig.encode_with(core_clip, "blurry"))
    pos, neg = rig.encode_with(clip, "a knight in armor"), rig.encode_with(clip, "blurry")
    assert pos[0][1]["hooks"] is not None, "conds made by the returned CLIP carry the hook"
    assert not torch.equal(pos[0][0], rig.pos[0][0]), "the CLIP strength changed the encoding"
    assert_close(rig.sample(rig.model, pos, neg), expected, "scheduled LoRA on core's path")
    assert_close(rig.sample(model, pos, neg), expected, "scheduled LoRA on the fast engine")
    assert len(hooks) == 1


def test_scheduled_lora_with_clip_schedule_equals_core_chain(rig):
    model, clip, _hooks = rig.node("PatchbayScheduledLora").apply(rig.model, rig.clip, LORA, 0.9, 1.0,
                                                                   "0.2@0, 1@0.5", "percent", True)
    (core_hooks,) = rig.node("CreateHookLora").create_hook(LORA, 0.9, 1.0)
    (core_hooks,) = rig.node("SetHookKeyframes").set_hook_keyframes(
        core_hooks, rig.core_keyframes([(0.2, 0.0), (1.0, 0.5)]))
    (core_clip,) = rig.node("SetClipHooks").apply_hooks(rig.clip, True, True, core_hooks)
    expected_pos = rig.encode_with(core_clip, "a knight in armor")
    pos = rig.encode_with(clip, "a knight in armor")
    assert len(pos) == len(expected_pos) == 2, "one encoding per keyframe range"
    expected = rig.sample(rig.model, expected_pos)
    assert_close(rig.sample(rig.model, pos), expected, "CLIP-scheduled LoRA on core's path")
    assert_close(rig.sample(model, pos), expected, "CLIP-scheduled LoRA on the fast engine")


def test_scheduled_lora_clip_schedule_needs_percent(rig):
    with pytest.raises(ValueError, match="schedule_clip needs positions in percent"):
        rig.node("PatchbayScheduledLora").apply(rig.model, rig.clip, LORA, 1.0, 1.0, "0@0, 1@2", "step", True)
    assert "column 6" in rig.n["PatchbayScheduledLora"].VALIDATE_INPUTS("0@0, x@2", "step")


def test_unknown_lora_name_suggests_the_nearest(rig):
    with pytest.raises(ValueError) as info:
        rig.node("PatchbayHookLora").create("patchbay-lora-r5", 1.0, 1.0)
    message = str(info.value)
    assert "no lora named 'patchbay-lora-r5'" in message and "'patchbay-lora-r4.safetensors'" in message
    (hooks,) = rig.node("PatchbayHookLora").create("patchbay-lora-r4", 1.0, 1.0)  # extension left out
    assert len(hooks) == 1


def test_lora_for_another_model_is_refused(rig):
    with pytest.raises(ValueError) as info:
        rig.node("PatchbayScheduledLora").apply(rig.model, rig.clip, "patchbay-flux-kohya-r8.safetensors",
                                                1.0, 1.0, "1@0", "percent", False)
    message = str(info.value)
    assert "matches a weight of the model" in message and "another model architecture" in message


# --- schedule preview ------------------------------------------------------------------------------

@pytest.mark.parametrize(("scheduler", "denoise"), [("normal", 1.0), ("karras", 0.6)])
def test_preview_shows_what_sampling_applies(rig, scheduler, denoise):
    """The preview's strengths equal a traced run's hook strengths, core keyframes and ours."""
    trace = importlib.import_module(rig.comfy.pack.__name__ + ".patcher.trace")
    plot = importlib.import_module(rig.comfy.pack.__name__ + ".patcher.trace_plot")
    steps = 6
    (ours_kf,) = rig.node("PatchbayHookKeyframesFromText").execute("0.25@0, 1@0.4, 0@1", "percent")
    (core_kf,) = rig.node("CreateHookKeyframesFromFloats").create_hook_keyframes([0.5, 1.0, 0.2], 0.0, 1.0)
    last = {}
    for what, kf in (("ours", ours_kf), ("core", core_kf)):
        hooks = rig.keyframed(kf)
        preview = rig.node("PatchbayHookSchedulePreview")
        image, report = preview.execute(rig.model, hooks, steps, scheduler, denoise)
        (traced,) = rig.node("PatchbayTrace").execute(rig.model)
        rig.node("KSampler").sample(traced, 1, steps, 7.0, "euler", scheduler, rig.with_hooks(rig.pos, hooks),
                                    rig.neg, rig.latent, denoise=denoise)
        (lane,) = [lane for lane in plot.lanes(trace.last_trace(traced)) if lane.kind == "hook"]
        sampled = tuple(strength for _step, strength, _count in lane.cells)
        sigmas = rig.preview.sampling_sigmas(rig.model, steps, scheduler, denoise)
        (previewed,) = [t.strengths for t in rig.preview.strength_trace(hooks, rig.model, sigmas)]
        assert previewed == pytest.approx(sampled), f"{what}: preview {previewed}, run {sampled}"
        assert image.shape[0] == 1 and image.shape[3] == 3 and image.shape[2] >= 700 and image.std() > 0.05
        assert f"{LORA}: " + ", ".join(f"{v:g}" for v in previewed) in report
        last[what] = previewed[-1]
    assert last == {"ours": 0.0, "core": 1.0}, "ours ends at its last value; core's 0.2 at 1.0 never applies"


def test_preview_errors_name_the_value(rig):
    with pytest.raises(ValueError, match=r"denoise 0.0 is outside \(0, 1\]"):
        rig.node("PatchbayHookSchedulePreview").execute(rig.model, rig.core_hook(), 4, "normal", 0.0)


# --- regional and prompt LoRA ----------------------------------------------------------------------

def thirds():
    left, right = torch.zeros((1, 64, 64)), torch.zeros((1, 64, 64))
    left[:, :, :24] = 1.0
    right[:, :, 40:] = 1.0
    return left, right


def core_regions(rig, masks, base_mask):
    props = rig.node("ConditioningSetProperties").set_properties
    a = props(rig.encode("a red castle"), 1.0, "default", mask=masks[0], hooks=rig.core_hook(LORA))[0]
    b = props(rig.encode("a green forest"), 1.0, "default", mask=masks[1], hooks=rig.core_hook(LOCON, 0.8))[0]
    base = props(rig.encode("a sunny day"), 1.0, "default", mask=base_mask)[0]
    (ab,) = rig.node("ConditioningCombine").combine(a, b)
    return rig.node("ConditioningCombine").combine(ab, base)[0]


@pytest.mark.parametrize("feather", [0, 4])
def test_regional_lora_equals_core_chain(rig, feather):
    regions = importlib.import_module(rig.comfy.pack.__name__ + ".hooks.regions")
    left, right = thirds()
    masks = [regions.feather(m, feather) for m in (left, right)]
    expected_cond = core_regions(rig, masks, 1.0 - torch.maximum(masks[0], masks[1]))
    cond, model, _ = rig.node("PatchbayRegionalLora").combine(
        rig.model, feather, base=rig.encode("a sunny day"),
        cond_1=rig.encode("a red castle"), mask_1=left, lora_1=LORA, strength_1=1.0,
        cond_3=rig.encode("a green forest"), mask_3=right, lora_3=LOCON, strength_3=0.8, lora_2="None")
    assert len(cond) == 3 and rig.engine(model) is not None
    expected = rig.sample(rig.model, expected_cond)
    assert_close(rig.sample(rig.model, cond), expected, f"regional LoRA (feather {feather}) on core's path")
    assert_close(rig.sample(model, cond), expected, f"regional LoRA (feather {feather}) on the fast engine")


def test_feather_softens_edges_only(rig):
    regions = importlib.import_module(rig.comfy.pack.__name__ + ".hooks.regions")
    left, _ = thirds()
    soft = regions.feather(left, 4)
    assert soft.shape == left.shape and soft.min() >= 0 and soft.max() <= 1
    assert torch.equal(soft[:, :, :19], left[:, :, :19]) and torch.equal(soft[:, :, 29:], left[:, :, 29:])
    row = soft[0, 32, 19:29]
    assert all(row[i] >= row[i + 1] for i in range(len(row) - 1)) and 0 < row[4] < 1
    assert torch.equal(regions.feather(left, 0), left)
    with pytest.raises(ValueError, match="feather -1 is negative"):
        regions.feather(left, -1)


def test_region_diagram_colours_each_region_where_its_mask_is(rig):
    regions = importlib.import_module(rig.comfy.pack.__name__ + ".hooks.regions")
    left, right = thirds()
    *_, diagram = rig.node("PatchbayRegionalLora").combine(
        rig.model, 0, base=rig.encode("a sunny day"), cond_1=rig.encode("a red castle"), mask_1=left,
        lora_1=LORA, strength_1=1.0, cond_2=rig.encode("a green forest"), mask_2=right, lora_2="None")
    assert diagram.shape == (1, 512, 512, 3) and diagram.dtype == torch.float32
    pixel = (diagram[0] * 255).round().int()

    def colour_at(x):  # a row away from the labels, which sit at the masks' centres (row 256)
        return tuple(pixel[40, x].tolist())

    assert colour_at(20) == regions.REGION_COLOURS[0]
    assert colour_at(500) == regions.REGION_COLOURS[1]
    assert colour_at(256) == regions.BASE_COLOUR  # columns 24..39 of 64: neither mask, the base
    *_, soft = rig.node("PatchbayRegionalLora").combine(
        rig.model, 4, cond_1=rig.encode("a red castle"), mask_1=left, lora_1="None")
    edge = tuple((soft[0, 40, 24 * 8 + 4] * 255).round().int().tolist())  # feathered edge, no base
    assert edge == regions.REGION_COLOURS[0]  # the only region: its colour wherever its mask is > 0
    assert tuple((soft[0, 40, 500] * 255).round().int().tolist()) != regions.REGION_COLOURS[0]


def test_regional_lora_needs_a_region(rig):
    with pytest.raises(ValueError, match="no region: connect at least one cond_N"):
        rig.node("PatchbayRegionalLora").combine(rig.model, 0, base=rig.pos)


@pytest.mark.parametrize(("tag", "strength", "keyframes"), [
    ("<lora:patchbay-lora-r4:0.8>", 0.8, None),
    ("<lora:patchbay-lora-r4.safetensors:0@0,1@0.5>", 1.0, [(0.0, 0.0), (1.0, 0.5)]),
])
def test_prompt_lora_equals_set_clip_hooks_chain(rig, tag, strength, keyframes):
    prompt = f"a knight {tag} in armor"
    cond, model, hooks = rig.node("PatchbayPromptLora").encode(rig.clip, prompt, rig.model)
    core_hooks = rig.core_hook(LORA, strength, None if keyframes is None else rig.core_keyframes(keyframes))
    (core_clip,) = rig.node("SetClipHooks").apply_hooks(rig.clip, False, True, core_hooks)
    expected = rig.sample(rig.model, rig.encode_with(core_clip, "a knight in armor"))
    assert len(hooks) == 1 and rig.engine(model) is not None
    assert_close(rig.sample(rig.model, cond), expected, f"prompt LoRA {tag} on core's path")
    assert_close(rig.sample(model, cond), expected, f"prompt LoRA {tag} on the fast engine")


def test_prompt_lora_without_tags_is_a_plain_encode(rig):
    cond, model, hooks = rig.node("PatchbayPromptLora").encode(rig.clip, "a knight in armor")
    assert hooks is None and model is None and torch.equal(cond[0][0], rig.pos[0][0])


def test_prompt_lora_unknown_name_names_the_tag(rig):
    with pytest.raises(ValueError) as info:
        rig.node("PatchbayPromptLora").encode(rig.clip, "a knight <lora:patchbay-lora-r44:1>")
    assert "LoRA tag at column 10: no lora named 'patchbay-lora-r44'; did you mean" in str(info.value)
    assert "column 10" in rig.n["PatchbayPromptLora"].VALIDATE_INPUTS("a knight <lora:x:strong>")


# --- block weights -----------------------------------------------------------------------------------

def lora_file(rig, name):
    import comfy.utils

    return comfy.utils.load_torch_file(rig.comfy.folder_paths.get_full_path("loras", name), safe_load=True)


def core_hook_from(lora, strength=1.0):
    import comfy.hooks

    return comfy.hooks.create_hook_lora(lora, strength, strength)


def test_block_weights_scale_by_block(rig):
    weigh = rig.node("PatchbayHookBlockWeights").execute
    (ours,) = rig.node("PatchbayHookLora").create(LORA, 1.0, 1.0)
    (half,) = weigh(ours, rig.model, "default=0.5", "auto")
    assert_same_as_core(rig, half, rig.core_hook(LORA, 0.5), "block weights default=0.5")
    (no_out,) = weigh(ours, rig.model, "OUT*=0", "sd15")
    without_up = {k: v for k, v in lora_file(rig, LORA).items() if not k.startswith("lora_unet_up_blocks_")}
    assert len(without_up) < len(lora_file(rig, LORA))
    assert_same_as_core(rig, no_out, core_hook_from(without_up), "block weights OUT*=0")
    (off,) = weigh(ours, rig.model, "default=0", "auto")
    plain = rig.plain()
    assert_close(rig.sample(rig.fast_model, rig.with_hooks(rig.pos, off)), plain, "block weights default=0")


def test_block_weights_on_loha_keep_the_schedule(rig):
    (kf,) = rig.node("PatchbayHookKeyframesFromText").execute("0.5@0, 1@0.5", "percent")
    (ours,) = rig.node("PatchbayHookLora").create("patchbay-loha-r4.safetensors", 1.0, 1.0, hook_kf=kf)
    (weighted,) = rig.node("PatchbayHookBlockWeights").execute(ours, rig.model, "IN*=0.5, M00=0.5, OUT*=0.5",
                                                             "sd15")
    core = rig.core_hook("patchbay-loha-r4.safetensors", 0.5, rig.core_keyframes([(0.5, 0.0), (1.0, 0.5)]))
    assert rig.trace(weighted) == rig.trace(ours), "the schedule is kept"
    assert weighted.hooks[0].hook_ref != ours.hooks[0].hook_ref, "new weights get a new identity"
    assert_same_as_core(rig, weighted, core, "LoHa block weights 0.5")


@pytest.mark.parametrize(("text", "needle"), [
    ("IN0=0", "'IN0' is no block of sd15"),
    ("IN0=0", "IN00"),
    ("OUT05", "'OUT05' is not name=strength items"),  # read as an A1111 preset name: hooks/lbw.py
    ("IN00=1, M00=x", "'M00=x' at line 1, column 9"),
    ("OUTAL", "'OUTAL' is no LoRA Block Weight preset; did you mean 'OUTALL'"),  # A1111 form: hooks/lbw.py
    ("1,0,1", "has 3 values; expected sd15: 17 or 26; sd2: 17 or 26; sdxl: 12 or 20; flux: 61"),
])
def test_block_map_errors(rig, text, needle):
    (ours,) = rig.node("PatchbayHookLora").create(LORA, 1.0, 1.0)
    with pytest.raises(ValueError) as info:
        rig.node("PatchbayHookBlockWeights").execute(ours, rig.model, text, "auto")
    assert needle in str(info.value)


# Block weights on the tiny SDXL and Flux models: a block set to 0 equals the LoRA file without that
# block's keys (LoraLoader, which parses every layout), default=0.5 equals the LoRA at strength 0.5.
# --- LORA_STACK lists from other packs, and A1111 LoRA Block Weight presets / lists ------------------------
# A stack's hooks sample as core's CreateHookLora chain and encode as core's SetClipHooks with it; each preset
# resolves every LoRA target key of the tiny SD1.5 (and synthetic SDXL / Flux keys, every block) to exactly
# the strength of its hand-written block-name form, and its hooks carry the same tensors.

# the block-name form of each preset, written from the extension's README table (17-value layout)
SD15_FORMS = {
    "NONE": "default=0",
    "ALL": "BASE=1, IN01=1, IN02=1, IN04=1, IN05=1, IN07=1, IN08=1, M00=1, OUT0[3-9]=1, OUT1?=1, default=0",
    "INS": "BASE=1, IN01=1, IN02=1, IN04=1, default=0",
    "IND": "BASE=1, IN05=1, IN07=1, IN08=1, default=0",
    "INALL": "BASE=1, IN01=1, IN02=1, IN04=1, IN05=1, IN07=1, IN08=1, default=0",
    "MIDD": "BASE=1, IN05=1, IN07=1, IN08=1, M00=1, OUT03=1, OUT04=1, OUT05=1, OUT06=1, default=0",
    "OUTD": "BASE=1, OUT03=1, OUT04=1, OUT05=1, OUT06=1, default=0",
    "OUTS": "BASE=1, OUT07=1, OUT08=1, OUT09=1, OUT10=1, OUT11=1, default=0",
    "OUTALL": "BASE=1, OUT0[3-9]=1, OUT1?=1, default=0",
    "ALL0.5": "BASE=.5, IN01=.5, IN02=.5, IN04=.5, IN05=.5, IN07=.5, IN08=.5, M00=.5, OUT0[3-9]=.5, "
              "OUT1?=.5, default=0",
}
# SDXL: the extension applies the 17-value presets by block name (OUT09.. do not exist there)
SDXL_FORMS = {
    "OUTALL": "BASE=1, OUT0[3-8]=1, default=0",
    "INALL": SD15_FORMS["INALL"],
    "MIDD": SD15_FORMS["MIDD"],
    "ALL": "BASE=1, IN01=1, IN02=1, IN04=1, IN05=1, IN07=1, IN08=1, M00=1, OUT0[3-8]=1, default=0",
    "1,0,0,0,0,1,1,1,1,1,1,1": "BASE=1, M00=1, OUT0[0-5]=1, default=0",  # 12 values
    ",".join(["0.5"] * 20): "default=0.5",
}
TEXT_KEYS = ("clip_l.transformer.text_model.encoder.layers.0.mlp.fc1.weight",
             "clip_g.transformer.text_model.encoder.layers.0.mlp.fc1.weight")
SDXL_KEYS = (*(f"diffusion_model.input_blocks.{i}.1.proj_in.weight" for i in range(9)),
             "diffusion_model.middle_block.1.proj_in.weight",
             *(f"diffusion_model.output_blocks.{i}.1.proj_in.weight" for i in range(9)),
             "diffusion_model.time_embed.0.weight", "diffusion_model.label_emb.0.0.weight",
             "diffusion_model.out.2.weight", *TEXT_KEYS)
FLUX_KEYS = (*(f"diffusion_model.{m}.weight" for m in ("img_in", "txt_in", "time_in.in_layer",
                                                          "vector_in.in_layer", "guidance_in.in_layer",
                                                          "final_layer.linear")),
             *(f"diffusion_model.double_blocks.{i}.img_attn.qkv.weight" for i in range(19)),
             *(f"diffusion_model.single_blocks.{i}.linear1.weight" for i in range(38)), TEXT_KEYS[0])
T5_KEY = "t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.q.weight"


@pytest.fixture(scope="module")
def blocks(comfy):
    return importlib.import_module(comfy.pack.__name__ + ".nodes.hook_blocks")


def same_hooks(actual, expected):
    """Hook by hook: name, strengths, schedule and every tensor equal."""
    assert len(actual.hooks) == len(expected.hooks)
    for a, b in zip(actual.hooks, expected.hooks, strict=True):
        assert (a.hook_id, a._strength_model, a._strength_clip) == \
            (b.hook_id, b._strength_model, b._strength_clip)
        assert [(k.strength, k.start_percent) for k in a.hook_keyframe.keyframes] == \
            [(k.strength, k.start_percent) for k in b.hook_keyframe.keyframes]
        assert a.weights.keys() == b.weights.keys()
        assert all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights), f"{a.hook_id}: tensors differ"


def test_stack_from_efficiency_and_comfyroll_equals_core_chain(rig):
    # Efficiency Nodes' LoRA Stacker (simple mode): (name, wt, wt), "None" slots left out
    efficiency = [(name, wt, wt) for name, wt in ((LORA, 0.8), ("None", 1.0)) if name != "None"]
    # Comfyroll's CR LoRA Stack fed that stack: incoming entries first, then its own (name, model, clip)
    stack = [entry for entry in efficiency if entry[0] != "None"] + [(LOCON, 1.0, 0.5)]
    (ours,) = rig.node("PatchbayLoraStackHooks").create(stack, f"1: 0@0, 1@0.5\n{LOCON}: 1@0, 0.5@0.5",
                                                        "percent")
    a = rig.core_hook(LORA, 0.8, rig.core_keyframes([(0.0, 0.0), (1.0, 0.5)]))
    (b,) = rig.node("CreateHookLora").create_hook(LOCON, 1.0, 0.5)
    (b,) = rig.node("SetHookKeyframes").set_hook_keyframes(b, rig.core_keyframes([(1.0, 0.0), (0.5, 0.5)]))
    (core,) = rig.node("CombineHooks2").combine_hooks(a, b)
    assert [h._strength_clip for h in ours.hooks] == [0.8, 0.5]
    assert_same_as_core(rig, ours, core, "LORA_STACK as hooks", neg_too=True)
    (ours_clip,) = rig.node("SetClipHooks").apply_hooks(rig.clip, False, True, ours)
    (core_clip,) = rig.node("SetClipHooks").apply_hooks(rig.clip, False, True, core)
    encoded = rig.encode_with(ours_clip, "a knight")[0][0]
    assert torch.equal(encoded, rig.encode_with(core_clip, "a knight")[0][0]), "the CLIP strengths differ"


def test_stack_from_lora_manager_paths(rig):
    # LoRA Manager's Lora Stacker: the OS separator, or an absolute path outside the roots it knows
    stack = [("D:\\ComfyUI\\models\\loras\\" + LOCON, 0.6, 0.6),
             (LORA.removesuffix(".safetensors"), 1.0, 0.0)]
    (ours,) = rig.node("PatchbayLoraStackHooks").create(stack, "", "percent")
    (a,) = rig.node("PatchbayHookLora").create(LOCON, 0.6, 0.6)
    (b,) = rig.node("PatchbayHookLora").create(LORA, 1.0, 0.0, prev_hooks=a)
    same_hooks(ours, b)


def test_lora_hook_stack_takes_a_stack_after_its_slots(rig):
    slots = {f"lora_{i}": "None" for i in range(2, 5)} | {"lora_1": LORA, "strength_1": 0.5,
                                                          "schedule_1": "0@0, 1@1"}
    (ours,) = rig.node("PatchbayHookLoraStack").create("percent", lora_stack=[(LOCON, 0.7, 0.2)], **slots)
    (expected,) = rig.node("PatchbayHookLoraStack").create("percent", **slots)
    (expected,) = rig.node("PatchbayHookLora").create(LOCON, 0.7, 0.2, prev_hooks=expected)
    same_hooks(ours, expected)


@pytest.mark.parametrize(("stack", "schedules", "needle"), [
    ([(LORA, 1.0, 1.0), ("patchbay-lora-r5.safetensors", 1.0, 1.0)], "",
     "LORA_STACK entry 2 ('patchbay-lora-r5.safetensors'): no lora named 'patchbay-lora-r5.safetensors'; "
     "did you mean 'patchbay-lora-r4.safetensors'"),
    ([(LORA, 1.0, 1.0)], "1: 0@0, x@1", f"LORA_STACK entry 1 ('{LORA}'): "),
    ([(LORA, 1.0)], "", "LORA_STACK entry 1"),
    ([(LORA, 1.0, 1.0)], "2: 1@0", "no LoRA at position 2"),
])
def test_stack_errors_name_the_entry(rig, stack, schedules, needle):
    with pytest.raises(ValueError) as info:
        rig.node("PatchbayLoraStackHooks").create(stack, schedules, "percent")
    assert needle in str(info.value)
    assert "column 6" in rig.n["PatchbayLoraStackHooks"].VALIDATE_INPUTS("1: 0@0, x@1", "percent")


# --- A1111 block weights -----------------------------------------------------------------------------

def lora_keys(rig):
    import comfy.lora

    key_map = comfy.lora.model_lora_keys_unet(rig.model.model, {})
    key_map = comfy.lora.model_lora_keys_clip(rig.clip.cond_stage_model, key_map)
    return sorted({v[0] if isinstance(v, tuple) else v for v in key_map.values()})


@pytest.mark.parametrize("preset", sorted(SD15_FORMS))
def test_each_preset_resolves_as_its_block_name_form(rig, blocks, preset):
    keys = lora_keys(rig)
    ours, form = blocks.strength_map(preset, "sd15"), blocks.strength_map(SD15_FORMS[preset], "sd15")
    assert [ours(k) for k in keys] == [form(k) for k in keys]
    assert len({ours(k) for k in keys}) == (1 if preset == "NONE" else 2), "the preset must tell blocks apart"


@pytest.mark.parametrize("spec", sorted(SDXL_FORMS))
def test_sdxl_presets_and_lists_resolve_as_their_block_name_form(blocks, spec):
    ours, form = blocks.strength_map(spec, "sdxl"), blocks.strength_map(SDXL_FORMS[spec], "sdxl")
    assert [ours(k) for k in SDXL_KEYS] == [form(k) for k in SDXL_KEYS]


def test_flux_vector_resolves_as_its_block_name_form(blocks):
    values = [0.3, 0.7, 0.2, *[1.0] * 19, *[0.5] * 38, 0.0]  # CLIP, T5, IN, D00..D18, S00..S37, OUT
    ours = blocks.strength_map(",".join(map(str, values)), "flux")
    form = blocks.strength_map("BASE=0.3, img_in=.2, txt_in=.2, time_in=.2, vector_in=.2, guidance_in=.2, "
                               "double_blocks.*=1, single_blocks.*=0.5, final_layer=0", "flux")
    assert [ours(k) for k in FLUX_KEYS] == [form(k) for k in FLUX_KEYS]
    assert ours(T5_KEY) == 0.7, "T5 has a value of its own; CLIP-L takes BASE"
    every = blocks.strength_map("FLUXALL", "flux")
    assert {every(k) for k in (*FLUX_KEYS, T5_KEY)} == {1.0}


@pytest.mark.parametrize("preset", ["MIDD", "OUTALL"])
def test_preset_hooks_equal_block_name_hooks(rig, preset):
    weigh = rig.node("PatchbayHookBlockWeights").execute
    (hooks,) = rig.node("PatchbayHookLora").create(LOCON, 0.8, 0.8)
    same_hooks(weigh(hooks, rig.model, preset, "auto", rig.clip)[0],
               weigh(hooks, rig.model, SD15_FORMS[preset], "sd15", rig.clip)[0])


def test_prompt_lora_lbw_equals_the_block_weights_chain(rig):
    encode = rig.node("PatchbayPromptLora").encode
    cond, model, hooks = encode(rig.clip, f"a knight <lora:{LOCON}:0.8:lbw=OUTALL> in armor", rig.model)
    _, _, whole = encode(rig.clip, f"a knight <lora:{LOCON}:0.8> in armor", rig.model)
    (weighted,) = rig.node("PatchbayHookBlockWeights").execute(whole, rig.model, SD15_FORMS["OUTALL"], "sd15",
                                                            rig.clip)
    same_hooks(hooks, weighted)
    (core_clip,) = rig.node("SetClipHooks").apply_hooks(rig.clip, False, True, weighted)
    expected = rig.sample(rig.model, rig.encode_with(core_clip, "a knight in armor"))
    assert_close(rig.sample(model, cond), expected, "lbw=OUTALL on the fast engine")
    (whole_clip,) = rig.node("SetClipHooks").apply_hooks(rig.clip, False, True, whole)
    unweighted = rig.sample(rig.model, rig.encode_with(whole_clip, "a knight in armor"))
    assert (unweighted - expected).abs().max() > 1e-3 * expected.abs().max(), "OUTALL changed nothing"


@pytest.mark.once
def test_block_maps_of_the_new_families_follow_the_model_keys(blocks):
    """Text block maps on families with no tiny ComfyUI model here (Flux.2, Wan): ranges and globs resolve
    to the model's keys, blocks counted from them. Pure map logic behind ComfyUI's import: the same on
    every version."""
    import tiny_families as tf

    dev = [k for k in tf.shapes("flux2", 8, 48, checkpoint=True) if k.startswith("model.diffusion_model.")]
    strength = blocks.strength_map("double_blocks.0-3=0, single_blocks.*=0.5", "flux2", dev)
    assert strength("diffusion_model.double_blocks.3.img_attn.qkv.weight") == 0.0
    assert strength("diffusion_model.double_blocks.4.img_attn.qkv.weight") == 1.0  # default 1
    assert strength("diffusion_model.single_blocks.47.linear1.weight") == 0.5
    klein = [k for k in tf.shapes("flux2", 5, 20, checkpoint=True) if k.startswith("model.")]
    with pytest.raises(ValueError, match=r"'single_blocks\.20' is no block of flux2 \(counted from the file: "
                                         r".*single_blocks\.0-19"):
        blocks.strength_map("single_blocks.10-23=0", "flux2", klein)
    wan = [f"model.diffusion_model.{k}" for k in tf.shapes("wan21", 30)]
    strength = blocks.strength_map("blocks.20-29=0\nhead=0.5", "wan21", wan)
    assert [strength(f"diffusion_model.blocks.{i}.ffn.0.weight") for i in (19, 20, 29)] == [1.0, 0.0, 0.0]
    assert strength("diffusion_model.head.head.weight") == 0.5
    with pytest.raises(ValueError, match="range 'blocks.9-0' runs from 9 to 0"):
        blocks.strength_map("blocks.9-0=0", "wan21", wan)
    with pytest.raises(ValueError, match="vectors are defined for sd15, sd2, sdxl, flux, not wan21"):
        blocks.strength_map("OUTALL", "wan21", wan)
    # an A1111 Flux vector (19 + 38 blocks, guidance_in) on a smaller Flux without guidance (schnell-like)
    small = [k for k in tf.shapes("flux", 2, 3, checkpoint=True) if "guidance_in" not in k]
    values = [0.3, 0.7, 0.2, 1.0, 0.4, *[1.0] * 17, *[0.5] * 38, 0.0]  # CLIP, T5, IN, D00..D18, S.., OUT
    strength = blocks.strength_map(",".join(map(str, values)), "flux", small)
    assert strength("diffusion_model.double_blocks.1.img_attn.qkv.weight") == 0.4
    assert strength("diffusion_model.img_in.weight") == 0.2
    assert {blocks.strength_map("FLUXALL", "flux", small)(k.removeprefix("model.")) for k in small} == {1.0}
    menu = blocks.PatchbayHookBlockWeights.INPUT_TYPES()["required"]["arch"][1]["options"]  # a V3 combo
    assert menu == ["auto", *blocks.architectures.BY_ID]  # the architecture table's families


@pytest.mark.parametrize(("text", "model", "needle"), [
    (f"<lora:{LORA}:lbw=OUTALL>", False, "LoRA tag at column 1: lbw=OUTALL needs the model input connected"),
    (f"x <lora:{LORA}:lbw=1,1,1,1,1,1,1,1,1,1,1,1>", True,
     "LoRA tag at column 3: block map '1,1,1,1,1,1,1,1,1,1,1,1' is not name=strength items"),
    (f"x <lora:{LORA}:lbw=1,1,1,1,1,1,1,1,1,1,1,1>", True, "does not fit sd15, which takes 17 or 26 values"),
])
def test_prompt_lora_lbw_errors(rig, text, model, needle):
    with pytest.raises(ValueError) as info:
        rig.node("PatchbayPromptLora").encode(rig.clip, text, rig.model if model else None)
    assert needle in str(info.value)
    assert "did you mean 'MIDD'" in rig.n["PatchbayPromptLora"].VALIDATE_INPUTS("<lora:x:1:lbw=MID>")
