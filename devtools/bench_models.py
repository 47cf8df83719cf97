"""Models for devtools/bench_hooks.py: the tiny checkpoint, or SD1.5- and SDXL-size UNets with rank-32 LoRAs.

``--arch tiny`` samples the tiny SD1.5 checkpoint of devtools/tiny_models.py. ``--arch
sd15-full`` and ``--arch sdxl-full`` sample real-width UNets, where core's weight swaps
cost what they cost users: ComfyUI's own ``comfy.supported_models.SD15`` / ``SDXL`` classes with
the UNet config ComfyUI's detection reports for a real SD1.5 / SDXL base checkpoint (859.5 M and
2567 M parameters), random weights, stored in fp16. ``--arch sdxl-small`` is sdxl-full's code path
on tiny_arch's 82 M SDXL-family UNet (KOALA-700M's layout): the CPU check of the GPU command.

Data flow::

    ARCHES[name] -> ensure_files(spec)   UNet and two LoRA files in <repo>/.cache/bench/ (git-ignored),
                                         generated once in a child process (deterministic, temp file
                                         + rename; the file names carry CACHE_TAG)
                 -> load(spec, nodes)    BenchInputs: the MODEL from comfy.sd.load_diffusion_model
                                         (what UNETLoader calls, here with fp16 weights on every
                                         device), the four prompts, the two LoRA names

Weights follow tiny_models' initialisation (uniform, fan-in std, norms 1, biases 0, every tensor
from its own seeded stream). The LoRAs are kohya files at rank 32 (alpha 16) on every attention
(to_q/k/v/out), feed-forward and proj_in/proj_out layer of the UNet, as sd-scripts names them:
diffusers-style names for SD1.5 (``lora_unet_down_blocks_0_attentions_0_...``), LDM-style for SDXL
(``lora_unet_input_blocks_4_1_...``); each moves every weight it patches by LORA_REL of its scale.

Prompts: SD1.5 encodes text with the tiny checkpoint's CLIP-L, which is full size (77 x 768 tokens,
as a real SD1.5 gives). SDXL's CLIP-G is too large to build here, so its conditioning is
synthesized in the shapes the UNet takes (devtools/arch_sampling.make_cond), size keys for the image.

CLI (what ensure_files runs): ``python devtools/bench_models.py --arch sd15-full``.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import devpaths
import tiny_arch

if TYPE_CHECKING:
    import torch
    from comfy.model_patcher import ModelPatcher

CACHE_TAG = "v1"  # bump when generation changes: cached files are found by name
RANK = 32
GENERATOR = "devtools/bench_models.py"
TINY_CKPT = "patchbay-sd15-tiny-a.safetensors"
TINY_LORAS = ("patchbay-lora-r4.safetensors", "patchbay-lora-r16.safetensors")
PROMPTS = {"positive": "a knight in armor", "negative": "blurry", "left": "a red castle",
           "right": "a green forest"}
# kohya's default targets in a UNet transformer: attention, feed-forward and the proj_in/proj_out
# around it (linears in SDXL, 1x1 convs in SD1.5), by the end of the weight's key.
LORA_TARGETS = (".to_q.weight", ".to_k.weight", ".to_v.weight", ".to_out.0.weight", ".ff.net.0.proj.weight",
                ".ff.net.2.weight", ".proj_in.weight", ".proj_out.weight")
# The UNet configs comfy/model_detection.py reports for the real SD1.5 and SDXL base checkpoints.
SD15_UNET = {
    "use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True,
    "legacy": False, "adm_in_channels": None, "in_channels": 4, "model_channels": 320,
    "num_res_blocks": [2, 2, 2, 2], "transformer_depth": [1, 1, 1, 1, 1, 1, 0, 0],
    "channel_mult": [1, 2, 4, 4], "transformer_depth_middle": 1, "use_linear_in_transformer": False,
    "context_dim": 768, "transformer_depth_output": [1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
    "use_temporal_resblock": False, "use_temporal_attention": False,
}
SDXL_UNET = {
    "use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True,
    "legacy": False, "num_classes": "sequential", "adm_in_channels": 2816, "in_channels": 4,
    "model_channels": 320, "num_res_blocks": [2, 2, 2], "transformer_depth": [0, 0, 2, 2, 10, 10],
    "channel_mult": [1, 2, 4], "transformer_depth_middle": 10, "use_linear_in_transformer": True,
    "context_dim": 2048, "transformer_depth_output": [0, 0, 0, 2, 2, 2, 10, 10, 10],
    "use_temporal_resblock": False, "use_temporal_attention": False,
}


# Wan 2.1 14B (text to video) as comfy/model_detection.py reports it for the real file, two of its 40
# blocks: 5120 wide, 40 heads, feed-forward 13824, text 4096 (umt5-xxl).
WAN14B_BLOCKS = 2
WAN14B = {
    "image_model": "wan2.1", "model_type": "t2v", "patch_size": (1, 2, 2), "in_dim": 16, "out_dim": 16,
    "dim": 5120, "ffn_dim": 13824, "freq_dim": 256, "text_dim": 4096, "num_heads": 40,
    "num_layers": WAN14B_BLOCKS, "window_size": (-1, -1), "qk_norm": True, "cross_attn_norm": True,
    "eps": 1e-6,
}
# Flux.1 [dev] as comfy/model_detection.py reports it for the real file (3072 wide, 24 heads, T5-XXL's
# 4096-wide text, CLIP-L's 768-wide pooled vector, guidance embedding), one of its 19 double blocks and
# one of its 38 single blocks. The attention couple's DiT path runs on it (issue 34 item 3).
FLUX_DEV = {
    "image_model": "flux", "in_channels": 16, "out_channels": 16, "vec_in_dim": 768, "context_in_dim": 4096,
    "hidden_size": 3072, "mlp_ratio": 4.0, "num_heads": 24, "depth": 1, "depth_single_blocks": 1,
    "axes_dim": [16, 56, 56], "theta": 10000, "qkv_bias": True, "guidance_embed": True, "patch_size": 2,
}
# Text tokens per prompt: a 1024 x 1024 image is 4096 image tokens beside T5's 256 padded text tokens;
# the benchmark's 16 x 16 latent is 64 image tokens, so 4 text tokens keep that 16:1 ratio.
FLUX_TEXT_TOKENS = 4
# kohya's (sd-scripts) Flux targets: every attention and MLP linear of the double blocks (both streams) and
# the single blocks' fused linear1 / linear2 (modulations left out)
FLUX_LORA_TARGETS = tuple(f".{stream}_{part}.weight" for stream in ("img", "txt")
                          for part in ("attn.qkv", "attn.proj", "mlp.0", "mlp.2")) + (
    ".linear1.weight", ".linear2.weight")
# musubi-tuner's and ai-toolkit's Wan targets: every attention (self and cross) and feed-forward linear
WAN_LORA_TARGETS = tuple(f".{attn}.{p}.weight" for attn in ("self_attn", "cross_attn") for p in "qkvo") + (
    ".ffn.0.weight", ".ffn.2.weight")


@dataclass(frozen=True)
class Targets:
    """Ratios a run is held to: Fast Hooks / plain, core / Fast Hooks (regional), seed re-run /
    LoraLoader, peak memory over plain / LoRA files."""

    plain: float
    regional: float
    rerun: float
    memory: float = 1.2


@dataclass(frozen=True)
class ArchSpec:
    """One ``--arch``: what is generated and loaded, and the benchmark's defaults for it."""

    name: str
    title: str
    model_class: str | None  # comfy.supported_models class name; None: the tiny checkpoint
    unet: dict[str, Any] | None
    lora_names: str  # "diffusers" or "ldm": how kohya names the UNet's modules for this model
    sizes: tuple[int, ...]  # latent sides
    steps: int
    rounds: int
    scenarios: tuple[str, ...]
    contenders: tuple[str, ...]
    targets: Targets
    prompts: str = "clip"  # "clip": the tiny checkpoint's CLIP-L; "synthesized": random, SDXL shapes;
    # "wan": random, Wan 2.1's (umt5-xxl's 4096-wide tokens); "flux": random, Flux.1's (T5-XXL, CLIP-L)
    expected_params: int = 0  # UNet parameters, checked when the model is built
    lora_targets: tuple[str, ...] = LORA_TARGETS  # weights the LoRAs patch, by the end of their key
    video: tuple[int, int] | None = None  # (latent channels, frames) of a video model's empty latent

    def unet_file(self) -> str:
        return f"patchbay-bench-{self.name}-{CACHE_TAG}.safetensors"

    def lora_files(self) -> tuple[str, str]:
        if self.model_class is None:
            return TINY_LORAS
        return tuple(f"patchbay-bench-{self.name}-lora-{v}-r{RANK}-{CACHE_TAG}.safetensors" for v in "ab")


