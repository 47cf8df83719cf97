"""The model families the merge library knows: one table, read by detection, block maps and the refusal
of cross-family merges (restated from ComfyUI's model detection, since merge/ imports no ComfyUI).
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

DIFFUSION_PREFIX = "model.diffusion_model."
UNKNOWN = "unknown"
# keys of a whole checkpoint outside the diffusion model (text encoders, VAE, EMA)
OUTSIDE = ("text_encoders.", "vae.", "cond_stage_model.", "first_stage_model.", "conditioner.", "model_ema.")
_TEXT_VAE = (("text_encoders.", "text_encoder"), ("vae.", "vae"))  # ComfyUI's checkpoint layout for DiTs
_CROSS_ATTENTION = "*put_blocks.*.1.transformer_blocks.0.attn2.to_k.weight"  # input or output blocks


@dataclass(frozen=True)
class Probe:
    """A key glob (diffusion-model keys, no prefix) that some key of the file matches; with ``sizes``,
    such a key's ``shape[dim]`` must also be one of them."""

    key: str
    dim: int = 0
    sizes: tuple[int, ...] = ()


@dataclass(frozen=True)
class Family:
    """One row of the table (see the module docstring).

    Each ``Family`` says how a file of it is recognised (``rules``: key globs and, where ComfyUI tells
    families apart by a width, a shape; re-stated from ComfyUI's ``comfy/model_detection.py`` and
    ``comfy/supported_models.py``, 0.33, since ``merge/`` imports no ComfyUI) and how its diffusion model
    is cut into blocks (``groups``: indexed blocks such as ``double_blocks.N``, counted from the file;
    ``head``/``tail``: the modules before and after them). Keys are matched without ComfyUI's
    ``model.diffusion_model.`` prefix, so whole checkpoints and diffusion-model-only files are read alike.
    Families are tried in table order; the first whose rule holds wins (Flux.2, Chroma and HunyuanVideo
    before Flux.1, which shares ``double_blocks``). A file that matches none is ``unknown``: it still
    merges key by key, without block names.

    A file's ``layout`` is its block count per group (Flux.2 [dev]: 8 double + 48 single blocks, Klein
    fewer; Wan 1.3B 30, 14B 40): two inputs merge when family and layout agree (``same_layout``). The
    UNet families (SD1.5, SD2, SDXL) keep sd-mecha's fixed supermerger block names (``IN00``.., ``M00``,
    ``OUT00``..) whatever their depth; every other family names blocks after its modules.
    """

    id: str
    name: str
    comfy: str  # what ComfyUI calls it: its image_model or model config class
    rules: tuple[tuple[Probe, ...], ...]  # the file is of this family when every probe of one rule holds
    unless: tuple[str, ...] = ()  # key globs that rule it out (a later family of the same keys)
    # (indexed block template, count of the reference release): a file's count of a group is the highest
    # index of its keys matching the template, plus one (``layout_of``); no file, the reference count
    groups: tuple[tuple[str, int], ...] = ()
    head: tuple[str, ...] = ()  # modules before the groups (block names when no file is at hand)
    tail: tuple[str, ...] = ()
    unet: bool = False  # sd-mecha's fixed IN/M/OUT block names
    components: tuple[tuple[str, str], ...] = _TEXT_VAE  # key prefix -> sd-mecha component
    reference: str = ""  # which release the reference counts describe


def _rule(*probes: str | Probe) -> tuple[Probe, ...]:
    return tuple(p if isinstance(p, Probe) else Probe(p) for p in probes)


def _context(*sizes: int) -> Probe:
    """The UNet's cross-attention context width (any transformer: reduced-depth UNets lack some)."""
    return Probe(_CROSS_ATTENTION, 1, sizes)


_UNET_GROUPS = (("input_blocks.{n}", 12), ("output_blocks.{n}", 12))
_FLUX_HEAD = ("img_in", "txt_in", "time_in", "vector_in", "guidance_in")
_SD_COMPONENTS = (("cond_stage_model.", "clip_l"), ("first_stage_model.", "vae"), ("model_ema.", "ema"))
_REFINER = "txt_in.individual_token_refiner.blocks.0.norm1.weight"
_LUMINA = ("cap_embedder.1.weight", "noise_refiner.0.attention.k_norm.weight")
_LUMINA_GROUPS = (("noise_refiner.{n}", 2), ("context_refiner.{n}", 2))

