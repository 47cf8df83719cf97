"""T2: Patchbay chained with the real AnimateDiff-Evolved and Advanced-ControlNet in the live server.

The server (fixture ``comfy_server``) loads both packs from the vendor folder next to Patchbay
(devtools/vendor_packs.py: Advanced-ControlNet 2bde95a on ComfyUI 0.3.75, 9e60d8a on 0.33). Prompts
are built here in API format and queued over HTTP, as the frontend would queue them:

    tiny SD1.5 -> [Fast Hooks] -> ADE Use Evolved Sampling (Standard Static context options: 3 frames
    in windows of 2, overlap 1; no motion model) -> [or Fast Hooks here] -> KSampler -> SaveLatent
    positive: two regional prompts (left/right masks), each with its LoRA hook (core's Create Hook
    LoRA + Cond Set Props); both sides through ACN's Apply Advanced ControlNet (or core's Apply
    ControlNet) with the tiny ControlNet (devtools/tiny_controlnet.py), the left-half mask as hint

Fast Hooks before Use Evolved Sampling puts its CALC_COND_BATCH wrapper outside ADE's (it strips the
hooks once per step, ADE then splits the batch into windows); after it, inside (ADE calls it once per
window). Both are run. Tiny on purpose (4x4 latents, 2 steps): the T2 time stays small.

The saved latents are compared: Fast Hooks against core's hook path (float noise: 1e-4 of the
latent's range, fp32 on the CPU), hooks against no hooks (a clear margin), ACN's apply against
core's, and a plain run after all hooked runs against the plain run before them (weights unchanged:
the checkpoint loader's cached model is reused, its weights must be as loaded).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import devpaths
import pytest
import tiny_controlnet
import torch
from vendor_packs import packs_for

pytestmark = pytest.mark.t2

FRAMES, CONTEXT_LENGTH, CONTEXT_OVERLAP = 3, 2, 1  # two context windows: frames 0-1 and 1-2
SIZE = 32  # pixels: a 4x4 latent
NEGATIVE = "blurry, low quality"
SLIDING = "Sliding context window sampling activated"
NO_MOTION_MODELS = "No motion models found"
PACK_NODES = {
    "ComfyUI-AnimateDiff-Evolved": ("ADE_UseEvolvedSampling", "ADE_StandardStaticContextOptions"),
    "ComfyUI-Advanced-ControlNet": ("ACN_AdvancedControlNetApply_v2", "ACN_ControlNetLoaderAdvanced"),
}
NOISE = 1e-4  # float noise, relative to the latent's range


@dataclass(frozen=True)
class Setup:
    """One run: hooks on the regional prompts or not, Fast Hooks or core's path, which ControlNet apply."""

    hooks: bool
    fast: bool = False
    fast_inside: bool = False  # Fast Hooks after Use Evolved Sampling, not before it
    control: str | None = "acn"  # "acn", "core" or None
    negative: str = NEGATIVE


