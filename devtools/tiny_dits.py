"""Tiny 2026 diffusion transformers (and an SD2.x UNet) that ComfyUI's own loader detects, and LoRAs as their
trainers write them: Fast Hooks must be checked on the families people run today, and none can be
downloaded, so each is built in memory at the smallest width detection allows (``state_dict``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from tiny_weights import Tensors, low_rank_pair, uniform

if TYPE_CHECKING:
    from comfy.model_patcher import ModelPatcher

RANK = 4
LORA_REL = 0.15  # the delta's std relative to the weight's: 2.5 x tiny_models', for a clear effect in 2 steps
_BLOCKS = ("double_blocks.", "single_blocks.", "blocks.", "joint_blocks.", "transformer_blocks.",
           "input_blocks.", "middle_block.", "output_blocks.")


@dataclass(frozen=True)
class LoraFormat:
    """A LoRA layout (a key of LORA_NAMES, or "diffusers") and the linears it trains: module-name endings
    in the blocks (diffusers names for "diffusers")."""

    name: str
    targets: tuple[str, ...]


@dataclass(frozen=True)
class Family:
    """One family: the ComfyUI classes, the tiny config, its latent, conditioning and LoRA format."""

    name: str
    supported: str  # the comfy.supported_models class detection must pick
    model_class: str  # the comfy.model_base class the loader builds
    config: dict[str, Any]  # as comfy/model_detection.py reports it for the tiny file
    latent: tuple[int, ...]  # one sample: (C, H, W) or (C, T, H, W)
    cond: tuple[int, int, int]  # text tokens, token width, pooled width
    loras: tuple[LoraFormat, ...]  # the first is the one the regional and two-stage tests use
    newer_only: bool = False  # ComfyUI 0.3.75 cannot build it small
    unet: bool = False  # an SD UNet: kohya names its modules as diffusers does (``down_blocks_0_...``)

    @property
    def video(self) -> bool:
        return len(self.latent) == 4


_WAN = dict(image_model="wan2.1", model_type="t2v", dim=128, num_heads=1, ffn_dim=256, num_layers=1,
            patch_size=(1, 2, 2), freq_dim=256, window_size=(-1, -1), qk_norm=True, cross_attn_norm=True,
            eps=1e-6)
# diffusers names of the joint attention's projections (Flux.2, SD3.5: q, k, v are slices of qkv)
_ATTN = tuple(f".attn.{p}" for p in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj",
                                     "to_out.0", "to_add_out"))
_FLUX2_SINGLE = (".attn.to_qkv_mlp_proj", ".attn.to_out")
_DOUBLE_SINGLE = ("_attn.qkv", "_attn.proj", "_mlp.0", "_mlp.2", ".linear1", ".linear2")  # Flux-style blocks
_WAN_TARGETS = tuple(f"_attn.{p}" for p in "qkvo") + (".ffn.0", ".ffn.2")
_COSMOS_TARGETS = (*(f"_attn.{p}_proj" for p in "qkv"), "_attn.output_proj", ".mlp.layer1", ".mlp.layer2")
FAMILIES = {f.name: f for f in (
    Family(
        name="flux2", supported="Flux2", model_class="Flux2", newer_only=True,
        config=dict(image_model="flux2", axes_dim=[32, 32, 32, 32], num_heads=1, mlp_ratio=3.0,
                    theta=2000, out_channels=128, global_modulation=True, mlp_silu_act=True, qkv_bias=False,
                    ops_bias=False, default_ref_method="index", ref_index_scale=10.0, txt_ids_dims=[3],
                    patch_size=1, in_channels=128, hidden_size=128, context_in_dim=64, vec_in_dim=None,
                    depth=1, depth_single_blocks=1, guidance_embed=True, yak_mlp=False, txt_norm=False),
        latent=(128, 8, 8), cond=(8, 64, 64),
        loras=(LoraFormat("diffusers", (*_ATTN, ".linear_in", ".linear_out", *_FLUX2_SINGLE)),
               LoraFormat("ai-toolkit", _DOUBLE_SINGLE))),
    Family(
        name="sd35", supported="SD3", model_class="SD3",
        config=dict(in_channels=16, patch_size=2, out_channels=16, depth=2, input_size=None,
                    adm_in_channels=2048, num_patches=64, pos_embed_max_size=8, qk_norm="rms",
                    pos_embed_scaling_factor=None, x_block_self_attn_layers=[],
                    context_embedder_config={"target": "torch.nn.Linear",
                                             "params": {"in_features": 64, "out_features": 128}}),
        latent=(16, 8, 8), cond=(8, 64, 2048),
        loras=(LoraFormat("diffusers", (*_ATTN, ".net.0.proj", ".net.2")),
               LoraFormat("kohya", (".attn.qkv", ".attn.proj", ".mlp.fc1", ".mlp.fc2")))),
    Family(
        name="wan21", supported="WAN21_T2V", model_class="WAN21", config=dict(_WAN, in_dim=16, out_dim=16),
        latent=(16, 2, 8, 8), cond=(8, 4096, 8),
        loras=(LoraFormat("kohya", _WAN_TARGETS), LoraFormat("ai-toolkit", _WAN_TARGETS))),
    Family(
        name="wan22_5b", supported="WAN22_T2V", model_class="WAN22", config=dict(_WAN, in_dim=48, out_dim=48),
        latent=(48, 2, 8, 8), cond=(8, 4096, 8),
        loras=(LoraFormat("ai-toolkit", _WAN_TARGETS), LoraFormat("kohya", _WAN_TARGETS))),
    Family(
        name="hunyuan15", supported="HunyuanVideo15", model_class="HunyuanVideo15",
        config=dict(image_model="hunyuan_video", in_channels=65, patch_size=[1, 1, 1], out_channels=32,
                    vec_in_dim=None, axes_dim=[16, 56, 56], meanflow=False, context_in_dim=64,
                    hidden_size=128, mlp_ratio=4.0, num_heads=1, depth=1, depth_single_blocks=1, theta=256,
                    qkv_bias=True, byt5=False, guidance_embed=False, use_cond_type_embedding=True,
                    vision_in_dim=1152, meanflow_sum=True),
        latent=(32, 2, 8, 8), cond=(8, 64, 8),
        loras=(LoraFormat("diffusion-pipe", _DOUBLE_SINGLE), LoraFormat("kohya", _DOUBLE_SINGLE))),
    Family(
        name="hunyuan10", supported="HunyuanVideo", model_class="HunyuanVideo",
        config=dict(image_model="hunyuan_video", in_channels=16, patch_size=[1, 2, 2], out_channels=16,
                    vec_in_dim=768, axes_dim=[16, 56, 56], meanflow=False, context_in_dim=64,
                    hidden_size=128, mlp_ratio=4.0, num_heads=1, depth=1, depth_single_blocks=1, theta=256,
                    qkv_bias=True, byt5=False, guidance_embed=True, use_cond_type_embedding=False,
                    vision_in_dim=None, meanflow_sum=False),
        latent=(16, 2, 8, 8), cond=(8, 64, 768),
        loras=(LoraFormat("diffusion-pipe", _DOUBLE_SINGLE), LoraFormat("kohya", _DOUBLE_SINGLE))),
    Family(
        name="hunyuan21", supported="HunyuanImage21", model_class="HunyuanImage21",
        config=dict(image_model="hunyuan_video", in_channels=64, patch_size=[1, 1], out_channels=64,
                    vec_in_dim=None, axes_dim=[64, 64], meanflow=False, context_in_dim=64,
                    hidden_size=128, mlp_ratio=4.0, num_heads=1, depth=1, depth_single_blocks=1, theta=256,
                    qkv_bias=True, byt5=False, guidance_embed=False, use_cond_type_embedding=False,
                    vision_in_dim=None, meanflow_sum=False),
        latent=(64, 8, 8), cond=(8, 64, 8),
        loras=(LoraFormat("kohya", _DOUBLE_SINGLE), LoraFormat("comfy-peft", _DOUBLE_SINGLE))),
    Family(
        name="cosmos2", supported="CosmosT2IPredict2", model_class="CosmosPredict2", newer_only=True,
        config=dict(image_model="cosmos_predict2", max_img_h=240, max_img_w=240, max_frames=128,
                    in_channels=16, out_channels=16, patch_spatial=2, patch_temporal=1, model_channels=256,
                    concat_padding_mask=True, crossattn_emb_channels=1024, pos_emb_cls="rope3d",
                    pos_emb_learnable=True, pos_emb_interpolation="crop", min_fps=1, max_fps=30,
                    use_adaln_lora=True, adaln_lora_dim=256, num_blocks=1, extra_per_block_abs_pos_emb=False,
                    rope_h_extrapolation_ratio=4.0, rope_w_extrapolation_ratio=4.0,
                    rope_t_extrapolation_ratio=1.0, extra_h_extrapolation_ratio=1.0,
                    extra_w_extrapolation_ratio=1.0, extra_t_extrapolation_ratio=1.0,
                    rope_enable_fps_modulation=False),
        latent=(16, 1, 8, 8), cond=(8, 1024, 8),
        loras=(LoraFormat("kohya", _COSMOS_TARGETS), LoraFormat("comfy-peft", _COSMOS_TARGETS))),
    Family(
        name="sd2", supported="SD20", model_class="BaseModel", unet=True,
        config=dict(use_checkpoint=False, image_size=32, use_spatial_transformer=True, legacy=False,
                    adm_in_channels=None, in_channels=4, out_channels=4, model_channels=320,
                    num_res_blocks=[1], transformer_depth=[1], transformer_depth_output=[0, 1],
                    channel_mult=[1], transformer_depth_middle=-1, use_linear_in_transformer=True,
                    context_dim=1024, use_temporal_resblock=False, use_temporal_attention=False),
        latent=(4, 8, 8), cond=(8, 1024, 1024),
        loras=(LoraFormat("kohya", (*(f".attn{a}.{p}" for a in (1, 2)
                                      for p in ("to_q", "to_k", "to_v", "to_out.0")),
                                    ".ff.net.0.proj", ".ff.net.2", ".proj_in", ".proj_out")),)),
    Family(
        name="ltxv", supported="LTXV", model_class="LTXV",
        config=dict(image_model="ltxv", num_layers=1, attention_head_dim=4, cross_attention_dim=128,
                    use_keyframes_abs_pos_embedding=False),
        latent=(128, 2, 4, 4), cond=(8, 4096, 8),
        loras=(LoraFormat("ltx-trainer", (*(f".attn{a}.{p}" for a in (1, 2)
                                            for p in ("to_q", "to_k", "to_v", "to_out.0")),
                                          ".ff.net.0.proj", ".ff.net.2")),)),
)}
COND_SHAPES = {f.name: f.cond for f in FAMILIES.values()}


def _diffusion_pipe(module: str) -> str:
    """HunyuanVideo module names as diffusion-pipe writes them (comfy.lora.model_lora_keys_unet undoes it)."""
    return (module.replace("_attn.qkv", "_attn_qkv").replace("_attn.proj", "_attn_proj")
            .replace("mlp.0", "mlp.fc1").replace("mlp.2", "mlp.fc2"))


LORA_NAMES = {  # module name -> (LoRA module name, kohya layout with alpha?)
    "kohya": lambda m: ("lora_unet_" + m.replace(".", "_"), True),
    "ai-toolkit": lambda m: ("diffusion_model." + m, False),
    "diffusion-pipe": lambda m: ("transformer." + _diffusion_pipe(m), False),
    "ltx-trainer": lambda m: ("diffusion_model." + m, False),
    "comfy-peft": lambda m: ("diffusion_model." + m, False),
}
DIFFUSERS_MAPS = {"flux2": "flux_to_diffusers", "sd35": "mmdit_to_diffusers"}  # comfy.utils functions


def newer_comfyui() -> bool:
    """Whether the ComfyUI set for the tests is newer than 0.3.75 (False where none is set: t0 alone
    collects the tests that use this module without one)."""
    import devpaths

    try:
        return devpaths.comfyui_version() != "0.3.75"
    except RuntimeError:
        return False


def families(newer: bool | None = None) -> list[str]:
    """The families the running ComfyUI builds small (``newer``: 0.33, not 0.3.75; default: the
    ComfyUI set for the tests, ``newer_comfyui``)."""
    newer = newer_comfyui() if newer is None else newer
    return [name for name, family in FAMILIES.items() if newer or not family.newer_only]


def _known_fields(config: dict[str, Any], params: type) -> dict[str, Any]:
    """``config`` less the fields the running ComfyUI's params dataclass lacks (0.3.75 has fewer)."""
    known = {f.name for f in dataclasses.fields(params)}
    return {key: value for key, value in config.items() if key in known or key == "image_model"}