FAMILIES: tuple[Family, ...] = (
    Family(
        "sdxl",
        "SDXL",
        "SDXL (SSD1B, Segmind_Vega, KOALA_*)",
        (_rule(_context(2048, 1280)),),
        groups=(("input_blocks.{n}", 9), ("output_blocks.{n}", 9)),
        unet=True,
        reference="SDXL base",
        components=(
            ("conditioner.embedders.0.", "clip_l"),
            ("conditioner.embedders.1.", "clip_g"),
            ("first_stage_model.", "vae"),
        ),
    ),
    Family(
        "sd2",
        "SD2.x",
        "SD20",
        (_rule(_context(1024)),),
        groups=_UNET_GROUPS,
        unet=True,
        reference="SD 2.1",
        components=(("cond_stage_model.", "clip_h"), *_SD_COMPONENTS[1:]),
    ),
    Family(
        "sd15",
        "SD1.5",
        "SD15",
        (_rule(_context(768)),),
        groups=_UNET_GROUPS,
        unet=True,
        reference="SD 1.5",
        components=_SD_COMPONENTS,
    ),
    Family(
        "sd3",
        "SD3/3.5",
        "SD3 (mmdit)",
        (_rule("joint_blocks.0.context_block.attn.qkv.weight"),),
        groups=(("joint_blocks.{n}", 24),),
        head=("pos_embed", "x_embedder", "t_embedder", "y_embedder", "context_embedder"),
        tail=("final_layer",),
        reference="SD3.5 Medium (Large: 38)",
    ),
    Family(
        "hunyuan_video15",
        "HunyuanVideo 1.5",
        "HunyuanVideo15",
        (_rule(_REFINER, "vision_in.proj.0.weight"),),
        groups=(("double_blocks.{n}", 54), ("single_blocks.{n}", 0)),
        head=("img_in", "txt_in", "time_in", "vision_in", "cond_type_embedding", "byt5_in"),
        tail=("final_layer",),
        reference="HunyuanVideo 1.5 8.3B",
    ),
    Family(
        "hunyuan_video",
        "HunyuanVideo",
        "HunyuanVideo",
        (_rule(_REFINER, "vector_in.in_layer.weight"),),
        groups=(("double_blocks.{n}", 20), ("single_blocks.{n}", 40)),
        head=_FLUX_HEAD,
        tail=("final_layer",),
        reference="HunyuanVideo 1.0",
    ),
    Family(
        "hunyuan_image21",
        "HunyuanImage 2.1",
        "HunyuanImage21",
        (_rule(_REFINER),),
        groups=(("double_blocks.{n}", 20), ("single_blocks.{n}", 40)),
        head=("img_in", "txt_in", "time_in", "byt5_in"),
        tail=("final_layer",),
        reference="HunyuanImage 2.1",
    ),
    Family(
        "chroma",
        "Chroma",
        "Chroma",
        (_rule("double_blocks.0.img_attn.qkv.weight", "distilled_guidance_layer*norms.0.*"),),
        groups=(("double_blocks.{n}", 19), ("single_blocks.{n}", 38)),
        head=("img_in", "txt_in", "distilled_guidance_layer"),
        tail=("final_layer",),
        reference="Chroma1-HD",
    ),
    Family(
        "flux2",
        "Flux.2",
        "Flux2",
        (_rule("double_blocks.0.img_attn.qkv.weight", "double_stream_modulation_img.lin.weight"),),
        groups=(("double_blocks.{n}", 8), ("single_blocks.{n}", 48)),
        head=(
            "img_in",
            "txt_in",
            "time_in",
            "guidance_in",
            "double_stream_modulation_img",
            "double_stream_modulation_txt",
            "single_stream_modulation",
        ),
        tail=("final_layer",),
        reference="Flux.2 [dev] (Klein 4B: 5 + 20, 9B: 8 + 24)",
    ),
    Family(
        "flux",
        "Flux.1",
        "Flux, FluxSchnell, FluxInpaint",
        (_rule("double_blocks.0.img_attn.qkv.weight"),),
        unless=("latent_in.weight",),  # Hunyuan3D 2 shares the Flux blocks
        groups=(("double_blocks.{n}", 19), ("single_blocks.{n}", 38)),
        head=_FLUX_HEAD,
        tail=("final_layer",),
        components=(("text_encoders.", "clip_l"), ("vae.", "vae")),
        reference="Flux.1 [dev]/[schnell]",
    ),
    Family(
        "ltxav",
        "LTX-2 (audio + video)",
        "LTXAV",
        (_rule("adaln_single.emb.timestep_embedder.linear_1.bias", "audio_adaln_single.linear.weight"),),
        unless=("pos_embed.proj.bias",),
        groups=(("transformer_blocks.{n}", 48),),
        head=(
            "patchify_proj",
            "audio_patchify_proj",
            "adaln_single",
            "audio_adaln_single",
            "caption_projection",
        ),
        tail=("scale_shift_table", "proj_out"),
        reference="LTX-2 19B",
    ),
    Family(
        "ltxv",
        "LTX-Video",
        "LTXV",
        (_rule("adaln_single.emb.timestep_embedder.linear_1.bias"),),
        unless=("pos_embed.proj.bias",),  # PixArt in diffusers' layout
        groups=(("transformer_blocks.{n}", 28),),
        head=("patchify_proj", "adaln_single", "caption_projection"),
        tail=("scale_shift_table", "proj_out"),
        reference="LTX-Video 2B (13B: 48)",
    ),
    Family(
        "cosmos",
        "Cosmos (Predict1)",
        "CosmosT2V, CosmosI2V",
        (_rule("blocks.block0.blocks.0.block.attn.to_q.0.weight"),),
        groups=(("blocks.block{n}", 28),),
        head=("x_embedder", "extra_pos_embedder", "t_embedder", "affline_norm"),
        tail=("final_layer",),
        reference="Cosmos-1.0 Diffusion 7B (14B: 36)",
    ),
    Family(
        "anima",
        "Anima",
        "Anima (Cosmos Predict2 with an LLM adapter)",
        (_rule("blocks.0.mlp.layer1.weight", "llm_adapter.blocks.0.cross_attn.q_proj.weight"),),
        groups=(("blocks.{n}", 28),),
        head=("x_embedder", "t_embedder", "t_embedding_norm", "llm_adapter"),
        tail=("final_layer",),
        reference="Anima (Cosmos Predict2 2B)",
    ),
    Family(
        "cosmos_predict2",
        "Cosmos Predict2",
        "CosmosT2IPredict2, CosmosI2VPredict2",
        (_rule("blocks.0.mlp.layer1.weight"),),
        groups=(("blocks.{n}", 28),),
        head=("x_embedder", "t_embedder", "t_embedding_norm"),
        tail=("final_layer",),
        reference="Cosmos Predict2 2B (14B: 36)",
    ),
    # ComfyUI tells Z-Image from Lumina2 by its width (dim 3840); its modulation without a SiLU in front
    # (adaLN_modulation.0, Lumina2's is .1) says the same at any width
    Family(
        "z_image",
        "Z-Image",
        "ZImage (lumina2, dim 3840)",
        (
            _rule(*_LUMINA, "layers.0.adaLN_modulation.0.weight"),
            _rule(*_LUMINA, Probe("cap_embedder.1.weight", 0, (3840,))),
        ),
        groups=(("layers.{n}", 30), *_LUMINA_GROUPS),
        head=("x_embedder", "t_embedder", "cap_embedder", "x_pad_token", "cap_pad_token"),
        tail=("final_layer",),
        reference="Z-Image Turbo",
    ),
    Family(
        "lumina2",
        "Lumina 2 (Neta Lumina, NewBie)",
        "Lumina2",
        (_rule(*_LUMINA),),
        groups=(("layers.{n}", 26), *_LUMINA_GROUPS),
        head=("x_embedder", "t_embedder", "cap_embedder"),
        tail=("final_layer",),
        reference="Lumina-Image 2.0",
    ),
    Family(
        "hidream",
        "HiDream-I1",
        "HiDream",
        (_rule("caption_projection.0.linear.weight"),),
        unless=("t_embedder1.mlp.0.weight",),  # HiDream-O1
        groups=(("double_stream_blocks.{n}", 16), ("single_stream_blocks.{n}", 32)),
        head=("t_embedder", "p_embedder", "x_embedder", "caption_projection"),
        tail=("final_layer",),
        reference="HiDream-I1 Full/Dev/Fast",
    ),
    Family(
        "qwen_image",
        "Qwen-Image",
        "QwenImage",
        (_rule("txt_norm.weight", "img_in.weight", "transformer_blocks.0.img_mod.1.weight"),),
        groups=(("transformer_blocks.{n}", 60),),
        head=("img_in", "txt_norm", "txt_in", "time_text_embed"),
        tail=("norm_out", "proj_out"),
        reference="Qwen-Image (and Edit)",
    ),
    # Wan 2.2 TI2V 5B predicts 48 latent channels (head 48 x patch 1x2x2 = 192 rows); Wan 2.2 A14B's
    # high- and low-noise models have Wan 2.1 14B's layout
    Family(
        "wan22_5b",
        "Wan 2.2 TI2V 5B",
        "WAN22_T2V",
        (_rule("head.modulation", Probe("head.head.weight", 0, (192,))),),
        groups=(("blocks.{n}", 30),),
        head=("patch_embedding", "text_embedding", "time_embedding", "time_projection"),
        tail=("head",),
        reference="Wan 2.2 TI2V 5B",
    ),
    Family(
        "wan21",
        "Wan 2.1 / Wan 2.2 A14B",
        "WAN21_T2V, WAN21_I2V, ...",
        (_rule("head.modulation"),),
        groups=(("blocks.{n}", 40),),
        head=("patch_embedding", "text_embedding", "time_embedding", "time_projection", "img_emb"),
        tail=("head",),
        reference="Wan 2.1 14B (1.3B: 30)",
    ),
)
BY_ID: dict[str, Family] = {f.id: f for f in FAMILIES}


