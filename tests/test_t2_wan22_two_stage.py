"""T2: the bundled Wan 2.2 two-stage workflow on a live server equals LoraLoader, step by step.

The workflow ("Wan 2.2, LoRA on high noise - Patchbay Hooks") is what a user wires for Wan 2.2 14B: a
high- and a low-noise expert (UNETLoader, ModelSamplingSD3), Fast Hooks on each, two KSamplerAdvanced
(steps 0-2 and 2-4 of 4), the high-noise LoRA hooked on the first stage's conds only, and a style LoRA
hooked on both with one keyframe schedule by sigma. It runs on the tiny experts, LoRAs and Wan 2.1 VAE
of devtools/tiny_wan.py; only umT5-XXL, which cannot be made small, is replaced by test-only 4096-wide
conditioning (devtools/stand_ins.py), as in test_t2_server.py.

The reference is built from core nodes only: four one-step KSamplerAdvanced runs (steps i to i+1 of 4,
the noise added once, the leftover noise handed on), each on its expert with LoraLoaderModelOnly at the
strengths the workflow should give that step: the style LoRA at its keyframe's strength for the step's
sigma (ComfyUI's "simple" schedule of a shift-8 flow model, computed here), the high-noise LoRA on steps
0 and 1 only. The workflow's latent must equal it within 1e-4 of the hooks' effect; and the two
mistakes the test must be able to see are each 100x further off: the high-noise LoRA on the low-noise
steps too, and the schedule restarting at the second sampler (its first keyframe's strength on the
first low-noise step; core avoids it: a keyframe that starts above a run's first sigma has no guaranteed
step, comfy.hooks.HookKeyframe.get_effective_guarantee_steps).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import workflow_catalog
from stand_ins import replace_text_encoders
from workflow_api import workflow_to_prompt

pytestmark = pytest.mark.t2

WORKFLOW = workflow_catalog.bundled_path("wan22_two_stage_lora")
EXACT = 1e-4  # of the hooks' effect on the latent
SEEN = 1e-2  # a mistake must move the latent at least this much of the effect


def node_id(prompt: dict, class_type: str, **inputs) -> str:
    """The one node of ``class_type`` whose inputs include ``inputs``."""
    found = [nid for nid, node in prompt.items() if node["class_type"] == class_type
             and all(node["inputs"].get(key) == value for key, value in inputs.items())]
    assert len(found) == 1, f"{class_type} {inputs}: {found}"
    return found[0]


def flow_sigmas(shift: float, steps: int) -> list[float]:
    """ComfyUI's "simple" scheduler on ModelSamplingSD3(shift) (ModelSamplingDiscreteFlow, 1000 timesteps):
    every (1000 / steps)-th sigma from the top, sigma(t) = shift t / (1 + (shift - 1) t)."""
    ts = [(1000 - int(step * 1000 / steps)) / 1000 for step in range(steps)]
    return [shift * t / (1 + (shift - 1) * t) for t in ts]


def strength_at(schedule: str, sigma: float) -> float:
    """The strength of keyframes ``strength@sigma`` at a step of ``sigma``: the last keyframe whose sigma
    is at or above it (the first keyframe before any)."""
    points = sorted(((float(s), float(at)) for s, at in (item.split("@") for item in schedule.split(", "))),
                    key=lambda point: -point[1])
    return next((s for s, at in reversed(points) if at >= sigma), points[0][0])


class Rig:
    """The bundled prompt (stand-ins in), run with a SaveLatent on the last sampler's output."""

    def __init__(self, server, prompt: dict) -> None:
        self.server, self.prompt = server, prompt
        p = prompt
        self.high = node_id(p, "KSamplerAdvanced", start_at_step=0)
        self.low = node_id(p, "KSamplerAdvanced", add_noise="disable")
        self.steps = p[self.high]["inputs"]["steps"]
        self.split = p[self.high]["inputs"]["end_at_step"]
        self.keyframes = node_id(p, "PatchbayHookKeyframesFromText", positions="sigma")
        self.style = node_id(p, "PatchbayHookLora", hook_kf=[self.keyframes, 0])
        self.high_lora = node_id(p, "PatchbayHookLora", prev_hooks=[self.style, 0])
        # each sampler's model: Fast Hooks <- ModelSamplingSD3 (the reference samples that, LoRAs added)
        self.shifts = {stage: p[p[sampler]["inputs"]["model"][0]]["inputs"]["model"][0]
                       for stage, sampler in (("high", self.high), ("low", self.low))}
        self.runs = 0

    def latent(self, prompt: dict, sampler: str):
        """Run ``prompt`` less its image outputs, saving ``sampler``'s latent; the tensor."""
        from safetensors.torch import load_file

        prompt = {nid: node for nid, node in copy.deepcopy(prompt).items()
                  if node["class_type"] not in ("VAEDecode", "SaveAnimatedPNG")}
        self.runs += 1
        prompt["latent_out"] = {"class_type": "SaveLatent", "inputs": {
            "samples": [sampler, 0], "filename_prefix": f"patchbay_test/wan22_two_stage_{self.runs}"}}
        entry = self.server.wait(self.server.queue(prompt))
        (path,) = [p for p in self.server.output_files(entry) if Path(p).suffix == ".latent"]
        return load_file(str(path))["latent_tensor"]

    def unhooked(self) -> dict:
        prompt = copy.deepcopy(self.prompt)
        for node in prompt.values():
            if node["class_type"] == "PairConditioningSetProperties":
                node["inputs"].pop("hooks")
        return prompt

    def reference(self, style: list[float], high_lora: list[bool]) -> tuple[dict, str]:
        """Core nodes only: one KSamplerAdvanced per step on LoraLoaderModelOnly'd experts; the text
        conds without hooks. (prompt, the last sampler's id)."""
        prompt = {nid: node for nid, node in copy.deepcopy(self.prompt).items()
                  if node["class_type"] in ("UNETLoader", "ModelSamplingSD3", "TinyTextConditioning",
                                            "EmptyHunyuanLatentVideo")}
        conds = self.prompt[node_id(self.prompt, "PairConditioningSetProperties", hooks=[self.style, 0])]
        sampler = self.prompt[self.high]["inputs"]
        latent = sampler["latent_image"]
        for step in range(self.steps):
            model = [self.shifts["high" if step < self.split else "low"], 0]
            loras = [(self.style, style[step])] + ([(self.high_lora, 1.0)] if high_lora[step] else [])
            for index, (hook, strength) in enumerate(loras):
                prompt[f"lora_{step}_{index}"] = {"class_type": "LoraLoaderModelOnly", "inputs": {
                    "model": model, "lora_name": self.prompt[hook]["inputs"]["lora_name"],
                    "strength_model": strength * self.prompt[hook]["inputs"]["strength_model"]}}
                model = [f"lora_{step}_{index}", 0]
            last = step == self.steps - 1
            prompt[f"step_{step}"] = {"class_type": "KSamplerAdvanced", "inputs": {
                **sampler, "model": model, "positive": conds["inputs"]["positive_NEW"],
                "negative": conds["inputs"]["negative_NEW"], "latent_image": latent,
                "add_noise": "enable" if step == 0 else "disable", "start_at_step": step,
                "end_at_step": step + 1, "return_with_leftover_noise": "disable" if last else "enable"}}
            latent = [f"step_{step}", 0]
        return prompt, f"step_{self.steps - 1}"