def _config(family: Family) -> dict[str, Any]:
    import comfy.ldm.flux.model
    import comfy.ldm.hunyuan_video.model

    params = {"flux2": comfy.ldm.flux.model.FluxParams,
              "hunyuan10": comfy.ldm.hunyuan_video.model.HunyuanVideoParams,
              "hunyuan21": comfy.ldm.hunyuan_video.model.HunyuanVideoParams,
              "hunyuan15": comfy.ldm.hunyuan_video.model.HunyuanVideoParams}.get(family.name)
    return dict(family.config) if params is None else _known_fields(family.config, params)


def _init(key: str, shape: tuple[int, ...], seed: str) -> torch.Tensor:
    """Biases 0, vectors (norm weights and scales) 1, the rest uniform with std 1/sqrt(fan_in)."""
    if key.endswith("bias"):
        return torch.zeros(shape, dtype=torch.float16)
    if len(shape) == 1:
        return torch.ones(shape, dtype=torch.float16)
    return uniform(f"{seed}/{key}", shape, 1.0 / math.sqrt(math.prod(shape[1:])))


def state_dict(family: Family, variant: str = "") -> Tensors:
    """The tiny diffusion model of ``family`` as a diffusion-model-only file would hold it; another
    ``variant`` (e.g. Wan 2.2 14B's "high" and "low" noise experts) has other weights.

    Fast Hooks must be checked on the families people run today, and none can be downloaded, so this
    module builds each family in memory: ComfyUI's own class on the meta device gives the real key
    layout (``double_blocks.0.img_attn.qkv.weight``, ``blocks.0.self_attn.q.weight``, ...) at the smallest
    width detection allows; deterministic weights (tiny_weights.uniform) fill it; and
    ``comfy.sd.load_diffusion_model_state_dict`` (what UNETLoader runs, comfy/model_detection.py
    included) must load it as the expected model config and class, with no key left over or missing. No
    file is written: every DiT is ~1-3 M parameters and builds in well under a second (SD2.x: 18.8 M, 0.6 s).

    Sizes detection fixes (ComfyUI 0.33 unless said):
    - Flux.2: heads = hidden / sum(axes_dim) = hidden / 128, so hidden 128 and one head; 128 latent
      channels, patch 1. ComfyUI 0.3.75 fixes 48 heads (hidden 6144): tested on 0.33 only.
    - Wan 2.1 / 2.2 5B: heads = dim / 128, so dim 128; Wan 2.2 5B is the 48-channel variant (WAN22_T2V);
      the text embedding keeps umT5's 4096 inputs (not detected).
    - SD3.5: hidden = 64 x depth, heads = depth, blocks = depth: 2 joint blocks, 128 wide, RMS q/k norm.
    - HunyuanVideo 1.5: heads = hidden / 128, so hidden 128; its SigLIP input stays 1152 wide (detection
      tells 1.5 from 1.0 by it); 65 input channels (noise, image latent and mask), as the real files.
    - HunyuanVideo 1.0: as 1.5 (heads = hidden / 128), with the 768-wide CLIP-L pooled input (vector_in,
      which tells 1.0 from HunyuanImage 2.1) and guidance_in; 16 channels, patch [1, 2, 2]: 1.65 M parameters.
    - LTX-Video: 32 heads of to_k.shape[0] / 32, so 32 heads of 4 (128 wide); caption input 4096.
    - HunyuanImage 2.1: as HunyuanVideo (heads = hidden / 128), no vector_in and no SigLIP input (detection
      picks HunyuanImage21 by them), 64 channels, patch [1, 1]: 128 wide, 1.49 M. Its ByT5 glyph mapper
      (byt5_in, fixed at 1472-2048-2048, 7.5 M) is left out: detection and the class take a file without it,
      the forward skips it without glyph text, and with it the Extract LoRA test took 2.8 s (0.1 s without).
      Both versions.
    - Cosmos Predict2 (CosmosT2IPredict2): below 2048 wide the class keeps 16 heads, and 128 wide makes 8-wide
      heads that its 3-D RoPE divides by zero, so 256 wide: 2.7 M with one block; text input 1024 wide
      (fixed). ComfyUI 0.3.75 also fixes 10 blocks below 2048 wide (22.8 M): tested on 0.33 only.
    - SD2.x: SD20 needs model_channels 320, context 1024 and linear proj_in/out (heads of 64); one level,
      one res block, transformers in input_blocks.1 and output_blocks.1 only (the middle block one res
      block): 18.8 M, detected as SD20 eps. ComfyUI tells SD2.1 768-v only by the std of
      ``output_blocks.11.1.transformer_blocks.0.norm1.bias``, which takes 12 output blocks (83 M at
      width 320), so the tests make it v-prediction with core's ModelSamplingDiscrete, as for any 768-v
      file it misdetects. Both versions.

    Families that cannot be made small (README-ready; not built here, not parametrized):
    (parameters counted on ComfyUI 0.33's classes with one block or layer of each kind)
    - Qwen-Image: detection reads only in_channels and the block count; the model class fixes 24 heads
      of 128 (3072 wide) and a 3584-wide text input: 380 M parameters, 340 M of them in the one block.
    - Chroma: detection fixes its distilled-guidance approximator (5 layers of 5120, 3072 outputs), whose
      outputs are the blocks' modulations, so hidden 3072 too: 631 M with one double and one single block.
    - Lumina2: only dim 2304 gets heads and RoPE axes from detection (24 heads of 96, axes [32, 32, 32]);
      any other dim keeps NextDiT's 32 heads and axes summing to 128 (dim 4096). 427 M with one layer
      (the two noise and two context refiner layers are fixed).
    - Z-Image: detected by dim 3840 only (30 heads of 128): 909 M with one layer and the refiners.
    - HiDream-I1: detection fixes everything, 20 heads of 128 (2560 wide), 16 double and 32 single blocks
      and the 4096-wide caption projections: the smallest model it loads is the full 17.1 B (one double
      block 424 M, one single 305 M; a file with one of each is detected as 16 + 32 and misses keys).
    - LTX-2 (LTXAV, ComfyUI 0.33 only): the video stream reads its width from attn2.to_k (128 wide is
      fine), but without the file's ``config`` metadata the audio stream keeps 32 heads of 64 (2048 wide)
      and the two text connectors 2 layers of 30 heads of 128 (3840 wide): 868 M with one layer, 709 M
      of them the connectors.
    - Cosmos Predict1 (CosmosT2V): detection fixes 28 blocks of 32 heads at 4096 wide (7.2 B) and 36 blocks
      of 40 heads at any other width: 480 wide (heads of 12) loads as CosmosVideo with 206 M.
    A Wan 2.2 14B is two Wan 2.1-layout models (the high- and the low-noise expert; ComfyUI detects each
    as WAN21_T2V): ``load(FAMILIES["wan21"], "high")`` and ``"low"`` build that pair.
    """
    import comfy.supported_models

    config = getattr(comfy.supported_models, family.supported)(_config(family))
    with torch.device("meta"):
        model = config.get_model({}, device="meta")
    layout = model.diffusion_model.state_dict()
    return {key: _init(key, tuple(t.shape), f"tiny-dit/{family.name}{variant}") for key, t in layout.items()}


