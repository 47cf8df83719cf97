"""LoRA files as delta-space merge inputs (kohya LoRA/LoCon, LyCORIS LoHa/LoKr, PEFT): each key's delta
computed on demand, in fp32, exactly as ComfyUI's LoraLoader applies it at strength 1.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from . import io as mio
from .fingerprint import file_fingerprint
from .lora_keys import kohya_names

SUPPORTED = {"lora_up.weight", "lora_down.weight", "alpha", "hada_w1_a", "hada_w1_b", "hada_w2_a",
             "hada_w2_b", "lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "diff"}
_PEFT = {".lora_A.weight": "lora_down.weight", ".lora_B.weight": "lora_up.weight", ".alpha": "alpha"}
_COMFY_PREFIX = "diffusion_model."  # PEFT module names as ComfyUI's LoRA key map reads them


class LoraSource:
    """A LoRA file as a delta-space source over ``base``'s canonical keys (see module docstring).

    A ``LoraSource`` maps every module of a LoRA file onto a key of the recipe's base checkpoint and
    computes that key's weight delta on demand, in fp32, exactly as ComfyUI's LoraLoader does at
    strength 1 (``up @ down * alpha / rank``; LoHa ``(w1a @ w1b) * (w2a @ w2b) * alpha / rank``; LoKr
    ``kron(w1, w2)`` scaled by ``alpha / rank`` when a factor is low-rank). Convolutions are flattened
    and reshaped to the weight's shape. Keys the LoRA does not touch contribute a zero delta.

    Module names: kohya writes ``lora_unet_`` + the diffusers module path for the UNet (LDM paths are
    accepted too) and ``lora_te_`` / ``lora_te1_`` + the Hugging Face CLIP path for the text encoder;
    merge/lora_keys.py numbers the diffusers names from the architecture's fixed UNet layout. PEFT
    ``lora_A``/``lora_B`` pairs are read in ComfyUI's own module names, ``diffusion_model.<module path>``
    (ai-toolkit's Wan and Flux.2 LoRAs, LTX-Video-Trainer's converted ones); diffusers names
    (``transformer.transformer_blocks.0.attn.to_q``, slices of fused weights) are not.
    """

    space = "delta"

    def __init__(self, file: mio.SafetensorsFile, base: object | None,
                 fingerprint: tuple | None = None) -> None:
        """``base``: the model the LoRA applies to, a ``SafetensorsFile`` or any source (``keys()``,
        ``info(key)``, ``arch``, ``fingerprint``) with canonical keys; ``fingerprint``: the file's
        (merge/fingerprint.py), taken now when not given."""
        if base is None:
            raise mio.ModelFileError(file.path, "is a LoRA but the recipe has no checkpoint to map it onto",
                                     "Merge LoRAs into a model, e.g. add_difference(model, lora).")
        self.file, self.arch, self.name = file, base.arch, file.path.name
        modules: dict[str, dict[str, str]] = {}
        for key in file.tensors:
            module, part = _module_part(key)
            modules.setdefault(module, {})[part] = key
        base_keys, base_shape = _base_view(base)
        names = kohya_names(base_keys, base.arch) | _comfy_names(base_keys)
        self.targets: dict[str, dict[str, str]] = {}
        self.unmapped: list[str] = []
        for module, parts in modules.items():
            if unknown := set(parts) - SUPPORTED:
                shown = ", ".join(sorted(unknown)[:4]) + (", ..." if len(unknown) > 4 else "")
                raise mio.ModelFileError(
                    file.path, f"module {module} has tensors this reader does not know ({shown})",
                    "Supported: kohya LoRA/LoCon and LyCORIS LoHa/LoKr with kohya names, PEFT "
                    "lora_A/lora_B with diffusion_model.<module> names (no DoRA, Tucker or GLoRA); convert "
                    "the LoRA, or apply it with ComfyUI's LoraLoader and save the checkpoint.")
            if module in names:
                self.targets[names[module]] = parts
            else:
                self.unmapped.append(module)
        if modules and not self.targets:
            base_name = base.path.name if isinstance(base, mio.SafetensorsFile) else base.name
            problem = (f"matches no key of {base_name} ({base.arch}): none of its {len(modules)} modules "
                       f"(e.g. {self.unmapped[0]}) names a layer of it")
            peft = file.arch == "lora-peft"
            raise mio.ModelFileError(file.path, problem, "Use a LoRA made for this base model." + (
                " PEFT lora_A/lora_B modules are read in ComfyUI's names (diffusion_model.<module>), not in "
                "diffusers' (transformer.<module>): apply this one with LoraLoader" if peft else ""))
        self._shapes = {k: base_shape(k) for k in self.targets}
        self.fingerprint = ("lora", fingerprint or file_fingerprint(file.path),
                            getattr(base, "fingerprint", None))

    def keys(self) -> list[str]:
        return list(self.targets)

    def has(self, key: str) -> bool:
        return key in self.targets

    def info(self, key: str) -> mio.TensorInfo:
        shape = self._shapes[key]
        return mio.TensorInfo("F32", shape, 0, 4 * math.prod(shape))

    def delta(self, key: str) -> torch.Tensor:
        """The fp32 weight delta this LoRA adds to ``key`` at strength 1."""
        try:
            return self._delta(key)
        except (RuntimeError, KeyError, IndexError) as error:  # factors of the wrong shape, a part missing
            problem = f"its module for {key} {list(self._shapes[key])} does not fit it ({error})"
            raise mio.ModelFileError(self.file.path, problem.replace("\n", " "),
                                     "Use a LoRA made for this base model, or re-save the LoRA.") from None

    def _delta(self, key: str) -> torch.Tensor:
        parts = self.targets[key]
        return module_delta({part: self.file.read(name).float() for part, name in parts.items()}
                            ).reshape(self._shapes[key])

    tensor = delta  # the source interface (merge/sources.py)

    def close(self) -> None:
        self.file.close()


def _module_part(key: str) -> tuple[str, str]:
    """(module, part) of a LoRA tensor's name: kohya's module names hold no dot, PEFT's do."""
    if key.startswith(_COMFY_PREFIX):
        for suffix, part in _PEFT.items():
            if key.endswith(suffix):
                return key[: -len(suffix)], part
    module, _, part = key.partition(".")
    return module, part