ISSUE_4_SCENARIOS = ("positive_lora", "scheduled_lora", "regional_two_loras", "seed_rerun")
# issue 34 item 3: N vertical stripes, a LoRA each, sampled by attention couple (one row) and by rows
REGION_COUNTS = {"regions_2_loras": 2, "regions_4_loras": 4, "regions_8_loras": 8}
ALL_SCENARIOS = (*ISSUE_4_SCENARIOS, *REGION_COUNTS)
ALL_CONTENDERS = ("nohook", "loraloader", "bypass", "core", "patchbay", "couple")
COUPLE_TARGETS = {4: 1.15, 8: 1.30}  # attention couple / plain, by region count (issue 34 item 3)
ISSUE_18 = Targets(plain=1.05, regional=2.0, rerun=1.05)
ARCHES = {
    "tiny": ArchSpec(
        "tiny", "tiny SD1.5 checkpoint", model_class=None, unet=None, lora_names="diffusers", sizes=(8, 16),
        steps=10, rounds=5, scenarios=ALL_SCENARIOS, contenders=ALL_CONTENDERS,
        targets=Targets(plain=1.10, regional=1.5, rerun=1.10)),
    "sd15-full": ArchSpec(
        "sd15-full", "SD1.5-size UNet (859.5 M parameters, fp16), rank-32 LoRAs", model_class="SD15",
        unet=SD15_UNET, lora_names="diffusers", sizes=(16,), steps=10, rounds=5, scenarios=ALL_SCENARIOS,
        contenders=ALL_CONTENDERS, targets=ISSUE_18, expected_params=859_520_964),
    # The sdxl-full code path at a size the CPU samples in seconds: tiny_arch's 82 M SDXL-family UNet
    # (KOALA-700M's layout, model class SDXL), its own rank-32 LoRAs. For checking, not for figures.
    "sdxl-small": ArchSpec(
        "sdxl-small", "small SDXL-family UNet (82 M parameters, fp16), rank-32 LoRAs",
        model_class="KOALA_700M", unet=tiny_arch.SDXL_UNET, lora_names="ldm", sizes=(16,), steps=20, rounds=3,
        scenarios=("regional_two_loras",), contenders=("nohook", "core", "patchbay"), targets=ISSUE_18,
        prompts="synthesized", expected_params=81_932_164),
    "sdxl-full": ArchSpec(
        "sdxl-full", "SDXL-size UNet (2567 M parameters, fp16), rank-32 LoRAs", model_class="SDXL",
        unet=SDXL_UNET, lora_names="ldm", sizes=(128,), steps=20, rounds=3, scenarios=("regional_two_loras",),
        contenders=("nohook", "core", "patchbay"), targets=ISSUE_18, prompts="synthesized",
        expected_params=2_567_463_684),
    # A 2026 DiT at its real width (issue 31 item 7): Wan 2.1 14B's blocks, two of them, one latent frame
    # of 16 x 16 (64 image tokens), 8 text tokens; rank-32 LoRAs on every attention and feed-forward linear.
    "wan-full": ArchSpec(
        "wan-full", f"Wan 2.1 14B width, {WAN14B_BLOCKS} of its 40 blocks (fp16), rank-32 LoRAs",
        model_class="WAN21_T2V", unet=WAN14B, lora_names="ldm", sizes=(16,), steps=4, rounds=3,
        scenarios=ISSUE_4_SCENARIOS, contenders=ALL_CONTENDERS[:-1], targets=ISSUE_18, prompts="wan",
        expected_params=935_508_032, lora_targets=WAN_LORA_TARGETS, video=(16, 1)),
    # Flux.1 [dev] at its real width, one double and one single block (issue 34 item 3: attention couple
    # on a DiT), 4 steps on a 16x16 latent, synthesized T5 / CLIP-L conditioning.
    "flux-full": ArchSpec(
        "flux-full", "Flux.1 [dev] width, 1 of its 19 double and 1 of its 38 single blocks (fp16), rank-32 "
        "LoRAs", model_class="Flux", unet=FLUX_DEV, lora_names="ldm", sizes=(16,), steps=4, rounds=3,
        scenarios=ALL_SCENARIOS, contenders=ALL_CONTENDERS, targets=ISSUE_18, prompts="flux",
        expected_params=545_548_096, lora_targets=FLUX_LORA_TARGETS),
}