def load(family: Family, variant: str = "") -> ModelPatcher:
    """``family``'s tiny model through ComfyUI's loader; refuses a wrong detection or a key mismatch."""
    import comfy.model_base
    import comfy.sd

    tensors = state_dict(family, variant)
    patcher = comfy.sd.load_diffusion_model_state_dict(dict(tensors))
    expected = getattr(comfy.model_base, family.model_class)
    if patcher is None or type(patcher.model) is not expected \
            or type(patcher.model.model_config).__name__ != family.supported:
        built = None if patcher is None else \
            f"{type(patcher.model.model_config).__name__} ({type(patcher.model).__name__})"
        raise RuntimeError(f"ComfyUI loads tiny {family.name} as {built}, not {family.supported} "
                           f"({expected.__name__}): fix its config.")
    loaded = set(patcher.model.diffusion_model.state_dict())
    if loaded != set(tensors):
        raise RuntimeError(f"tiny {family.name}: keys differ from the loaded model's: "
                           f"{sorted(loaded ^ set(tensors))[:5]}")
    return patcher


def _delta_std(shape: tuple[int, ...]) -> float:
    return LORA_REL / math.sqrt(math.prod(shape[1:]))


def _pair(name: str, shape: tuple[int, ...], kohya: bool, seed: str) -> Tensors:
    scale = 0.5 if kohya else 1.0  # kohya: alpha = rank / 2
    down, up = low_rank_pair(shape, RANK, scale, _delta_std(shape), f"{seed}/{name}")
    if kohya:
        return {f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up,
                f"{name}.alpha": torch.tensor(RANK * scale, dtype=torch.float16)}
    return {f"{name}.lora_A.weight": down, f"{name}.lora_B.weight": up}


