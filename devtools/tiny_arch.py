"""Tiny SDXL- and Flux-architecture diffusion models and LoRAs that ComfyUI's own loaders detect.

The hook engine must be checked on more than SD1.5, and no weights can be downloaded, so this
module makes UNet/DiT-only files (what the UNETLoader node, ``comfy.sd.load_diffusion_model``,
reads from ``models/diffusion_models``) and LoRAs for them. Generation, hashing and the manifest are
tiny_models' (``ensure_models`` covers these files too); weights follow its initialisation.

SDXL: ``comfy.supported_models`` tells SDXL-family UNets apart only by model_channels (320),
use_linear_in_transformer, context_dim (2048), adm_in_channels (2816) and the encoder's
per-res-block ``transformer_depth``; SDXL [0,0,2,2,10,10], SSD-1B [0,0,2,2,4,4], Segmind Vega
[0,0,1,1,2,2] and KOALA-700M [0,2,5] all build ``comfy.model_base.SDXL``. The smallest is KOALA's
(one res block per level, 7 encoder transformer blocks). Channel multipliers, decoder and middle
depths are read from the file but not matched, so all three levels stay 320 wide, and the middle
block and the decoder's res blocks below the top level get one transformer block each: 82 M
parameters (156 MiB in fp16), SDXL's real key layout (``input_blocks.4.1.transformer_blocks.0.attn2.to_k``),
detected as KOALA_700M, model class SDXL.

Flux: detection fixes num_heads 24 and axes_dim [16, 56, 56], and the model requires
hidden_size / num_heads == sum(axes_dim), so hidden_size must be Flux's 3072. Only the block
counts, context_in_dim and vec_in_dim are free: one double and one single block, 64-wide text
tokens and pooled vector, guidance embedding on (Flux-dev, ``comfy.supported_models.Flux``).
That is 531 M parameters (1 GiB in fp16) and cannot be made smaller for this loader.

LoRAs (rank 8, fp16). The Flux ones patch the attention and the single blocks' fused linears only
(188 M of the 531 M weights): patching every linear made each LoraLoader or hook run cost seconds.
- ``patchbay-sdxl-locon-r8``: kohya, LDM-style ``lora_unet_input_blocks_4_1_...`` names as sd-scripts
  writes them for SDXL: every transformer linear plus the res-block and resampler convs (LoCon).
- ``patchbay-flux-kohya-r8``: kohya ``lora_unet_double_blocks_0_img_attn_qkv`` names.
- ``patchbay-flux-diffusers-r8``: diffusers/PEFT ``transformer.transformer_blocks.0.attn.to_q.lora_A``
  names; ComfyUI maps q, k, v (and the single blocks' mlp) onto slices of the fused weights.
- ``patchbay-flux-bfl-r8``: BFL's own layout (the flux1 canny/depth LoRAs): ``<module>.lora_A/lora_B``
  with ``lora_B.bias``, a 128-channel ``img_in`` and every RMSNorm scale. Only
  ``comfy.lora_convert.convert_lora`` (which LoraLoader runs) maps it to the model.
- ``patchbay-flux-bfl-keep-r8``: the same layout with an ``img_in`` LoRA that keeps the model's 64
  input channels (a BFL-layout LoRA that is not a control LoRA); ComfyUI still adds a
  ``reshape_weight`` to it, equal to the weight's own shape.
"""

from __future__ import annotations

import math

import tiny_models
import torch
from tiny_models import GAIN, LORA_REL, init_module
from tiny_weights import LoraSpec, Tensors, lora_module, low_rank_pair, uniform