@dataclass(frozen=True)
class Detected:
    """What ``detect`` found: family id (or ``unknown``), whether the keys lack ComfyUI's
    ``model.diffusion_model.`` prefix (a diffusion-model-only file), and the block counts."""

    family: str
    unet_only: bool
    layout: tuple[tuple[str, int], ...] = ()


def detect(shapes: Mapping[str, Sequence[int]]) -> Detected:
    """The family of a model file from its key names and shapes (``{key: shape}``, LoRAs excluded)."""
    for prefix, unet_only in ((DIFFUSION_PREFIX, False), ("", True)):
        body = {k[len(prefix) :]: s for k, s in shapes.items() if k.startswith(prefix)} if prefix else shapes
        if body and (family := _first_match(body)) is not None:
            return Detected(family.id, unet_only, _count(family, body))
    return Detected(UNKNOWN, False)


# prefixes LoRA files put before the diffusion model's module path (kohya, diffusers, PEFT, ComfyUI)
LORA_PREFIXES = ("lora_unet_", "lora_transformer_", "base_model.model.", "diffusion_model.", "transformer.",
                 "unet.", DIFFUSION_PREFIX)
# diffusers names of a UNet attention block -> an LDM name the cross-attention probe matches
_DIFFUSERS_ATTENTION = re.compile(r"^(?:down|up)_blocks_\d+_attentions_\d+_")