def _diffusers_module(targets: tuple[str, ...], name: str) -> str | None:
    """The PEFT module of diffusers weight ``name`` when the LoRA trains it (``targets``), else None."""
    module = name.removesuffix(".weight")
    if not (name.endswith(".weight") and module.endswith(targets)):
        return None
    if name.startswith("single_transformer_blocks."):  # Flux.2's diffusers names only its fused linears
        return module if module.endswith(_FLUX2_SINGLE) else None
    return module if name.startswith("transformer_blocks.") else None


def _diffusers_lora(family: Family, targets: tuple[str, ...], patcher: ModelPatcher, seed: str) -> Tensors:
    """PEFT names from ComfyUI's own diffusers map; a tuple target is a slice of a fused weight."""
    import comfy.utils

    mapping = getattr(comfy.utils, DIFFUSERS_MAPS[family.name])(patcher.model.model_config.unet_config)
    weights = patcher.model.diffusion_model.state_dict()
    out: Tensors = {}
    for name, target in mapping.items():
        key, offset = (target[0], target[1]) if isinstance(target, tuple) else (target, None)
        module = _diffusers_module(targets, name)
        if module is None or key not in weights:
            continue
        dim, _, size = offset or (0, 0, None)
        shape = list(weights[key].shape)
        shape[dim] = size or shape[dim]
        out.update(_pair("transformer." + module, tuple(shape), False, seed))
    return out