def bench_dir() -> Path:
    """Generated full-size models: ``diffusion_models/`` and ``loras/`` below it (git-ignored)."""
    return devpaths.cache_dir() / "bench"


def unet_path(spec: ArchSpec) -> Path:
    return bench_dir() / "diffusion_models" / spec.unet_file()


def lora_paths(spec: ArchSpec) -> list[Path]:
    folder = devpaths.models_dir() if spec.model_class is None else bench_dir()
    return [folder / "loras" / name for name in spec.lora_files()]


# ---- generation (a child process: it imports ComfyUI in CPU mode) ----------------------------------


def ensure_files(spec: ArchSpec) -> None:
    """Generate ``spec``'s UNet and LoRA files unless the cache has them; the tiny models (whose CLIP-L
    encodes the SD1.5 prompts) through tiny_models, where the prompts need them."""
    import tiny_models

    if spec.prompts == "clip":
        tiny_models.ensure_models(devpaths.models_dir())
    if spec.model_class is None or all(path.is_file() for path in (unet_path(spec), *lora_paths(spec))):
        return
    command = [sys.executable, __file__, "--arch", spec.name]
    print(f"generating {spec.name} into {bench_dir()} (once; minutes)", file=sys.stderr)
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr[-4000:]}")
    sys.stderr.write(result.stdout)