def build_prompt(setup: Setup, prefix: str) -> dict:
    """The API-format prompt of ``setup``; the latent is saved under ``prefix``."""
    into_evolved = "fast" if setup.fast and not setup.fast_inside else "ckpt"
    into_sampler = "fast" if setup.fast_inside else "evolved"
    prompt: dict = {
        "ckpt": node("CheckpointLoaderSimple", ckpt_name="patchbay-sd15-tiny-a.safetensors"),
        "negative": node("CLIPTextEncode", text=setup.negative, clip=["ckpt", 1]),
        "empty": node("SolidMask", value=0.0, width=SIZE, height=SIZE),
        "half": node("SolidMask", value=1.0, width=SIZE // 2, height=SIZE),
        "ctx": node("ADE_StandardStaticContextOptions", context_length=CONTEXT_LENGTH,
                    context_overlap=CONTEXT_OVERLAP),
        "evolved": node("ADE_UseEvolvedSampling", model=[into_evolved, 0], beta_schedule="autoselect",
                        context_options=["ctx", 0]),
        "latent": node("EmptyLatentImage", width=SIZE, height=SIZE, batch_size=FRAMES),
        "sampler": node("KSampler", model=[into_sampler, 0], seed=7, steps=2, cfg=4.0, sampler_name="euler",
                        scheduler="normal", positive=["positive", 0], negative=["negative", 0],
                        latent_image=["latent", 0], denoise=1.0),
        "save": node("SaveLatent", samples=["sampler", 0], filename_prefix=prefix),
    }
    for side, x, text, lora in (("left", 0, "a knight", "patchbay-lora-r16"),
                                ("right", SIZE // 2, "a wizard", "patchbay-lora-r4")):
        prompt[f"{side}_mask"] = node("MaskComposite", destination=["empty", 0], source=["half", 0], x=x, y=0,
                                      operation="add")
        prompt[f"{side}_text"] = node("CLIPTextEncode", text=text, clip=["ckpt", 1])
        props = {"cond_NEW": [f"{side}_text", 0], "strength": 1.0, "set_cond_area": "default",
                 "mask": [f"{side}_mask", 0]}
        if setup.hooks:
            prompt[f"{side}_hook"] = node("CreateHookLora", lora_name=f"{lora}.safetensors",
                                          strength_model=1.0, strength_clip=0.0)
            props["hooks"] = [f"{side}_hook", 0]
        prompt[f"{side}_cond"] = node("ConditioningSetProperties", **props)
    prompt["positive"] = node("ConditioningCombine", conditioning_1=["left_cond", 0],
                              conditioning_2=["right_cond", 0])
    if setup.fast:
        source = "evolved" if setup.fast_inside else "ckpt"
        prompt["fast"] = node("PatchbayHookEngine", model=[source, 0], cache_mb=2048.0, rounding="compute")
    if setup.control:
        add_control(prompt, setup.control)
    return prompt


def add_control(prompt: dict, kind: str) -> None:
    """ControlNet on both sides of the sampler, hinted by the left-half mask as an image."""
    prompt["controlnet"] = node("ControlNetLoader", control_net_name=f"{tiny_controlnet.STEM}.safetensors")
    prompt["hint"] = node("MaskToImage", mask=["left_mask", 0])
    sides = {"positive": ["positive", 0], "negative": ["negative", 0], "control_net": ["controlnet", 0],
             "image": ["hint", 0], "strength": 1.0, "start_percent": 0.0, "end_percent": 1.0}
    apply = "ACN_AdvancedControlNetApply_v2" if kind == "acn" else "ControlNetApplyAdvanced"
    prompt["apply"] = node(apply, **sides)
    prompt["sampler"]["inputs"].update(positive=["apply", 0], negative=["apply", 1])


def node(class_type: str, **inputs) -> dict:
    return {"class_type": class_type, "inputs": inputs}


@dataclass
class Runs:
    """The saved latent of each run, and what the server said about it."""

    latents: dict[str, torch.Tensor] = field(default_factory=dict)
    sliding_lines: dict[str, int] = field(default_factory=dict)  # ADE's "sliding context" log lines
    cached: dict[str, set[str]] = field(default_factory=dict)  # nodes ComfyUI took from its cache
    seconds: float = 0.0


# Run order matters: "plain" first and "plain_again" last (see test_weights_unchanged_after_hooked_runs).
RUNS = {
    "plain": Setup(hooks=False),
    "core": Setup(hooks=True),
    "fast": Setup(hooks=True, fast=True),
    # Wrappers of equal priority run in the order they were added (the outermost first): here ADE's
    # CALC_COND_BATCH wrapper is the outer one and calls Fast Hooks' once per context window.
    "fast_inside": Setup(hooks=True, fast=True, fast_inside=True),
    "fast_core_controlnet": Setup(hooks=True, fast=True, control="core"),
    "fast_no_controlnet": Setup(hooks=True, fast=True, control=None),
    # The same plain run, but with a negative prompt that differs in a trailing space only: the tokens
    # (and so the conditioning) are identical, while the changed text makes ComfyUI execute the sampler
    # again instead of answering from its cache; the checkpoint loader's model is still reused.
    "plain_again": Setup(hooks=False, negative=NEGATIVE + " "),
}


@pytest.fixture(scope="module")
def runs(comfy_server) -> Runs:
    from safetensors.torch import load_file

    out = Runs()
    for name, setup in RUNS.items():
        before = comfy_server.log_text().count(SLIDING)
        result = comfy_server.run(build_prompt(setup, f"patchbay-tests/real_packs/{name}"))
        assert result.ok, f"{name}: {result.error}"
        (path,) = [p for p in result.outputs if p.suffix == ".latent"]
        out.latents[name] = load_file(path)["latent_tensor"].float()
        out.sliding_lines[name] = comfy_server.log_text().count(SLIDING) - before
        out.cached[name] = cached_nodes(comfy_server, result.prompt_id)
        out.seconds += result.seconds
    print(f"\nreal packs on ComfyUI {devpaths.comfyui_version()}: {len(RUNS)} runs in {out.seconds:.1f} s")
    return out


def cached_nodes(comfy_server, prompt_id: str) -> set[str]:
    entry = comfy_server.get_json(f"/api/history/{prompt_id}")[prompt_id]
    messages = dict(entry["status"]["messages"])
    return set(messages.get("execution_cached", {}).get("nodes", []))


def difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to a's range."""
    return ((a - b).abs().max() / (a.max() - a.min())).item()


def test_vendor_packs_import_cleanly(comfy_server, object_info):
    log = comfy_server.startup_log()
    for pack in packs_for(devpaths.comfyui_version()):
        mentions = [line for line in log.splitlines() if f"custom_nodes/{pack.name}" in line]
        timing = [line for line in mentions if re.match(r"\s*[\d.]+ seconds", line)]
        assert len(timing) == 1 and "IMPORT FAILED" not in timing[0], f"{pack.name} import line: {timing}"
        # A traceback through the pack's files, a failed import or an error it logs would name its folder;
        # AnimateDiff-Evolved names its motion model folder once, to say that it has none (none is needed).
        unexpected = [line for line in mentions if line not in timing and NO_MOTION_MODELS not in line]
        assert not unexpected, f"the log mentions {pack.name}:\n" + "\n".join(unexpected)
        module = f"custom_nodes.{pack.name}"
        served = {n for n, info in object_info.items() if info.get("python_module") == module}
        assert set(PACK_NODES[pack.name]) <= served, f"{pack.name} serves {sorted(served)}"


def test_every_run_samples_in_context_windows(runs):
    assert runs.sliding_lines == {name: 1 for name in RUNS}, "ADE did not sample in context windows"
    assert all(latent.shape == (FRAMES, 4, SIZE // 8, SIZE // 8) for latent in runs.latents.values())


def test_fast_hooks_equal_core_hooks_inside_context_windows(runs):
    for name in ("fast", "fast_inside"):
        assert difference(runs.latents[name], runs.latents["core"]) < NOISE, name


def test_hooks_act_inside_context_windows(runs):
    # Every frame, the one both windows hold (1) too: the two regional LoRAs move each frame of the
    # 2-step latent by about 10% of its range (0.3.75 and 0.33 alike); float noise is 1e-4.
    for name in ("core", "fast", "fast_inside"):
        for frame in range(FRAMES):
            moved = difference(runs.latents[name][frame], runs.latents["plain"][frame])
            assert moved > 100 * NOISE, f"{name}: the hooks moved frame {frame} by {moved:.2e} only"


def test_acn_apply_equals_core_controlnet_apply(runs):
    assert difference(runs.latents["fast"], runs.latents["fast_core_controlnet"]) < NOISE
    moved = difference(runs.latents["fast"], runs.latents["fast_no_controlnet"])  # about 35% of the range
    assert moved > 100 * NOISE, f"the ControlNet moved the latent by {moved:.2e} only"


def test_weights_unchanged_after_hooked_runs(runs):
    assert "ckpt" in runs.cached["plain_again"], "the checkpoint was loaded again: nothing left to check"
    assert "sampler" not in runs.cached["plain_again"], "the sampler was not run again"
    assert torch.equal(runs.latents["plain_again"], runs.latents["plain"])
