"""kohya LoRA module names -> checkpoint keys, numbered from a fixed UNet layout per architecture, so a
pruned or partial file maps every key exactly as the full model does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .architectures import BY_ID

UNET = "model.diffusion_model."
TEXT_ENCODERS = (("cond_stage_model.transformer.", "lora_te_"),
                 ("conditioner.embedders.0.transformer.", "lora_te1_"))
RESNET = {"in_layers.0": "norm1", "in_layers.2": "conv1", "emb_layers.1": "time_emb_proj",
          "out_layers.0": "norm2", "out_layers.3": "conv2", "skip_connection": "conv_shortcut"}
BASIC = {"input_blocks.0.0": ("conv_in",), "time_embed.0": ("time_embedding.linear_1",),
         "time_embed.2": ("time_embedding.linear_2",), "out.0": ("conv_norm_out",), "out.2": ("conv_out",),
         "label_emb.0.0": ("add_embedding.linear_1", "class_embedding.linear_1"),
         "label_emb.0.2": ("add_embedding.linear_2", "class_embedding.linear_2")}
_BLOCK = re.compile(r"(input_blocks\.\d+\.0\.op|output_blocks\.\d+\.\d\.conv|input_blocks\.\d+\.\d|"
                    r"output_blocks\.\d+\.\d|middle_block\.\d)(?:\.|$)")


@dataclass(frozen=True)
class UNetLayout:
    """Per level, top to bottom: (resnets in the level's down block, whether it has attention).

    kohya names a UNet module either by its LDM path (``lora_unet_input_blocks_1_1_proj_in``, read off
    the key itself) or by its diffusers path (``lora_unet_down_blocks_0_attentions_0_proj_in``). The
    diffusers numbering is a property of the architecture, not of the keys a file happens to hold: it
    comes from ``UNetLayout`` (resnets per level, which levels have attention), built the way ComfyUI's
    ``comfy.utils.unet_to_diffusers`` builds it. SD1.5 and SDXL use their fixed layouts, so a UNet-only,
    pruned or partial file maps every key it has exactly as the full model does. A file whose blocks
    do not fit the fixed layout of its architecture (a reduced-depth test UNet) has its layout read
    off its input blocks instead, as ComfyUI's model detection does. Text encoders: ``lora_te_`` /
    ``lora_te1_`` + the Hugging Face CLIP path.
    """

    levels: tuple[tuple[int, bool], ...]

    def blocks(self) -> dict[str, str]:
        """LDM block prefix -> diffusers prefix (``output_blocks.11.1`` -> ``up_blocks.3.attentions.2``)."""
        out = {"middle_block.0": "mid_block.resnets.0", "middle_block.1": "mid_block.attentions.0",
               "middle_block.2": "mid_block.resnets.1"}
        n = 1
        for level, (resnets, attention) in enumerate(self.levels):
            for i in range(resnets):
                out[f"input_blocks.{n}.0"] = f"down_blocks.{level}.resnets.{i}"
                if attention:
                    out[f"input_blocks.{n}.1"] = f"down_blocks.{level}.attentions.{i}"
                n += 1
            if level < len(self.levels) - 1:
                out[f"input_blocks.{n}.0.op"] = f"down_blocks.{level}.downsamplers.0.conv"
                n += 1
        n = 0
        for up, (resnets, attention) in enumerate(reversed(self.levels)):
            for i in range(resnets + 1):
                out[f"output_blocks.{n}.0"] = f"up_blocks.{up}.resnets.{i}"
                if attention:
                    out[f"output_blocks.{n}.1"] = f"up_blocks.{up}.attentions.{i}"
                if i == resnets and up < len(self.levels) - 1:
                    out[f"output_blocks.{n}.{1 + attention}.conv"] = f"up_blocks.{up}.upsamplers.0.conv"
                n += 1
        return out


LAYOUTS = {"sd15": UNetLayout(((2, True), (2, True), (2, True), (2, False))),
           "sdxl": UNetLayout(((2, False), (2, True), (2, True)))}
LAYOUTS["sd2"] = LAYOUTS["sd15"]  # SD2.x keeps SD1.5's UNet layout (wider context only)


def kohya_names(canonical_keys: list[str], arch: str) -> dict[str, str]:
    """kohya module name -> canonical ``.weight`` key, for UNet (diffusers and LDM names) and CLIP."""
    modules = [k.removesuffix(".weight") for k in canonical_keys if k.endswith(".weight")]
    names: dict[str, str] = {}
    unet = [m[len(UNET):] for m in modules if m.startswith(UNET)]
    for module in unet:
        names["lora_unet_" + module.replace(".", "_")] = UNET + module + ".weight"
    for module, diffusers in diffusers_modules(unet, layout_for(arch, unet)):
        names["lora_unet_" + diffusers.replace(".", "_")] = UNET + module + ".weight"
    for module in modules:
        for prefix, kohya in TEXT_ENCODERS:
            if module.startswith(prefix):
                names[kohya + module[len(prefix):].replace(".", "_")] = module + ".weight"
    return names


def layout_for(arch: str, unet_modules: list[str]) -> UNetLayout:
    """The fixed layout of ``arch`` when every block of the file fits it, else the file's own."""
    fixed = LAYOUTS.get(arch)
    present = {m[1] for m in map(_BLOCK.match, unet_modules) if m} - set(BASIC)  # conv_in is no block
    if fixed is not None and present <= fixed.blocks().keys():
        return fixed
    return detected_layout(present)


def detected_layout(blocks: set[str]) -> UNetLayout:
    """A layout read off the input blocks (a downsampler ``input_blocks.N.0.op`` ends a level)."""
    numbers = sorted({int(b.split(".")[1]) for b in blocks if b.startswith("input_blocks.")} - {0})
    levels, resnets, attention = [], 0, False
    for n in numbers:
        if f"input_blocks.{n}.0.op" in blocks:
            levels.append((resnets, attention))
            resnets, attention = 0, False
        else:
            resnets += 1
            attention = attention or f"input_blocks.{n}.1" in blocks
    return UNetLayout((*levels, (resnets, attention)))


def diffusers_modules(unet_modules: list[str], layout: UNetLayout) -> list[tuple[str, str]]:
    """(LDM module path, diffusers module path) for every module the layout or ``BASIC`` names."""
    blocks = layout.blocks()
    out: list[tuple[str, str]] = []
    for module in unet_modules:
        match = _BLOCK.match(module)
        if module in BASIC:
            out += [(module, alias) for alias in BASIC[module]]
        elif match is not None and match[1] in blocks:
            target, rest = blocks[match[1]], module[len(match[1]) + 1:]
            if ".resnets." in target:
                rest = _resnet_part(rest)
            out.append((module, f"{target}.{rest}" if rest else target))
    return out


def _resnet_part(part: str) -> str:
    for ldm, diffusers in RESNET.items():
        if part == ldm or part.startswith(ldm + "."):
            return diffusers + part[len(ldm):]
    return part


_LDM = re.compile(r"(input_blocks|output_blocks)_(\d+)_(\d+)_|middle_block_(\d+)_")


def block_key(arch: str, module: str, prefixes: tuple[str, ...] = ("lora_unet_",)) -> str:
    """A checkpoint key in the block that LoRA module ``module`` patches, for merge/blocks.py's
    ``block_of`` (block weights on a LoRA without its base model): text-encoder modules lie in BASE,
    LDM and diffusers UNet names in their IN/M/OUT block, other families' indexed blocks
    (``double_blocks_3_...``) in theirs. A name it cannot place is returned under the diffusion
    model's prefix as it is (its family's tail block, or a block of its own name)."""
    body = next((module[len(p):] for p in prefixes if module.startswith(p)), None)
    if body is None or module.startswith(tuple(kohya for _, kohya in TEXT_ENCODERS)):
        return "cond_stage_model." + module
    if arch in LAYOUTS:
        if m := _LDM.match(body + "_"):
            where = f"middle_block.{m[4]}" if m[4] else f"{m[1]}.{m[2]}.{m[3]}"
            return f"{UNET}{where}.{body[m.end():]}"
        for ldm, diffusers in sorted(LAYOUTS[arch].blocks().items(), key=lambda kv: -len(kv[1])):
            if (body + "_").startswith(diffusers.replace(".", "_") + "_"):
                return f"{UNET}{ldm}.{body[len(diffusers) + 1:]}"
        for ldm, aliases in BASIC.items():
            if any(body.startswith(a.replace(".", "_")) for a in aliases):
                return f"{UNET}{ldm}.weight"
        return UNET + body
    return UNET + _dotted_groups(arch, body)


def _dotted_groups(arch: str, body: str) -> str:
    """``double_blocks_3_img_attn_qkv`` -> ``double_blocks.3.img_attn_qkv`` for ``arch``'s groups."""
    family = BY_ID.get(arch)
    for template, _ in family.groups if family is not None else ():
        stem = template.removesuffix(".{n}")
        if m := re.match(re.escape(stem.replace(".", "_")) + r"_(\d+)(?:_|$)", body):
            return f"{stem}.{m[1]}.{body[m.end():]}"
    return body
