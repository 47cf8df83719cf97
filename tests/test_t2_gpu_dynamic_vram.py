"""T2 on a GPU: Fast Hooks under ComfyUI's real dynamic VRAM (comfy-aimdo, ModelPatcherDynamic).

Marked ``gpu``: conftest deselects it where torch sees no CUDA device (so a CPU run shows no skip).
Run it with ``make test-gpu`` (ComfyUI 0.33; ``COMFYUI=0.3.75`` for the version without dynamic VRAM).

The CPU tiers can only emulate dynamic VRAM (tests/test_t1_hook_engine_dynamic.py). Here ComfyUI
starts as a user's would on an NVIDIA GPU: ``main.py`` without ``--cpu``, so on 0.33 comfy-aimdo
starts and ``ModelPatcherDynamic`` becomes the default patcher ("DynamicVRAM support detected and
enabled"); ``--force-fp32`` keeps the tiny model in fp32, so Fast Hooks and core's path compare
closely. Three prompts on one server, in this order:

    plain  a LoRA-free run
    fast   Fast Hooks + a LoRA hook on the positive prompt: the engine must claim the hook on the
           dynamic patcher (its DEBUG line names the class), and ComfyUI must not load the checkpoint
           again (each load logs one "model_type EPS" line)
    core   the same hook without Fast Hooks: on a dynamic patcher core swaps in its non-dynamic
           delegate, which loads the checkpoint a second time (the proof that the count above sees a
           reload); its latent is the reference for Fast Hooks'
"""

from __future__ import annotations

import re

import devpaths
import pytest
import torch

pytestmark = [pytest.mark.t2, pytest.mark.gpu]

DYNAMIC_ON = "DynamicVRAM support detected and enabled"
MODEL_BUILT = re.compile(r"^model_type ", re.MULTILINE)  # comfy.model_base.BaseModel.__init__
CLAIMED = re.compile(r"(\d+) hook\(s\) run in the forward pass on (\w+)")  # hooks/engine.py, DEBUG


def prompt(kind: str) -> dict:
    """Tiny SD1.5 at 512x512, 6 steps; ``kind``: plain, fast (Fast Hooks) or core (hooks, core's path)."""
    nodes = {
        "ckpt": ("CheckpointLoaderSimple", {"ckpt_name": "patchbay-sd15-tiny-a.safetensors"}),
        "text": ("CLIPTextEncode", {"text": "a knight in silver armor", "clip": ["ckpt", 1]}),
        "negative": ("CLIPTextEncode", {"text": "blurry", "clip": ["ckpt", 1]}),
        "hook": ("CreateHookLora", {"lora_name": "patchbay-lora-r16.safetensors", "strength_model": 1.0,
                                    "strength_clip": 0.0}),
        "positive": ("ConditioningSetProperties", {"cond_NEW": ["text", 0], "strength": 1.0,
                                                   "set_cond_area": "default", "hooks": ["hook", 0]}),
        "fast": ("PatchbayHookEngine", {"model": ["ckpt", 0], "cache_mb": 2048.0, "rounding": "compute"}),
        "latent": ("EmptyLatentImage", {"width": 512, "height": 512, "batch_size": 2}),
        "sampler": ("KSampler", {"model": ["fast" if kind == "fast" else "ckpt", 0], "seed": 3, "steps": 6,
                                 "cfg": 6.0, "sampler_name": "euler", "scheduler": "normal",
                                 "positive": ["text" if kind == "plain" else "positive", 0],
                                 "negative": ["negative", 0], "latent_image": ["latent", 0], "denoise": 1.0}),
        "save": ("SaveLatent", {"samples": ["sampler", 0], "filename_prefix": f"patchbay-tests/gpu/{kind}"}),
    }
    return {key: {"class_type": cls, "inputs": inputs} for key, (cls, inputs) in nodes.items()}


@pytest.fixture(scope="module")
def gpu_server(models):
    from comfy_server import ComfyServer

    log = devpaths.output_dir() / "logs" / f"test-gpu-comfyui-{devpaths.comfyui_version()}.log"
    with ComfyServer(log_path=log, cpu=False, extra_args=("--force-fp32", "--verbose", "DEBUG")) as server:
        yield server


def run(server, kind: str) -> tuple[torch.Tensor, str]:
    """The saved latent of one prompt and the log lines it added."""
    from safetensors.torch import load_file

    before = len(server.log_text())
    result = server.run(prompt(kind))
    assert result.ok, f"{kind}: {result.error}"
    (path,) = result.outputs
    return load_file(path)["latent_tensor"].float(), server.log_text()[before:]


def test_fast_hooks_run_on_the_dynamic_patcher_with_no_second_load(gpu_server):
    dynamic = DYNAMIC_ON in gpu_server.startup_log()
    version = tuple(int(part) for part in devpaths.comfyui_version().split(".")[:2])
    assert dynamic == (version >= (0, 33)), f"dynamic VRAM on ComfyUI {version}: {dynamic}"
    plain, plain_log = run(gpu_server, "plain")
    assert len(MODEL_BUILT.findall(plain_log)) == 1, "the plain run should load the checkpoint once"

    fast, fast_log = run(gpu_server, "fast")
    assert not MODEL_BUILT.findall(fast_log), "Fast Hooks loaded the checkpoint a second time"
    claims = CLAIMED.findall(fast_log)
    assert claims, "the engine claimed no hook"
    patcher = "PatchbayModelPatcherDynamic" if dynamic else "PatchbayModelPatcher"
    assert {cls for _, cls in claims} == {patcher}, claims

    core, core_log = run(gpu_server, "core")
    assert len(MODEL_BUILT.findall(core_log)) == (1 if dynamic else 0), "core's delegate load"
    assert not CLAIMED.findall(core_log)

    effect = (core - plain).abs().max().item()
    assert effect > 1e-2 * (plain.max() - plain.min()).item(), "the hook barely moved the latent"
    # fp32 weights; cuDNN convolutions may use TF32, so the bound is a share of the hook's effect.
    assert (fast - core).abs().max().item() < 0.02 * effect