def meta_model(spec: ArchSpec) -> torch.nn.Module:
    """``spec``'s BaseModel on the meta device, checked to be what ComfyUI detects from its keys."""
    import comfy.model_detection
    import comfy.supported_models
    import torch

    config_class = getattr(comfy.supported_models, spec.model_class)
    config = tiny_arch.flux_dit(spec.unet) if spec.unet.get("image_model") == "flux" else dict(spec.unet)
    with torch.device("meta"):
        model = config_class(config).get_model({}, device="meta")
    layout = model.diffusion_model.state_dict()
    detected = comfy.model_detection.model_config_from_unet(layout, "")
    params = sum(t.numel() for t in layout.values())
    if type(detected) is not config_class or params != spec.expected_params:
        found = f"{type(detected).__name__} with {params} parameters"
        raise RuntimeError(f"{spec.name}: ComfyUI detects {found}, not {spec.model_class} with "
                           f"{spec.expected_params}: fix its UNet config.")
    return model


def kohya_targets(model: torch.nn.Module, style: str,
                  targets: tuple[str, ...] = LORA_TARGETS) -> dict[str, tuple[int, ...]]:
    """kohya module name -> weight shape for every ``targets`` weight, named the way comfy.lora maps
    them: ``style`` "ldm" is the module path, "diffusers" the other name comfy.lora knows it by."""
    import comfy.lora

    shapes = {key: tuple(t.shape) for key, t in model.state_dict().items() if key.endswith(targets)}
    module = {key: key.removeprefix("diffusion_model.").removesuffix(".weight") for key in shapes}
    ldm_names = {"lora_unet_" + module[key].replace(".", "_"): key for key in shapes}
    if style == "ldm":
        return {name: shapes[key] for name, key in sorted(ldm_names.items())}
    mapped = comfy.lora.model_lora_keys_unet(model, {})
    names = {name: key for name, key in mapped.items()
             if key in shapes and name.startswith("lora_unet_") and name not in ldm_names}
    if sorted(names.values()) != sorted(shapes):
        raise RuntimeError(f"comfy.lora has {len(names)} diffusers-style names for {len(shapes)} weights")
    return {name: shapes[key] for name, key in sorted(names.items())}


def lora_tensors(targets: dict[str, tuple[int, ...]], stem: str) -> dict[str, torch.Tensor]:
    """A kohya LoRA at RANK on ``targets``: each delta of std LORA_REL times its weight's std."""
    import tiny_models
    import torch
    from tiny_weights import LoraSpec, lora_module

    spec, out = LoraSpec(stem, "lora", RANK), {}
    for name, shape in targets.items():
        delta_std = tiny_models.LORA_REL * tiny_models.GAIN / math.sqrt(math.prod(shape[1:]))
        out.update(lora_module(name, shape, spec, delta_std, f"{stem}/{name}"))
        out[f"{name}.alpha"] = torch.tensor(spec.alpha, dtype=torch.float16)
    return out