SDXL_STEM, FLUX_STEM = "patchbay-sdxl-tiny", "patchbay-flux-tiny"
# The UNet as comfy/model_detection.py reports it for the SDXL file (see the module docstring).
SDXL_UNET = {
    "use_checkpoint": False, "image_size": 32, "use_spatial_transformer": True, "legacy": False,
    "num_classes": "sequential", "adm_in_channels": 2816, "in_channels": 4, "out_channels": 4,
    "model_channels": 320, "num_res_blocks": [1, 1, 1], "transformer_depth": [0, 2, 5],
    "transformer_depth_output": [0, 0, 1, 1, 1, 1], "channel_mult": [1, 1, 1],
    "transformer_depth_middle": 1, "use_linear_in_transformer": True, "context_dim": 2048,
    "use_temporal_resblock": False, "use_temporal_attention": False,
}
# The DiT as comfy/model_detection.py reports it for the Flux file.
FLUX_DIT = {
    "image_model": "flux", "axes_dim": [16, 56, 56], "num_heads": 24, "mlp_ratio": 4.0, "theta": 10000,
    "out_channels": 16, "qkv_bias": True, "in_channels": 16, "hidden_size": 3072, "context_in_dim": 64,
    "patch_size": 2, "vec_in_dim": 64, "depth": 1, "depth_single_blocks": 1, "guidance_embed": True,
}
# FluxParams fields that newer ComfyUI (0.33) requires and its detection fills in; 0.3.75 refuses them.
FLUX_DIT_NEWER = {"txt_ids_dims": []}
RANK = 8
GENERATOR = "devtools/tiny_arch.py"
SDXL_LORA, FLUX_KOHYA, FLUX_DIFFUSERS, FLUX_BFL, FLUX_BFL_KEEP = (
    "patchbay-sdxl-locon-r8", "patchbay-flux-kohya-r8", "patchbay-flux-diffusers-r8", "patchbay-flux-bfl-r8",
    "patchbay-flux-bfl-keep-r8",
)
LORA_STEMS = (SDXL_LORA, FLUX_KOHYA, FLUX_DIFFUSERS, FLUX_BFL, FLUX_BFL_KEEP)
# kohya SDXL targets: transformer linears (attention, feed-forward, linear proj_in/out); LoCon adds
# the res blocks' convs and time-embedding linears, the skip 1x1 convs and the resampler convs.
SDXL_SUFFIXES = (
    ".to_q", ".to_k", ".to_v", ".to_out.0", ".ff.net.0.proj", ".ff.net.2", ".proj_in", ".proj_out",
    ".in_layers.2", ".out_layers.3", ".emb_layers.1", ".skip_connection", ".op", ".conv",
)
FLUX_TARGETS = ("_attn.qkv", "_attn.proj", ".linear1", ".linear2")  # module-name endings
# Flux.2 diffusers names that ComfyUI 0.33 maps onto Flux.1's fused single-block linears too; a Flux.1
# PEFT LoRA has only the per-projection names, so they are left out (and the file is the same on 0.3.75).
FLUX2_DIFFUSERS_NAMES = (".attn.to_qkv_mlp_proj.weight", ".attn.to_out.weight")
BFL_CONTROL_CHANNELS = 128  # img_in of the canny/depth models: 64 latent + 64 control channels


def flux_dit(config: dict | None = None) -> dict:
    """``config`` (FLUX_DIT by default) as the running ComfyUI detects the Flux file: plus the FluxParams
    fields it knows of."""
    import dataclasses

    import comfy.ldm.flux.model

    known = {f.name for f in dataclasses.fields(comfy.ldm.flux.model.FluxParams)}
    return {**(config or FLUX_DIT), **{key: value for key, value in FLUX_DIT_NEWER.items() if key in known}}


def bfl_name(key: str) -> str:
    """Flux files name the RMSNorm weights ``*_norm.scale`` (ComfyUI 0.3.75's own RMSNorm); 0.33 builds
    torch's RMSNorm (``*_norm.weight``) and renames ``.scale`` on load. One name, so one file for both."""
    return key.removesuffix(".weight") + ".scale" if key.endswith("_norm.weight") else key


def unet_rel(stem: str) -> str:
    return f"diffusion_models/{stem}.safetensors"


def lora_rel(stem: str) -> str:
    return f"loras/{stem}.safetensors"


def all_rels() -> list[str]:
    return [unet_rel(SDXL_STEM), unet_rel(FLUX_STEM)] + [lora_rel(s) for s in LORA_STEMS]


def _delta_std(shape: tuple[int, ...]) -> float:
    return LORA_REL * GAIN / math.sqrt(math.prod(shape[1:]))