def lora(family: Family, patcher: ModelPatcher, fmt: LoraFormat | None = None) -> Tensors:
    """A rank-RANK LoRA of ``family`` in format ``fmt`` (default: the family's first), for the model
    ``load(family)`` gave.

    LoRA formats (rank 4, on every attention and MLP linear of the blocks), per family in Family.loras:
    - "diffusers" (Flux.2, SD3.5): PEFT ``transformer.transformer_blocks.0.attn.to_q.lora_A.weight``; ComfyUI
      maps q, k, v (and Flux.2's single-block ``to_qkv_mlp_proj``) onto slices of the fused weights.
    - "kohya": ``lora_unet_<module with _>.lora_down/lora_up`` + alpha, as sd-scripts (SD3.5:
      ``lora_unet_joint_blocks_0_x_block_attn_qkv``) and musubi-tuner (Wan, HunyuanVideo, HunyuanImage 2.1:
      ``lora_unet_blocks_0_self_attn_q``) write them.
    - "ai-toolkit": ``diffusion_model.<module>.lora_A/lora_B`` (ai-toolkit's Wan LoRAs:
      ``diffusion_model.blocks.0.self_attn.q.lora_A.weight``; Flux.2 in its own module names).
    - "diffusion-pipe" (HunyuanVideo 1.0 and 1.5): ``transformer.double_blocks.0.img_attn_qkv.lora_A.weight``.
    - "comfy-peft" (HunyuanImage 2.1, Cosmos Predict2): PEFT in ComfyUI's module names,
      ``diffusion_model.blocks.0.self_attn.q_proj.lora_A.weight`` (ComfyUI maps these for every model).
    - "kohya" on SD2.x: sd-scripts' diffusers-style names (``lora_unet_down_blocks_0_attentions_0_proj_in``),
      from comfy.lora's key map.
    - "ltx-trainer" (LTX-Video): LTX-Video-Trainer's, converted for ComfyUI:
      ``diffusion_model.transformer_blocks.0.attn1.to_q.lora_A.weight`` (the bare ``transformer_blocks.0...``
      names are mapped for LTXV by ComfyUI 0.33 only: 0.3.75's LoraLoader loads nothing of them).
    """
    fmt = fmt or family.loras[0]
    seed = f"tiny-dit-lora/{family.name}/{fmt.name}"
    if fmt.name == "diffusers":
        return _diffusers_lora(family, fmt.targets, patcher, seed)
    names = _unet_kohya_names(patcher) if family.unet else {}
    out: Tensors = {}
    for module_name, module in patcher.model.diffusion_model.named_modules():
        if isinstance(module, torch.nn.Linear) and module_name.startswith(_BLOCKS) \
                and module_name.endswith(fmt.targets):
            name, kohya = LORA_NAMES[fmt.name](module_name)
            out.update(_pair(names.get(module_name, name), tuple(module.weight.shape), kohya, seed))
    return out


