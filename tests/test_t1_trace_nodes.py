"""T1: Trace Sampling -> a sampler run with a scheduled LoRA hook -> Trace Timeline, nodes called directly."""

from __future__ import annotations

import importlib

import pytest
import torch

pytestmark = pytest.mark.t1

CKPT = "patchbay-sd15-tiny-a.safetensors"
LORA = "patchbay-lora-r4.safetensors"


@pytest.fixture(scope="module")
def traced_run(comfy):
    import comfy.model_management as mm

    n, ours = comfy.nodes.NODE_CLASS_MAPPINGS, comfy.pack.NODE_CLASS_MAPPINGS
    model, clip, _vae = n["CheckpointLoaderSimple"]().load_checkpoint(CKPT)
    (traced,) = ours["PatchbayTrace"]().execute(model)
    (positive,) = n["CLIPTextEncode"]().encode(clip, "a knight in armor")
    (negative,) = n["CLIPTextEncode"]().encode(clip, "blurry")
    (hooks,) = n["CreateHookLora"]().create_hook(LORA, 1.0, 1.0)
    (keyframes,) = n["CreateHookKeyframesFromFloats"]().create_hook_keyframes([0.0, 1.0, 1.0, 1.0], 0.0, 1.0)
    (hooks,) = n["SetHookKeyframes"]().set_hook_keyframes(hooks, keyframes)
    (positive,) = n["ConditioningSetProperties"]().set_properties(positive, 1.0, "default", hooks=hooks)
    (latent,) = n["EmptyLatentImage"]().generate(64, 64, 1)
    (samples,) = n["KSampler"]().sample(traced, 1, 4, 7.0, "euler", "normal", positive, negative, latent)
    yield model, traced, samples
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