def detect_lora(shapes: Mapping[str, Sequence[int]]) -> str:
    """The family a LoRA file was made for, from its module names (without the ``.lora_up.weight``
    part) and the shapes of the weights they patch; ``unknown`` when no rule holds (a text-encoder-only
    LoRA, a naming this table does not know). kohya writes a key's dots as underscores, so names and
    the table's key globs are compared with both read as ``_``."""
    body: dict[str, Sequence[int]] = {}
    for module, shape in shapes.items():
        if not module.startswith(LORA_PREFIXES):
            continue  # text encoders
        name = next(module[len(p):] for p in LORA_PREFIXES if module.startswith(p)).replace(".", "_")
        body[name + "_weight"] = shape
        if _DIFFUSERS_ATTENTION.match(name):
            body[_DIFFUSERS_ATTENTION.sub("input_blocks_1_1_", name) + "_weight"] = shape
    for family in FAMILIES:
        rules = [[Probe(p.key.replace(".", "_"), p.dim, p.sizes) for p in rule] for rule in family.rules]
        if any(all(_holds(p, body) for p in rule) for rule in rules) and not any(
            _holds(Probe(glob.replace(".", "_")), body) for glob in family.unless
        ):
            return family.id
    return UNKNOWN


def _first_match(body: Mapping[str, Sequence[int]]) -> Family | None:
    for family in FAMILIES:
        if any(all(_holds(p, body) for p in rule) for rule in family.rules) and not any(
            _holds(Probe(glob), body) for glob in family.unless
        ):
            return family
    return None


