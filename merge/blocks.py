"""Which block and which component a state-dict key belongs to, and per-block literal resolution.

Block names follow sd-mecha's supermerger block configs: SD1.5 has 26 (``BASE``, ``IN00``..``IN11``,
``M00``, ``OUT00``..``OUT11``), SDXL 20 (``BASE``, ``IN00``..``IN08``, ``M00``, ``OUT00``..``OUT08``)
plus ``VAE``. Flux blocks are named after its modules: ``double_blocks.N`` (0-18),
``single_blocks.N`` (0-37), ``img_in``, ``txt_in``, ``time_in``, ``vector_in``, ``guidance_in``,
``final_layer``, and ``BASE`` (text encoders) / ``VAE`` outside the diffusion model. Keys may carry
ComfyUI's ``model.diffusion_model.`` prefix or not (diffusion-model-only files).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Collection, Mapping

from .names import nearest, suggestion

ARCHS = ("sd15", "sdxl", "flux")
_UNET = re.compile(r"(?:^|\.)(input_blocks|middle_block|output_blocks)\.(\d+)\.")
_UNET_TAIL = {"sd15": "OUT11", "sdxl": "OUT08"}
_FLUX_INDEXED = re.compile(r"(?:^|\.)(double_blocks|single_blocks)\.(\d+)\.")
_FLUX_MODULES = ("img_in", "txt_in", "time_in", "vector_in", "guidance_in", "final_layer")
_DIFFUSION = "model.diffusion_model."


def block_names(arch: str) -> tuple[str, ...]:
    """Every block name of ``arch`` in model order (empty for an unknown architecture)."""
    if arch == "sd15":
        return ("BASE", *_numbered("IN", 12), "M00", *_numbered("OUT", 12))
    if arch == "sdxl":
        return ("BASE", *_numbered("IN", 9), "M00", *_numbered("OUT", 9), "VAE")
    if arch == "flux":
        return ("BASE", "img_in", "txt_in", "time_in", "vector_in", "guidance_in",
                *(f"double_blocks.{i}" for i in range(19)), *(f"single_blocks.{i}" for i in range(38)),
                "final_layer", "VAE")
    return ()


def block_of(arch: str, key: str) -> str | None:
    """The block ``key`` belongs to in ``arch`` (sd15, sdxl, flux); None for an unknown arch."""
    if arch in ("sd15", "sdxl"):
        return _unet_block(arch, key)
    if arch == "flux":
        return _flux_block(key)
    return None


def _unet_block(arch: str, key: str) -> str:
    if key.startswith("first_stage_model."):
        return "VAE" if arch == "sdxl" else "BASE"
    if key.startswith(("cond_stage_model.", "conditioner.", "model_ema.")):
        return "BASE"
    if m := _UNET.search(key):
        kind, index = m.group(1), int(m.group(2))
        return {"input_blocks": f"IN{index:02}", "middle_block": "M00"}.get(kind, f"OUT{index:02}")
    body = key.removeprefix(_DIFFUSION)
    if body.startswith(("time_embed.", "label_emb.")):
        return "BASE"
    if key.startswith(_DIFFUSION) or body.startswith("out."):
        return _UNET_TAIL[arch]
    return "BASE"


def _flux_block(key: str) -> str:
    if key.startswith("vae."):
        return "VAE"
    if key.startswith("text_encoders."):
        return "BASE"
    if m := _FLUX_INDEXED.search(key):
        return f"{m.group(1)}.{m.group(2)}"
    module = key.removeprefix(_DIFFUSION).split(".", 1)[0]
    return module if module in _FLUX_MODULES else "BASE"


COMPONENTS = {"sd15": ("diffuser", "clip_l", "vae", "ema", "scheduler"),
              "sdxl": ("diffuser", "clip_l", "clip_g", "vae", "scheduler"),
              "flux": ("diffuser", "clip_l", "vae")}


def component_of(arch: str, key: str) -> str | None:
    """sd-mecha's component of ``key``: diffuser, clip_l, clip_g, vae, ema or scheduler."""
    if key.startswith(_DIFFUSION):
        return "diffuser"
    prefixes = {
        "sd15": (("cond_stage_model.", "clip_l"), ("first_stage_model.", "vae"), ("model_ema.", "ema")),
        "sdxl": (("conditioner.embedders.0.", "clip_l"), ("conditioner.embedders.1.", "clip_g"),
                 ("first_stage_model.", "vae")),
        "flux": (("text_encoders.", "clip_l"), ("vae.", "vae")),
    }.get(arch)
    if prefixes is None:
        return None
    for prefix, component in prefixes:
        if key.startswith(prefix):
            return component
    if arch == "flux":
        return "diffuser"  # a diffusion-model-only file has no prefix
    if arch == "sdxl" and key.split(".", 1)[0] in ("v_pred", "ztsnr", "edm_vpred"):
        return "diffuser"
    return "scheduler"


def resolve(mapping: Mapping[str, object], arch: str, key: str, *, where: str = "literal") -> object:
    """The value a per-block / per-key map gives ``key``: exact key, then block name, then the
    first matching fnmatch glob (in the map's order), then ``default``.

    Raises ``KeyError`` naming the key, its block and the map's entries when nothing matches.
    """
    if key in mapping:
        return mapping[key]
    block = block_of(arch, key)
    if block is not None and block in mapping:
        return mapping[block]
    for pattern, value in mapping.items():
        if pattern != "default" and _is_glob(pattern) and fnmatch.fnmatchcase(key, pattern):
            return value
    if "default" in mapping:
        return mapping["default"]
    raise KeyError(f"{where}: no entry for key {key!r} (block {block!r} in {arch}) among "
                   f"{', '.join(mapping) or 'no entries'}; add it or a 'default' entry")


def check_map(mapping: Mapping[str, object], arch: str, keys: Collection[str] | None = None) -> None:
    """Refuse map entries that can match nothing: not ``default``, not a glob, not a block name of
    ``arch`` and not one of ``keys`` (when given; without it any dotted name passes as a key).

    Raises ``ValueError`` naming the entry, with the nearest block names.
    """
    names = block_names(arch)
    for entry in mapping:
        if entry == "default" or _is_glob(entry) or entry in names:
            continue
        if (entry in keys) if keys is not None else "." in entry:
            continue
        if not names:
            raise ValueError(f"map entry {entry!r} is no key and no glob, and block names need a known "
                             f"architecture ({', '.join(ARCHS)}; these models are {arch}): use key globs")
        close = nearest_blocks(entry, names)
        hint = f"; {suggestion(close)}" if close else ""
        raise ValueError(f"map entry {entry!r} is no block of {arch} ({', '.join(names[:4])}, ...), "
                         f"no key and no glob{hint}")


def nearest_blocks(entry: str, names: tuple[str, ...]) -> list[str]:
    """Up to three block names close to a misspelt ``entry``; a name that differs only in case or in
    the padding of its number (``in0``, ``IN0`` -> ``IN00``) comes first."""
    first = []
    if match := re.fullmatch(r"([A-Za-z]+)(\d+)", entry):
        padded = f"{match[1].upper()}{int(match[2]):02}"
        first = [padded] if padded in names else []
    close = nearest(entry.upper() if entry.isalnum() else entry, names, cutoff=0.5)
    return (first + [c for c in close if c not in first])[:3]


def _is_glob(pattern: str) -> bool:
    return any(ch in pattern for ch in "*?[")


def _numbered(prefix: str, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i:02}" for i in range(count))