class ArchModels:
    """ComfyUI's SDXL and Flux classes on the meta device, and the files generation derives from them."""

    def __init__(self) -> None:
        tiny_models.import_comfy_on_cpu()
        import comfy.model_base
        import comfy.model_detection
        import comfy.supported_models
        import comfy.utils

        self.flux_to_diffusers = comfy.utils.flux_to_diffusers
        with torch.device("meta"):
            self.sdxl = comfy.supported_models.KOALA_700M(SDXL_UNET).get_model({}, device="meta")
            self.flux = comfy.supported_models.Flux(flux_dit()).get_model({}, device="meta")
        for model, expected in ((self.sdxl, comfy.model_base.SDXL), (self.flux, comfy.model_base.Flux)):
            layout = model.diffusion_model.state_dict()
            detected = comfy.model_detection.model_config_from_unet(layout, "")
            built = detected and type(detected.get_model({}, device="meta"))
            if built is not expected:
                raise RuntimeError(f"ComfyUI detects tiny {expected.__name__} as {built}: fix its config.")

    def unet(self, stem: str) -> Tensors:
        model = self.sdxl if stem == SDXL_STEM else self.flux
        tensors = init_module(model.diffusion_model, "", f"{stem}/unet")
        return {bfl_name(key): value for key, value in tensors.items()}

    def sdxl_lora(self) -> Tensors:
        out = {}
        for module_name, module in self.sdxl.diffusion_model.named_modules():
            if module_name.endswith(SDXL_SUFFIXES) and isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)):
                name, shape = "lora_unet_" + module_name.replace(".", "_"), tuple(module.weight.shape)
                spec = LoraSpec(SDXL_LORA, "locon", RANK)
                out.update(lora_module(name, shape, spec, _delta_std(shape), f"{SDXL_LORA}/{name}"))
                out[f"{name}.alpha"] = torch.tensor(spec.alpha, dtype=torch.float16)
        return out

    def _flux_linears(self) -> dict[str, tuple[int, ...]]:
        """The linears the Flux LoRAs patch (FLUX_TARGETS), by module name."""
        return {name: tuple(m.weight.shape) for name, m in self.flux.diffusion_model.named_modules()
                if isinstance(m, torch.nn.Linear) and name.endswith(FLUX_TARGETS)}

    def flux_kohya_lora(self) -> Tensors:
        out, spec = {}, LoraSpec(FLUX_KOHYA, "lora", RANK)
        for module_name, shape in self._flux_linears().items():
            name = "lora_unet_" + module_name.replace(".", "_")
            out.update(lora_module(name, shape, spec, _delta_std(shape), f"{FLUX_KOHYA}/{name}"))
            out[f"{name}.alpha"] = torch.tensor(spec.alpha, dtype=torch.float16)
        return out

    def flux_diffusers_lora(self) -> Tensors:
        """PEFT names from ComfyUI's own diffusers map; q/k/v/mlp target slices of the fused weights."""
        shapes = self._flux_linears()
        out = {}
        for name, target in self.flux_to_diffusers(flux_dit()).items():
            in_blocks = name.startswith(("transformer_blocks.", "single_transformer_blocks."))
            if not (in_blocks and name.endswith(".weight")) or name.endswith(FLUX2_DIFFUSERS_NAMES):
                continue
            key, (dim, _, size) = target if isinstance(target, tuple) else (target, (0, 0, None))
            if key.removesuffix(".weight") not in shapes:
                continue
            shape = list(shapes[key.removesuffix(".weight")])
            shape[dim] = size or shape[dim]
            shape, module = tuple(shape), "transformer." + name.removesuffix(".weight")
            down, up = low_rank_pair(shape, RANK, 1.0, _delta_std(shape), f"{FLUX_DIFFUSERS}/{module}")
            out.update({f"{module}.lora_A.weight": down, f"{module}.lora_B.weight": up})
        return out

    def flux_bfl_lora(self, stem: str = FLUX_BFL) -> Tensors:
        """BFL layout: lora_A/lora_B/lora_B.bias on every linear and norm scales; FLUX_BFL (a control
        LoRA) widens img_in to BFL_CONTROL_CHANNELS inputs, FLUX_BFL_KEEP keeps the model's own."""
        out = {}
        own = FLUX_DIT["in_channels"] * FLUX_DIT["patch_size"] ** 2  # 16 latent channels in 2x2 patches
        inputs = BFL_CONTROL_CHANNELS if stem == FLUX_BFL else own
        linears = {**self._flux_linears(), "img_in": (FLUX_DIT["hidden_size"], inputs)}
        for module, shape in linears.items():
            seed = f"{stem}/{module}"
            down, up = low_rank_pair(shape, RANK, 1.0, _delta_std(shape), seed)
            bias = uniform(f"{seed}/bias", shape[:1], _delta_std(shape))
            out.update({f"{module}.lora_A.weight": down, f"{module}.lora_B.weight": up,
                        f"{module}.lora_B.bias": bias})
        for key, param in self.flux.diffusion_model.state_dict().items():
            key = bfl_name(key)
            if key.endswith("_norm.scale"):
                shape = tuple(param.shape)
                out[key] = torch.ones(shape, dtype=torch.float16) + uniform(f"{stem}/{key}", shape, 0.1)
        return out

    def build(self, rel: str) -> tuple[Tensors, dict[str, str]]:
        """Tensors and safetensors metadata of the file at ``rel``."""
        architecture = {SDXL_STEM: "stable-diffusion-xl-v1-base", FLUX_STEM: "flux-1-dev"}
        for stem in architecture:
            if rel == unet_rel(stem):
                return self.unet(stem), tiny_models.model_metadata(stem, architecture[stem], GENERATOR)
        builders = {SDXL_LORA: self.sdxl_lora, FLUX_KOHYA: self.flux_kohya_lora,
                    FLUX_DIFFUSERS: self.flux_diffusers_lora, FLUX_BFL: self.flux_bfl_lora,
                    FLUX_BFL_KEEP: lambda: self.flux_bfl_lora(FLUX_BFL_KEEP)}
        stem = next(s for s in LORA_STEMS if rel == lora_rel(s))
        base = architecture[SDXL_STEM] if stem == SDXL_LORA else architecture[FLUX_STEM]
        return builders[stem](), tiny_models.model_metadata(stem, f"{base}/lora", GENERATOR)