def _holds(probe: Probe, body: Mapping[str, Sequence[int]]) -> bool:
    if not _is_glob(probe.key):
        keys: Iterable[str] = (probe.key,) if probe.key in body else ()
    else:
        match = _glob(probe.key)
        keys = (k for k in body if match(k))
    return any(
        not probe.sizes or (len(body[k]) > probe.dim and body[k][probe.dim] in probe.sizes) for k in keys
    )


@functools.cache
def _glob(pattern: str):
    return re.compile(fnmatch.translate(pattern)).match


@functools.cache
def _group_pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(r"\{n\}", r"(\d+)") + r"\.")


def body_of(key: str) -> str | None:
    """The diffusion-model part of a key (prefix removed); None for text encoder, VAE and EMA keys."""
    if key.startswith(DIFFUSION_PREFIX):
        return key[len(DIFFUSION_PREFIX) :]
    return None if key.startswith(OUTSIDE) else key


def group_block(family: Family, body: str) -> tuple[str, int] | None:
    """``(template, index)`` of the indexed block a diffusion-model key belongs to, if any."""
    for template, _ in family.groups:
        if m := _group_pattern(template).match(body):
            return template, int(m[1])
    return None


def _count(family: Family, keys: Iterable[str]) -> tuple[tuple[str, int], ...]:
    counts = dict.fromkeys((t for t, _ in family.groups), 0)
    for key in keys:
        body = body_of(key)
        if body is not None and (found := group_block(family, body)) is not None:
            counts[found[0]] = max(counts[found[0]], found[1] + 1)
    return tuple(counts.items())


def layout_of(family_id: str, keys: Iterable[str]) -> tuple[tuple[str, int], ...]:
    """Block count per indexed group of ``keys`` (canonical or diffusion-model-only): max index + 1."""
    family = BY_ID.get(family_id)
    return _count(family, keys) if family is not None else ()


def comparable_layout(family_id: str, keys: Iterable[str]) -> tuple[tuple[str, int], ...]:
    """The block counts two files of ``family_id`` must share to merge: every group's for the module-named
    families; none for the UNets, whose sd-mecha block names do not depend on depth (a reduced-depth or
    partial UNet merges key by key under the missing-key policy)."""
    family = BY_ID.get(family_id)
    return () if family is None or family.unet else _count(family, keys)


def reference_layout(family_id: str) -> tuple[tuple[str, int], ...]:
    """The block counts of the family's reference release (block names when no file is at hand)."""
    family = BY_ID.get(family_id)
    return family.groups if family is not None else ()


def describe(family_id: str, layout: Collection[tuple[str, int]] = ()) -> str:
    """``flux2 (Flux.2, 8 double_blocks + 48 single_blocks)`` for messages."""
    family = BY_ID.get(family_id)
    if family is None:
        return f"{family_id} (no known family)"
    counts = " + ".join(f"{n} {t.replace('.{n}', '').replace('{n}', 'N')}" for t, n in layout if n)
    return f"{family_id} ({family.name}{', ' + counts if counts else ''})"


def from_comfy_classes(class_names: Iterable[str]) -> str | None:
    """The family whose ``comfy`` column names one of ``class_names`` (a ComfyUI model config class and
    its bases, most specific first: ``KOALA_700M``, ``SDXL``, ...), for a loaded model whose weights
    do not show their shapes (quantized layouts); None when none does."""
    for name in class_names:
        for family in FAMILIES:
            if any(fnmatch.fnmatchcase(name, word) for word in re.findall(r"[\w*]+", family.comfy)):
                return family.id
    return None


def _is_glob(pattern: str) -> bool:
    return any(ch in pattern for ch in "*?[")