def generate(spec: ArchSpec) -> None:
    """Write ``spec``'s UNet and LoRAs (each skipped when present); ComfyUI is imported here in CPU mode."""
    import tiny_models

    start = time.perf_counter()
    tiny_models.import_comfy_on_cpu()
    model = meta_model(spec)
    path = unet_path(spec)
    if not path.is_file():
        tensors = tiny_models.init_module(model.diffusion_model, "", f"{path.stem}/unet")
        metadata = tiny_models.model_metadata(path.stem, spec.name, GENERATOR)
        tiny_models.write_safetensors(path, tensors, metadata)
        del tensors
    targets = kohya_targets(model, spec.lora_names, spec.lora_targets)
    for lora in lora_paths(spec):
        if not lora.is_file():
            metadata = {**tiny_models.model_metadata(lora.stem, f"{spec.name}/lora", GENERATOR),
                        "ss_network_module": "networks.lora", "ss_network_dim": str(RANK)}
            tiny_models.write_safetensors(lora, lora_tensors(targets, lora.stem), metadata)
    sizes = ", ".join(f"{p.name} {p.stat().st_size / 2**20:.1f} MiB" for p in (path, *lora_paths(spec)))
    print(f"{spec.name}: {len(targets)} LoRA modules; {sizes} ({time.perf_counter() - start:.0f} s)")


# ---- loading (ComfyUI already imported in-process by the benchmark) --------------------------------


@dataclass(frozen=True)
class BenchInputs:
    """What every contender starts from: the plain MODEL, the CLIP that encoded the prompts (None when
    they are synthesized), the prompts by PROMPTS' names, two LoRA names."""

    model: ModelPatcher
    clip: Any
    prompts: dict[str, Any]
    loras: tuple[str, str]


def load(spec: ArchSpec, n: dict) -> BenchInputs:
    """``spec``'s model and prompts through ComfyUI (``n``: node class mappings); files made first."""
    import folder_paths

    ensure_files(spec)
    if spec.model_class is None:
        model, clip, _vae = n["CheckpointLoaderSimple"]().load_checkpoint(TINY_CKPT)
        return BenchInputs(model, clip, encode_prompts(n, clip), spec.lora_files())
    for folder in ("diffusion_models", "loras"):
        folder_paths.add_model_folder_path(folder, str(bench_dir() / folder))
    if spec.prompts == "clip":  # the CLIP is let go: these LoRAs have no text-encoder keys to map
        prompts = encode_prompts(n, n["CheckpointLoaderSimple"]().load_checkpoint(TINY_CKPT)[1])
    elif spec.prompts == "wan":
        import arch_sampling

        prompts = {name: arch_sampling.make_cond("wan21", seed) for seed, name in enumerate(PROMPTS)}
    elif spec.prompts == "flux":
        prompts = {name: flux_prompt(seed) for seed, name in enumerate(PROMPTS)}
    else:
        prompts = synthesized_prompts(spec)
    return BenchInputs(load_unet(spec), None, prompts, spec.lora_files())


def load_unet(spec: ArchSpec) -> ModelPatcher:
    """What UNETLoader calls (``comfy.sd.load_diffusion_model``), with fp16 weights asked for on every
    device: on the CPU ComfyUI would pick fp32 (and compute in fp32 either way)."""
    import comfy.sd
    import torch

    return comfy.sd.load_diffusion_model(str(unet_path(spec)), model_options={"dtype": torch.float16})


def flux_prompt(seed: int) -> list:
    """Flux.1 conditioning as CLIPTextEncodeFlux and FluxGuidance give it, synthesized at Flux.1 [dev]'s
    widths: FLUX_TEXT_TOKENS T5-XXL tokens, CLIP-L's pooled vector, the default guidance."""
    import arch_sampling

    shape = (FLUX_TEXT_TOKENS, FLUX_DEV["context_in_dim"], FLUX_DEV["vec_in_dim"])
    return arch_sampling.make_cond("flux", seed, shape=shape)


def encode_prompts(n: dict, clip) -> dict[str, Any]:
    return {name: n["CLIPTextEncode"]().encode(clip, text)[0] for name, text in PROMPTS.items()}


def synthesized_prompts(spec: ArchSpec) -> dict[str, Any]:
    """SDXL-shaped conditioning (no CLIP-G here), one seed per prompt, size keys for the arch's image."""
    import arch_sampling

    side = 8 * spec.sizes[-1]
    return {name: arch_sampling.make_cond("sdxl", seed, image_side=side) for seed, name in enumerate(PROMPTS)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", required=True, choices=[a for a, s in ARCHES.items() if s.model_class])
    generate(ARCHES[parser.parse_args(argv).arch])
    return 0


if __name__ == "__main__":
    sys.exit(main())
