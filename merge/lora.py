"""LoRA files as delta-space merge inputs: kohya LoRA/LoCon and LyCORIS LoHa/LoKr on checkpoint keys.

A ``LoraSource`` maps every module of a LoRA file onto a key of the recipe's base checkpoint and
computes that key's weight delta on demand, in fp32, exactly as ComfyUI's LoraLoader does at
strength 1 (``up @ down * alpha / rank``; LoHa ``(w1a @ w1b) * (w2a @ w2b) * alpha / rank``; LoKr
``kron(w1, w2)`` scaled by ``alpha / rank`` when a factor is low-rank). Convolutions are flattened
and reshaped to the weight's shape. Keys the LoRA does not touch contribute a zero delta.

Module names: kohya writes ``lora_unet_`` + the diffusers module path for the UNet (LDM paths are
accepted too) and ``lora_te_`` / ``lora_te1_`` + the Hugging Face CLIP path for the text encoder.
``kohya_names`` derives the diffusers names from the checkpoint's own LDM keys (levels and blocks
are read off the keys, so reduced test UNets map as well as real SD1.5 and SDXL ones).
"""

from __future__ import annotations

import re

import torch

from . import io as mio

UNET = mio.UNET_PREFIX
TEXT_ENCODERS = (("cond_stage_model.transformer.", "lora_te_"),
                 ("conditioner.embedders.0.transformer.", "lora_te1_"))
RESNET = {"in_layers.0": "norm1", "in_layers.2": "conv1", "emb_layers.1": "time_emb_proj",
          "out_layers.0": "norm2", "out_layers.3": "conv2", "skip_connection": "conv_shortcut"}
BASIC = {"input_blocks.0.0": "conv_in", "time_embed.0": "time_embedding.linear_1",
         "time_embed.2": "time_embedding.linear_2", "label_emb.0.0": "add_embedding.linear_1",
         "label_emb.0.2": "add_embedding.linear_2", "out.0": "conv_norm_out", "out.2": "conv_out"}