def _unet_kohya_names(patcher: ModelPatcher) -> dict[str, str]:
    """UNet module -> the name kohya's sd-scripts write for it, diffusers-style
    (``lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q``), from comfy.lora's key map."""
    import comfy.lora

    ldm = {"lora_unet_" + k.removeprefix("diffusion_model.").removesuffix(".weight").replace(".", "_")
           for k in patcher.model.state_dict() if k.startswith("diffusion_model.")}
    return {key.removeprefix("diffusion_model.").removesuffix(".weight"): name
            for name, key in comfy.lora.model_lora_keys_unet(patcher.model, {}).items()
            if name.startswith("lora_unet_") and name not in ldm}


def deeper(family: Family, blocks: int = 2) -> Family:
    """``family`` with ``blocks`` blocks where it has a single stack of one (Wan, LTX-Video, Cosmos
    Predict2), so a block map can tell two of them apart; other families are returned as they are."""
    field = next((f for f in ("num_layers", "num_blocks") if f in family.config), None)
    if field is None:
        return family
    return dataclasses.replace(family, config={**family.config, field: blocks})


def lycoris(family: Family, patcher: ModelPatcher, algo: str) -> Tensors:
    """A LyCORIS ``algo`` ("loha" or "lokr", tiny_weights' builders: rank RANK, alpha RANK / 2) of
    ``family`` in kohya names (``lora_unet_blocks_0_self_attn_q.hada_w1_a``), on the linears its kohya
    LoRA trains; each module's delta has the std of ``lora``'s."""
    from tiny_weights import MODULE_BUILDERS, LoraSpec

    fmt = next(f for f in family.loras if f.name == "kohya")
    spec = LoraSpec(f"tiny-dit-{algo}/{family.name}", algo, RANK)
    out: Tensors = {}
    for module_name, module in patcher.model.diffusion_model.named_modules():
        if isinstance(module, torch.nn.Linear) and module_name.startswith(_BLOCKS) \
                and module_name.endswith(fmt.targets):
            name, _ = LORA_NAMES["kohya"](module_name)
            shape = tuple(module.weight.shape)
            out.update(MODULE_BUILDERS[algo](name, shape, spec, _delta_std(shape), f"{spec.name}/{name}"))
            out[f"{name}.alpha"] = torch.tensor(spec.alpha, dtype=torch.float16)
    return out


