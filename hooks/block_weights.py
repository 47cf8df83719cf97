"""Per-block strengths on LoRA hooks (Hook Block Weights, ``lbw=`` tags): the LoRA's factors scaled key
by key, as a new hook, since core's hooks have one strength per LoRA.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import comfy.hooks
import comfy.lora
import comfy.lora_convert

__all__ = ["BlockWeightError", "block_weighted", "parse_block_map"]

# the factor whose scaling scales the delta, by the suffix comfy.weight_adapter reads it under
_SCALED = (".lora_up.weight", "_lora.up.weight", ".lora_B.weight", ".lora.up.weight",
           ".lora_linear_layer.up.weight", ".hada_w1_a", ".lokr_w1", ".lokr_w1_a", ".diff", ".diff_b")
_SET = ".set_weight"  # a "set" patch (comfy.lora_convert writes BFL norm scales as one): no delta to scale
_ITEM = re.compile(r"[^,;\n]+")


class BlockWeightError(ValueError):
    """A bad block map or a hook that cannot take block weights; the message names it and the fix."""


def parse_block_map(text: str) -> dict[str, float]:
    """``name=strength`` items separated by commas, semicolons or new lines (``#`` comments)."""
    mapping: dict[str, float] = {}
    for line_no, raw in enumerate(text.splitlines() or [""], start=1):
        line = raw.split("#", 1)[0]
        for match in _ITEM.finditer(line):
            item = match.group().strip()
            if not item:
                continue
            name, eq, value = item.partition("=")
            column = match.start() + 1 + len(match.group()) - len(match.group().lstrip())
            where = f"line {line_no}, column {column}"
            try:
                strength = float(value) if eq else math.nan
            except ValueError:
                strength = math.nan
            if not name.strip() or not math.isfinite(strength):
                raise BlockWeightError(f"block map item {item!r} at {where} is not name=strength; write e.g. "
                                       f"IN00=0, OUT05=0.5, default=1.")
            mapping[name.strip()] = strength
    if not mapping:
        raise BlockWeightError(f"block map {text!r} holds no entry; write e.g. IN00=0, OUT05=0.5, default=1.")
    return mapping


def _target(key_map: dict[str, Any], prefix: str) -> str | None:
    """The model weight a LoRA module name patches (Flux diffusers names map to a slice of a fused
    weight: ``(key, (dim, offset, size))``, whose key is what the block depends on)."""
    target = key_map.get(prefix)
    return target[0] if isinstance(target, tuple) else target


def _scaled(lora: dict, key_map: dict[str, Any], strength_of: Callable[[str], float], name: str) -> dict:
    out = dict(lora)
    for key, tensor in lora.items():
        if key.endswith(_SET):  # a weight the LoRA replaces (BFL norm scales): kept unless its block is 0
            prefix = key[: -len(_SET)]
            if strength_of(_target(key_map, prefix) or prefix) == 0.0:
                del out[key]
            continue
        suffix = next((s for s in _SCALED if key.endswith(s)), None)
        if suffix is None:
            continue
        prefix = key[: -len(suffix)]
        target = _target(key_map, prefix)
        if target is None:
            continue
        strength = strength_of(target)
        if strength == 1.0:
            continue
        if f"{prefix}.dora_scale" in lora:
            raise BlockWeightError(f"LoRA {name!r} is a DoRA ({prefix}.dora_scale): its delta does not "
                                   f"scale with a factor, so block weights cannot apply; use a plain LoRA "
                                   f"or LoCon.")
        out[key] = tensor * strength
    return out


def block_weighted(hooks: comfy.hooks.HookGroup, model, clip, strength_of: Callable[[str], float]
                   ) -> comfy.hooks.HookGroup:
    """A new HookGroup: each LoRA WeightHook of ``hooks`` with its weights scaled per model key.

        parse_block_map("IN00=0, OUT*=0.5, default=1") -> {"IN00": 0.0, "OUT*": 0.5, "default": 1.0}
        block_weighted(hooks, model, clip, strength_of) -> a new HookGroup: every LoRA WeightHook replaced by
            one whose file's tensors for model weight ``k`` are scaled by ``strength_of(k)``

    Scaling one factor scales the LoRA's delta on that weight: the up (B) matrix of LoRA/LoCon, ``w1`` of
    LoHa/LoKr, a full ``diff``. A weight the LoRA replaces outright (``set``: the norm scales of BFL-layout
    Flux files) has no delta to scale; it stays unless its block's strength is 0, as LoraLoader sets it
    whatever the strength. Files are first parsed as LoraLoader parses them (``convert_lora``), so BFL-layout
    keys find their weights. DoRA (its delta is not linear in the factors) and model-as-LoRA hooks are
    refused with an error. Which block a weight belongs to is the caller's (the node layer maps model keys to
    the merge library's block names); this module only sees a key -> strength function.
    Nothing passed in is changed; the new hooks get their own identity.
    """
    key_map = comfy.lora.model_lora_keys_unet(model.model, {})
    if clip is not None:
        key_map = comfy.lora.model_lora_keys_clip(clip.cond_stage_model, key_map)
    out = comfy.hooks.HookGroup()
    for hook in hooks.hooks:
        if not isinstance(hook, comfy.hooks.WeightHook):
            out.add(hook.clone())
            continue
        name = hook.hook_id or "hook"
        if not hook.need_weight_init:
            raise BlockWeightError(f"{name} is a model-as-LoRA hook: block weights apply to LoRA hooks; "
                                   f"use a per-block model merge instead.")
        # a new hook (new identity: caches key on it) with the same base strengths, schedule and name
        # parsed as LoraLoader parses it (BFL-layout Flux keys get their diffusion_model. names)
        lora = comfy.lora_convert.convert_lora(hook.weights)
        new = comfy.hooks.create_hook_lora(_scaled(lora, key_map, strength_of, name),
                                           hook._strength_model, hook._strength_clip)
        new.set_keyframes_on_hooks(hook.hook_keyframe)
        new.hooks[0].hook_id = hook.hook_id
        out = out.clone_and_combine(new)
    return out