@pytest.fixture(scope="module")
def rig(comfy_server, object_info, frontend_version) -> Rig:
    workflow = json.loads(WORKFLOW.read_text())
    return Rig(comfy_server, replace_text_encoders(workflow_to_prompt(workflow, object_info,
                                                                      frontend=frontend_version)))


def test_lora_on_the_high_noise_stage_only_and_a_sigma_schedule_across_both_equal_loraloader(rig):
    p = rig.prompt
    shift = p[rig.shifts["high"]]["inputs"]["shift"]
    assert p[rig.shifts["low"]]["inputs"]["shift"] == shift
    low = p[rig.low]["inputs"]
    assert low["start_at_step"] == rig.split and low["end_at_step"] >= rig.steps
    sigmas = flow_sigmas(shift, rig.steps)
    style = [strength_at(p[rig.keyframes]["inputs"]["text"], sigma) for sigma in sigmas]
    high_only = [step < rig.split for step in range(rig.steps)]
    assert len(set(style[:rig.split])) > 1 and style[rig.split - 1] == style[rig.split] != style[0], (
        f"the bundled schedule should change within the first stage and carry on into the second: {style}")

    hooked = rig.latent(p, rig.low)
    effect = (hooked - rig.latent(rig.unhooked(), rig.low)).abs().max().item()
    assert effect > SEEN * hooked.abs().max().item(), "the hooks do (almost) nothing"
    expected = rig.latent(*rig.reference(style, high_only))
    diff = (hooked - expected).abs().max().item()
    assert diff <= EXACT * effect, (f"the workflow vs LoraLoader per step (style {style}, high-noise LoRA on "
                                    f"steps 0-{rig.split - 1}): {diff:.3g} > {EXACT} x {effect:.3g}")

    both_stages = rig.latent(*rig.reference(style, [True] * rig.steps))
    restarted = rig.latent(*rig.reference(style[:rig.split] + [style[0]] + style[rig.split + 1:], high_only))
    for other, what in ((both_stages, "the high-noise LoRA on the low-noise stage too"),
                        (restarted, "the schedule restarting at the second sampler")):
        assert (other - expected).abs().max().item() > SEEN * effect, f"the test cannot tell {what}"
