"""A1111 LoRA Block Weight vectors and presets (``lbw=OUTALL``, ``lbw=1,0,0,...``) as Patchbay block maps,
so prompts and workflows written for that extension keep their meaning.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass

__all__ = ["LAYOUTS", "PRESETS", "LbwError", "LbwMap", "block_map", "check_spec", "is_lbw"]


class LbwError(ValueError):
    """A bad ``lbw=`` value: unknown preset, a list of the wrong length or a value that is no number."""


def _ids(prefix: str, count: int, start: int = 0) -> tuple[str, ...]:
    return tuple(f"{prefix}{i:02}" for i in range(start, start + count))


_SD26 = ("BASE", *_ids("IN", 12), "M00", *_ids("OUT", 12))
_SD17 = ("BASE", "IN01", "IN02", "IN04", "IN05", "IN07", "IN08", "M00", *_ids("OUT", 9, 3))
_XL20 = ("BASE", *_ids("IN", 9), "M00", *_ids("OUT", 9))
_XL12 = ("BASE", "IN04", "IN05", "IN07", "IN08", "M00", *_ids("OUT", 6))
_FLUX61 = ("CLIP", "T5", "IN", *_ids("D", 19), *_ids("S", 38), "OUT")

# architecture -> {vector length: the extension's block ids in vector order}; the first is the full one
LAYOUTS: dict[str, dict[int, tuple[str, ...]]] = {
    "sd15": {26: _SD26, 17: _SD17},
    "sd2": {26: _SD26, 17: _SD17},  # the extension's SD1/SD2 vectors: one UNet layout, kohya names the same
    "sdxl": {20: _XL20, 12: _XL12},
    "flux": {61: _FLUX61},
}
_FLUX_IN = ("img_in", "txt_in", "time_in", "vector_in", "guidance_in")
_T5 = "t5xxl."  # ComfyUI's key prefix of Flux's T5 text encoder (CLIP-L: clip_l.)


def _vector(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(","))


# the extension's default presets (17 values in _SD17's order; FLUXALL: 61 in _FLUX61's)
PRESETS: dict[str, tuple[float, ...]] = {
    "NONE": _vector("0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0"),
    "ALL": _vector("1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1"),
    "INS": _vector("1,1,1,1,0,0,0,0,0,0,0,0,0,0,0,0,0"),
    "IND": _vector("1,0,0,0,1,1,1,0,0,0,0,0,0,0,0,0,0"),
    "INALL": _vector("1,1,1,1,1,1,1,0,0,0,0,0,0,0,0,0,0"),
    "MIDD": _vector("1,0,0,0,1,1,1,1,1,1,1,1,0,0,0,0,0"),
    "OUTD": _vector("1,0,0,0,0,0,0,0,1,1,1,1,0,0,0,0,0"),
    "OUTS": _vector("1,0,0,0,0,0,0,0,0,0,0,0,1,1,1,1,1"),
    "OUTALL": _vector("1,0,0,0,0,0,0,0,1,1,1,1,1,1,1,1,1"),
    "ALL0.5": (0.5,) * 17,
    "FLUXALL": (1.0,) * 61,
}
_PRESET_IDS = {len(_SD17): _SD17, len(_FLUX61): _FLUX61}
_OWNER = {len(_SD17): "an SD1.5 LoRA vector", len(_FLUX61): "a Flux vector"}


@dataclass(frozen=True)
class LbwMap:
    """A block=strength map in merge/blocks.py's block names (``blocks``) and, for Flux's T5, strengths
    by text-encoder key prefix (``text``: (prefix, strength) pairs; other encoder keys take BASE)."""

    blocks: dict[str, float]
    text: tuple[tuple[str, float], ...] = ()


def is_lbw(text: str) -> bool:
    """Whether a block-weights text is in the A1111 form (one preset name or a number list, no ``=``)."""
    body = _clean(text)
    return bool(body) and "=" not in body


def _clean(spec: str) -> str:
    return " ".join(line.split("#", 1)[0] for line in spec.splitlines()).strip()


def _lengths() -> str:
    return "; ".join(f"{arch}: {' or '.join(str(n) for n in sorted(layouts))}"
                     for arch, layouts in LAYOUTS.items())


def _parse(spec: str) -> tuple[str | None, tuple[float, ...]]:
    """(preset name or None, values) for ``spec``; raises LbwError naming what is wrong."""
    body = _clean(spec)
    if body.upper() in PRESETS:  # the extension matches case; a lower-case name means the same preset
        return body.upper(), PRESETS[body.upper()]
    if "," not in body and not _is_number(body):
        close = difflib.get_close_matches(body.upper(), list(PRESETS), n=3, cutoff=0.5)
        hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
        raise LbwError(f"{body!r} is no LoRA Block Weight preset; {hint}presets: {', '.join(PRESETS)}; "
                       f"or write a number list ({_lengths()} values).")
    values = []
    for i, item in enumerate(body.split(","), start=1):
        try:
            value = float(item)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise LbwError(f"lbw value {i} ({item.strip()!r}) of {body!r} is not a number; write numbers "
                           f"separated by commas (the extension's R, U and X random values are not "
                           f"supported).")
        values.append(value)
    if len(values) not in {n for layouts in LAYOUTS.values() for n in layouts}:
        raise LbwError(f"lbw list {body!r} has {len(values)} values; expected {_lengths()}.")
    return None, tuple(values)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def check_spec(spec: str) -> None:
    """Raise LbwError unless ``spec`` is a known preset or a number list of a known length (any arch)."""
    _parse(spec)


def block_map(spec: str, arch: str) -> LbwMap:
    """The block map that preset or number list ``spec`` gives on ``arch`` (sd15, sdxl or flux).

        block_map("OUTALL", "sd15")                 -> LbwMap({"BASE": 1.0, "IN00": 0.0, ..., "OUT11": 1.0})
        block_map("1,0,0,0,0,0,0,0,1,1,1,1,1,1,1,1,1", "sd15")  -> the same map
        check_spec("MIDD")                          -> raises LbwError for an unknown preset or a bad list

    Data flow: a ``<lora:name:1:lbw=OUTALL>`` tag (hooks/prompt_tags.py keeps the text after ``lbw=``) or a
    Hook Block Weights ``blocks`` text that is a preset name or a number list (``is_lbw``) -> ``block_map``
    -> the block=strength map the block-name form (``IN00=0, OUT*=1``) parses to -> nodes/hook_blocks.py's
    strength function -> hooks/block_weights.block_weighted. Both forms end in the same map, so a preset
    equals its block-name form exactly.

    What the vectors mean follows hako-mikan/sd-webui-lora-block-weight (its README and the layouts and
    default presets of scripts/lora_block_weight.py), restated here:

    - SD1.5: 17 values (BASE, IN01, IN02, IN04, IN05, IN07, IN08, M00, OUT03..OUT11: the blocks a LoRA
      patches) or 26 (BASE, IN00..IN11, M00, OUT00..OUT11). SDXL: 12 (BASE, IN04, IN05, IN07, IN08, M00,
      OUT00..OUT05) or 20 (BASE, IN00..IN08, M00, OUT00..OUT08). Flux.1: 61 (CLIP, T5, IN, D00..D18,
      S00..S37, OUT; IN = img_in, txt_in, time_in, vector_in, guidance_in; OUT = final_layer).
    - A block a short vector leaves out gets 0 (the extension's README: "any layers not provided will be
      treated as having a weight of 0"). BASE is the text encoder (with Set CLIP Hooks).
    - The default presets are 17-value SD1.5 vectors (and FLUXALL, 61 values). On SDXL the extension applies
      a 17-value preset by block name, and so does this module: OUTALL sets OUT03..OUT08 (the names SDXL
      has), not SDXL's deep OUT00..OUT02. A number list must have one of its architecture's own lengths.
    - SD2.x takes SD1.5's vectors and presets (the extension applies them to both: one UNet layout, the
      same LoRA key names). It defines none for the other families of merge/architectures.py (SD3, Wan,
      Qwen-Image, ...): use the block-name form there.
    - One difference: keys in no block of the extension (SD1.5's time_embed, out.*) keep strength 1 there;
      here they follow BASE / the last OUT block as in the block-name form. LoRA files rarely patch them.

    Errors (LbwError) name the value, the allowed names or lengths and the fix.
    """
    layouts = LAYOUTS.get(arch)
    if layouts is None:
        raise LbwError(f"LoRA Block Weight vectors are defined for {', '.join(LAYOUTS)}, not {arch}; use "
                       f"block=strength items with {arch}'s block names.")
    preset, values = _parse(spec)
    ids = _PRESET_IDS[len(values)] if preset is not None else layouts.get(len(values))
    full = next(iter(layouts.values()))
    if ids is None or not set(ids) & set(full):
        what = f"preset {preset!r} ({_OWNER[len(values)]}, {len(values)} values)" if preset else \
            f"a list of {len(values)} values"
        takes = " or ".join(str(n) for n in sorted(layouts))
        raise LbwError(f"{what} does not fit {arch}, which takes {takes} values; expected lengths: "
                       f"{_lengths()}.")
    given = dict(zip(ids, values, strict=True))
    weights = {block: given.get(block, 0.0) for block in full}
    return _named(weights) if arch == "flux" else LbwMap(weights)


def _named(weights: dict[str, float]) -> LbwMap:
    """Flux's extension ids (CLIP, T5, IN, Dnn, Snn, OUT) in merge/blocks.py's names."""
    blocks = {"BASE": weights["CLIP"], **dict.fromkeys(_FLUX_IN, weights["IN"])}
    for block, value in weights.items():
        if block[0] in "DS" and block[1:].isdigit():
            group = "double_blocks" if block[0] == "D" else "single_blocks"
            blocks[f"{group}.{int(block[1:])}"] = value
    blocks["final_layer"] = weights["OUT"]
    return LbwMap(blocks, ((_T5, weights["T5"]),))
