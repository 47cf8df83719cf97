"""Couple Region: one region of an attention couple (prompt, mask, optional LoRA with strength and schedule)
as a link of a COUPLE_REGIONS chain, so Attention Couple from Regions (nodes/attention_couple.py) shows only
the regions in use where the 8-slot node's 40 widgets are too tall to read when a workflow is fit to screen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from comfy_api.latest import io

from ..hooks import couple
from . import hook_lora, lora_files, v3

__all__ = ["NODES", "PatchbayCoupleRegion", "Region", "check_chain"]

CATEGORY = "Patchbay/hooks"


@dataclass(frozen=True, eq=False)  # eq=False: a mask tensor has no truth value; a Region is itself
class Region:
    """One region as its node or slot gives it: the prompt's text, its MASK, the LoRA's file name
    (lora_files.NONE: no LoRA), its strength (model and CLIP) and schedule text (strength@percent)."""

    prompt: str
    mask: torch.Tensor
    lora: str = lora_files.NONE
    strength: float = 1.0
    schedule: str = ""


def check_chain(regions: object) -> tuple[Region, ...]:
    """``regions`` as a tuple of Regions, at most couple.MAX_REGIONS; raises CoupleError otherwise."""
    if not isinstance(regions, tuple) or not all(isinstance(r, Region) for r in regions):
        raise couple.CoupleError(f"regions is a {type(regions).__name__}, not a chain of Couple Region "
                                 f"nodes: connect the last Couple Region (Patchbay) of the chain.")
    if len(regions) > couple.MAX_REGIONS:
        raise couple.CoupleError(f"the chain holds {len(regions)} regions, at most {couple.MAX_REGIONS}: "
                                 f"merge regions that share a prompt into one mask.")
    return regions


def _schedule_error(schedule: str) -> str | None:
    try:
        hook_lora.keyframes_for(schedule, "percent")
    except ValueError as error:
        return f"schedule {schedule!r}: {error}"
    return None


class PatchbayCoupleRegion(v3.Node):
    """Records names and texts only: Attention Couple from Regions reads the LoRA files (nodes that read
    LoRA files keep them per node and stay V1, nodes/lora_files.py ReadsLoras), so this node is V3."""

    NODE_ID = "PatchbayCoupleRegion"
    DISPLAY_NAME = "Couple Region (Patchbay)"

    @classmethod
    def define_schema(cls) -> io.Schema:
        return v3.schema(
            cls, category=CATEGORY,
            description=(f"One region of an attention couple: its prompt acts inside its mask, its LoRA "
                         f"only there. Chain up to {couple.MAX_REGIONS} into Attention Couple from Regions."),
            inputs=[
                io.Mask.Input("mask", tooltip="Where this region is: one mask, the image's or the latent's "
                                              "size, as every region's."),
                io.String.Input("prompt", multiline=True, default="", dynamic_prompts=True,
                                tooltip="This region's prompt, attended inside its mask only."),
                io.Combo.Input("lora", options=[lora_files.NONE, *lora_files.lora_names()],
                               tooltip="This region's LoRA, acting inside its mask only (None: no LoRA)."),
                io.Float.Input("strength", default=1.0, min=-20.0, max=20.0, step=0.01,
                               tooltip="The LoRA's strength (model, and CLIP on this region's prompt)."),
                io.String.Input("schedule", default="",
                                tooltip="The LoRA's schedule: strength@percent items, e.g. 0@0, 1@0.5; "
                                        "empty = full strength throughout."),
                v3.COUPLE_REGIONS.Input("prev_regions", optional=True,
                                        tooltip="The regions before this one (a Couple Region's output); "
                                                "not changed."),
            ],
            outputs=[v3.output(v3.COUPLE_REGIONS, "regions",
                               "The incoming regions, then this one: for Attention Couple from Regions or "
                               "the next Couple Region.")])

    @classmethod
    def validate_inputs(cls, schedule: str | None = None) -> bool | str:
        return True if schedule is None else _schedule_error(schedule) or True

    @classmethod
    def execute(cls, mask: torch.Tensor, prompt: str = "", lora: str = lora_files.NONE, strength: float = 1.0,
                schedule: str = "", prev_regions: tuple[Region, ...] | None = None) -> io.NodeOutput:
        chain = check_chain(prev_regions or ())
        number = len(chain) + 1
        if number > couple.MAX_REGIONS:
            raise couple.CoupleError(f"this Couple Region would be region {number}; an attention couple "
                                     f"takes at most {couple.MAX_REGIONS}: merge regions that share a prompt "
                                     f"into one mask.")
        couple.region_mask(mask, number)
        if error := _schedule_error(schedule):
            raise couple.CoupleError(f"region {number}'s {error}")
        return io.NodeOutput((*chain, Region(prompt, mask, lora, float(strength), schedule)))


NODES = [PatchbayCoupleRegion]