def _comfy_names(canonical_keys: list[str]) -> dict[str, str]:
    """``diffusion_model.<module>`` -> canonical ``.weight`` key, for PEFT LoRAs in ComfyUI's names."""
    unet = mio.UNET_PREFIX
    return {_COMFY_PREFIX + k[len(unet):].removesuffix(".weight"): k for k in canonical_keys
            if k.startswith(unet) and k.endswith(".weight")}


def module_delta(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """One module's fp32 delta at strength 1 from its tensors by part name (``lora_up.weight``,
    ``hada_w1_a``, ``lokr_w1``, ``diff``, ``alpha`` ...), as ComfyUI computes it: LoRA/LoCon and LoHa
    flattened to ``(out, in * kh * kw)``, LoKr as the Kronecker product of its factors' shapes."""
    alpha = t["alpha"].item() if "alpha" in t else None
    if "diff" in t:
        return t["diff"]
    if "lora_up.weight" in t:
        down = t["lora_down.weight"]
        diff = t["lora_up.weight"].flatten(1) @ down.flatten(1)
        scale = alpha / down.shape[0] if alpha is not None else 1.0
    elif "hada_w1_a" in t:
        diff = (t["hada_w1_a"] @ t["hada_w1_b"]) * (t["hada_w2_a"] @ t["hada_w2_b"])
        scale = alpha / t["hada_w1_b"].shape[0] if alpha is not None else 1.0
    else:
        diff, scale = _lokr(t, alpha)
    return diff * scale


def module_factors(t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(up, down)`` whose product is ``module_delta(t)`` flattened to ``(out, in * kh * kw)``, exactly;
    None for a full ``diff``. LoRA/LoCon: its own factors, alpha / rank folded into down. LoHa
    ``(A1 B1) * (A2 B2)``: the row-wise products of A1, A2 and of B1, B2 (rank r1 r2). LoKr
    ``kron(w1, w2)``: ``kron(u1, u2) @ kron(d1, d2)`` of each factor's split (a full factor is
    itself times an identity on its shorter side)."""
    alpha = t["alpha"].item() if "alpha" in t else None
    if "diff" in t:
        return None
    if "lora_up.weight" in t:
        up, down = t["lora_up.weight"].flatten(1), t["lora_down.weight"].flatten(1)
        rank = down.shape[0]
    elif "hada_w1_a" in t:
        a1, b1, a2, b2 = (t[part].flatten(1) for part in ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"))
        up = (a1[:, :, None] * a2[:, None, :]).flatten(1)
        down = (b1[:, None, :] * b2[None, :, :]).flatten(0, 1)
        rank = b1.shape[0]
    else:
        (u1, d1), rank1 = _split(t, "lokr_w1")
        (u2, d2), rank2 = _split(t, "lokr_w2")
        up, down, rank = torch.kron(u1, u2), torch.kron(d1, d2), rank2 if rank2 is not None else rank1
    scale = alpha / rank if alpha is not None and rank is not None else 1.0
    return up, down * scale


def _split(t: dict[str, torch.Tensor], name: str) -> tuple[tuple[torch.Tensor, torch.Tensor], int | None]:
    """((up, down), rank) of a LoKr factor: its two parts, or a full one beside an identity."""
    if name in t:
        w = t[name].flatten(1)
        eye = torch.eye(min(w.shape), dtype=w.dtype, device=w.device)
        return ((eye, w) if w.shape[0] <= w.shape[1] else (w, eye)), None
    return (t[f"{name}_a"].flatten(1), t[f"{name}_b"].flatten(1)), t[f"{name}_b"].shape[0]


def patched_shape(parts: Mapping[str, tuple[int, ...]]) -> tuple[int, int]:
    """(out, in * kh * kw) of the weight a module patches, from its factors' shapes by part name (the
    headers are enough: nothing is read)."""
    def flat(shape: tuple[int, ...]) -> int:
        return int(torch.Size(shape[1:]).numel())
    if "lora_up.weight" in parts:
        return parts["lora_up.weight"][0], flat(parts["lora_down.weight"])
    if "hada_w1_a" in parts:
        return parts["hada_w1_a"][0], parts["hada_w1_b"][1]
    if "diff" in parts:
        return parts["diff"][0], flat(parts["diff"])
    w1 = parts.get("lokr_w1") or (parts["lokr_w1_a"][0], parts["lokr_w1_b"][1])
    w2 = parts.get("lokr_w2") or (parts["lokr_w2_a"][0], parts["lokr_w2_b"][1])
    return w1[0] * w2[0], w1[1] * flat(w2)


def _base_view(base: object) -> tuple[list[str], object]:
    """(canonical keys, key -> shape) of a LoRA's base model, a file or a source."""
    if isinstance(base, mio.SafetensorsFile):
        return base.canonical_keys(), lambda key: base.tensors[base.native(key)].shape
    return base.keys(), lambda key: base.info(key).shape


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