SUPPORTED = {"lora_up.weight", "lora_down.weight", "alpha", "hada_w1_a", "hada_w1_b", "hada_w2_a",
             "hada_w2_b", "lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "diff"}


class LoraSource:
    """A LoRA file as a delta-space source over ``base``'s canonical keys (see module docstring)."""

    space = "delta"

    def __init__(self, file: mio.SafetensorsFile, base: mio.SafetensorsFile | None) -> None:
        if base is None:
            raise mio.ModelFileError(file.path, "is a LoRA but the recipe has no checkpoint to map it onto",
                                     "Merge LoRAs into a model, e.g. add_difference(model, lora).")
        self.file, self.arch, self.name = file, base.arch, file.path.name
        modules: dict[str, dict[str, str]] = {}
        for key in file.tensors:
            module, _, part = key.partition(".")
            modules.setdefault(module, {})[part] = key
        names = kohya_names(base.canonical_keys())
        self.targets: dict[str, dict[str, str]] = {}
        self.unmapped: list[str] = []
        for module, parts in modules.items():
            if unknown := set(parts) - SUPPORTED:
                shown = ", ".join(sorted(unknown)[:4]) + (", ..." if len(unknown) > 4 else "")
                raise mio.ModelFileError(
                    file.path, f"module {module} has tensors this reader does not know ({shown})",
                    "Supported: kohya LoRA/LoCon and LyCORIS LoHa/LoKr with kohya names (no PEFT "
                    "lora_A/lora_B, DoRA, Tucker or GLoRA); convert the LoRA, or apply it with ComfyUI's "
                    "LoraLoader and save the checkpoint.")
            if module in names:
                self.targets[names[module]] = parts
            else:
                self.unmapped.append(module)
        self._shapes = {k: base.tensors[base.native(k)].shape for k in self.targets}

    def keys(self) -> list[str]:
        return list(self.targets)

    def has(self, key: str) -> bool:
        return key in self.targets

    def info(self, key: str) -> mio.TensorInfo:
        shape = self._shapes[key]
        return mio.TensorInfo("F32", shape, 0, 4 * mio._prod(shape))

    def delta(self, key: str) -> torch.Tensor:
        """The fp32 weight delta this LoRA adds to ``key`` at strength 1."""
        parts, shape = self.targets[key], self._shapes[key]
        t = {part: self.file.read(name).float() for part, name in parts.items()}
        alpha = t["alpha"].item() if "alpha" in t else None
        if "diff" in t:
            return t["diff"].reshape(shape)
        if "lora_up.weight" in t:
            down = t["lora_down.weight"]
            diff = t["lora_up.weight"].flatten(1) @ down.flatten(1)
            scale = alpha / down.shape[0] if alpha is not None else 1.0
        elif "hada_w1_a" in t:
            diff = (t["hada_w1_a"] @ t["hada_w1_b"]) * (t["hada_w2_a"] @ t["hada_w2_b"])
            scale = alpha / t["hada_w1_b"].shape[0] if alpha is not None else 1.0
        else:
            diff, scale = _lokr(t, alpha)
        return (diff * scale).reshape(shape)

    def close(self) -> None:
        self.file.close()


def _lokr(t: dict[str, torch.Tensor], alpha: float | None) -> tuple[torch.Tensor, float]:
    rank = None
    if "lokr_w1" in t:
        w1 = t["lokr_w1"]
    else:
        w1, rank = t["lokr_w1_a"] @ t["lokr_w1_b"], t["lokr_w1_b"].shape[0]
    if "lokr_w2" in t:
        w2 = t["lokr_w2"]
    else:
        w2, rank = t["lokr_w2_a"] @ t["lokr_w2_b"], t["lokr_w2_b"].shape[0]
    if w2.dim() == 4:
        w1 = w1[:, :, None, None]
    scale = alpha / rank if alpha is not None and rank is not None else 1.0
    return torch.kron(w1, w2), scale


def kohya_names(canonical_keys: list[str]) -> dict[str, str]:
    """kohya module name -> canonical ``.weight`` key, for UNet (diffusers and LDM names) and CLIP."""
    weights = [k for k in canonical_keys if k.endswith(".weight")]
    names: dict[str, str] = {}
    for key in weights:
        module = key.removesuffix(".weight")
        if module.startswith(UNET):
            names["lora_unet_" + module[len(UNET):].replace(".", "_")] = key
        for prefix, kohya in TEXT_ENCODERS:
            if module.startswith(prefix):
                names[kohya + module[len(prefix):].replace(".", "_")] = key
    ldm_modules = {k[len(UNET):].removesuffix(".weight") for k in weights if k.startswith(UNET)}
    for ldm, diffusers in diffusers_unet_modules(ldm_modules).items():
        names["lora_unet_" + diffusers.replace(".", "_")] = UNET + ldm + ".weight"
    return names


def diffusers_unet_modules(ldm_modules: set[str]) -> dict[str, str]:
    """LDM UNet module path -> diffusers module path, read off the block structure of the keys."""
    out: dict[str, str] = {}
    blocks: dict[tuple[str, int], set[str]] = {}
    for module in ldm_modules:
        match = re.match(r"(input_blocks|output_blocks|middle_block)\.(\d+)\.(.*)", module)
        if match:
            blocks.setdefault((match[1], int(match[2])), set()).add(match[3])
    for ldm, diffusers in BASIC.items():
        out[ldm] = diffusers
    level, index = 0, 0
    for n in sorted(n for kind, n in blocks if kind == "input_blocks" and n > 0):
        parts = blocks["input_blocks", n]
        if "0.op" in parts:
            out[f"input_blocks.{n}.0.op"] = f"down_blocks.{level}.downsamplers.0.conv"
            level, index = level + 1, 0
            continue
        _block(out, parts, f"input_blocks.{n}", f"down_blocks.{level}", index)
        index += 1
    for n, target in ((0, "resnets.0"), (1, "attentions.0"), (2, "resnets.1")):
        for part in blocks.get(("middle_block", n), ()):
            out[f"middle_block.{n}.{part}"] = f"mid_block.{target}.{_resnet_part(part)}"
    level, index = 0, 0
    for n in sorted(n for kind, n in blocks if kind == "output_blocks"):
        parts = blocks["output_blocks", n]
        _block(out, parts, f"output_blocks.{n}", f"up_blocks.{level}", index)
        index += 1
        upsampler = [p for p in parts if re.fullmatch(r"\d\.conv", p)]
        for part in upsampler:
            out[f"output_blocks.{n}.{part}"] = f"up_blocks.{level}.upsamplers.0.conv"
        if upsampler:
            level, index = level + 1, 0
    return out


def _block(out: dict[str, str], parts: set[str], ldm: str, diffusers: str, index: int) -> None:
    for part in parts:
        sub, _, rest = part.partition(".")
        if sub == "0":
            out[f"{ldm}.{part}"] = f"{diffusers}.resnets.{index}.{_resnet_part(rest)}"
        elif sub == "1" and not re.fullmatch(r"conv", rest):
            out[f"{ldm}.{part}"] = f"{diffusers}.attentions.{index}.{rest}"


def _resnet_part(part: str) -> str:
    for ldm, diffusers in RESNET.items():
        if part == ldm or part.startswith(ldm + "."):
            return diffusers + part[len(ldm):]
    return part