def quantized(family: Family, fmt: str = "fp8mixed") -> tuple[Tensors, dict[str, str]]:
    """``family``'s tiny model with every linear weight of the blocks in one of ComfyUI's quantized
    formats, by devtools/tiny_quant.py's layouts and ComfyUI's own quantizers: "fp8mixed" (float8_e4m3fn,
    per-tensor ``weight_scale``, the ``_quantization_metadata`` header), "fp8scaled" (the older
    ``scaled_fp8`` layout, ``scale_weight`` per layer, every linear of the model) or "nvfp4" (ComfyUI 0.33:
    per-layer ``comfy_quant``); the rest as ``state_dict`` gives it. (tensors, the ``metadata`` argument of
    ``comfy.sd.load_diffusion_model_state_dict``, as a file's header would give it)."""
    import comfy.supported_models
    import tiny_quant

    config = getattr(comfy.supported_models, family.supported)(_config(family))
    with torch.device("meta"):
        model = config.get_model({}, device="meta")
    # scaled fp8: every linear (0.3.75's scaled_fp8_ops cast any linear without a scale to fp8 on load)
    layers = {name for name, module in model.diffusion_model.named_modules()
              if isinstance(module, torch.nn.Linear) and (fmt == "fp8scaled" or name.startswith(_BLOCKS))}
    return tiny_quant.quantize_layers(state_dict(family), fmt, layers)


