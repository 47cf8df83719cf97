"""T1: Trace Sampling -> a sampler run with a scheduled LoRA hook -> Trace Timeline, nodes called directly."""

from __future__ import annotations

import importlib

import pytest
import torch

pytestmark = pytest.mark.t1


@pytest.fixture(scope="module")
def traced_run(comfy, sd15):
    import comfy.model_management as mm

    n, ours = comfy.nodes.NODE_CLASS_MAPPINGS, comfy.pack.NODE_CLASS_MAPPINGS
    (traced,) = ours["PatchbayTrace"]().execute(sd15.model)
    positive, negative, hooks = sd15.encode("a knight in armor"), sd15.encode("blurry"), sd15.lora_hooks()
    (keyframes,) = n["CreateHookKeyframesFromFloats"]().create_hook_keyframes([0.0, 1.0, 1.0, 1.0], 0.0, 1.0)
    (hooks,) = n["SetHookKeyframes"]().set_hook_keyframes(hooks, keyframes)
    positive = sd15.hooked(positive, hooks)
    (samples,) = n["KSampler"]().sample(traced, 1, 4, 7.0, "euler", "normal", positive, negative, sd15.latent)
    yield sd15.model, traced, samples
    mm.unload_all_models()


def test_trace_node_leaves_its_input_alone(comfy, traced_run):
    trace = importlib.import_module(f"{comfy.pack.__name__}.patcher.trace")
    model, traced, _samples = traced_run
    assert traced is not model and trace.trace_enabled(traced) and not trace.trace_enabled(model)


def test_timeline_of_a_scheduled_hook(comfy, traced_run):
    plot = importlib.import_module(f"{comfy.pack.__name__}.patcher.trace_plot")
    trace = importlib.import_module(f"{comfy.pack.__name__}.patcher.trace")
    _model, traced, samples = traced_run
    image, report = comfy.pack.NODE_CLASS_MAPPINGS["PatchbayTraceTimeline"]().execute(traced, samples)
    assert image.shape[0] == 1 and image.shape[3] == 3 and image.dtype == torch.float32
    assert image.std() > 0.05
    hook_lanes = [lane for lane in plot.lanes(trace.last_trace(traced)) if lane.kind == "hook"]
    assert len(hook_lanes) == 1
    strengths = [strength for _step, strength, _count in hook_lanes[0].cells]
    assert [step for step, _s, _c in hook_lanes[0].cells] == [0, 1, 2, 3]
    assert strengths[0] == 0.0 and strengths[-1] == 1.0 and strengths == sorted(strengths)
    assert report.startswith("Patchbay trace: 4 steps") and f"hook {hook_lanes[0].name}" in report


def test_timeline_without_a_trace_says_how_to_get_one(comfy, traced_run):
    model, _traced, samples = traced_run
    image, report = comfy.pack.NODE_CLASS_MAPPINGS["PatchbayTraceTimeline"]().execute(model, samples)
    assert image.shape[0] == 1 and image.shape[3] == 3
    assert "no trace recorded for this model: put Trace Sampling (Patchbay) before the sampler" in report