# ComfyUI-GGUF's tools (convert.py's model classes, lcpp.patch's quantization rules) per family: the names
# that stay F16 (embedders, final layers) and those kept F32 (Wan: the modulation parameters, convert.py's
# keys_hiprec, and the 5-D patch embedding that fix_5d_tensors.py adds back as F32); every other weight of
# 2+ dimensions is quantized
GGUF_LAYOUTS = {
    "sd35": ("sd3", ("final_layer.", "time_text_embed.", "context_embedder.", "t_embedder.", "y_embedder.",
                     "x_embedder."), ("proj_out.weight", "pos_embed"), ()),
    "wan21": ("wan", ("patch_embedding.", "text_embedding.", "time_projection.", "time_embedding.",
                      "img_emb.", "head."), (), ("modulation", "patch_embedding.weight")),
}


def write_gguf(name: str, path: str, qtype: str = "Q8_0") -> None:
    """The tiny ``name`` model (a key of GGUF_LAYOUTS) as a GGUF file laid out as ComfyUI-GGUF's tools lay
    out that family (devtools/tiny_gguf.py's writer) at ``path``, for ComfyUI-GGUF's UnetLoaderGGUF. A file,
    not a state dict: ComfyUI-GGUF reads its tensors only from a file."""
    import tiny_gguf

    arch, keep, keep_exact, f32 = GGUF_LAYOUTS[name]
    layout = tiny_gguf.GgufLayout(arch, "", "", False, keep, keep_exact, f32)
    tiny_gguf.write_gguf(path, dict(sorted(state_dict(FAMILIES[name]).items())), layout, qtype)
