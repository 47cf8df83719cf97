"""What the template browser shows of each bundled workflow: its file name is its title.

ComfyUI (0.3.75 and 0.33, app/custom_node_manager.py) lists a pack's templates as the bare names of
``workflows/*.json`` (GET /api/workflow_templates) and serves ``<name>.json`` and ``<name>.jpg``; the
frontend (1.32.9, 1.49.6 and 1.58.1 alike, workflowTemplatesStore) makes each card from the name alone:
title = name, description = name with ``-`` and ``_`` as spaces, thumbnail = ``<name>.jpg``, one
category per pack (its folder name), search (Fuse over name, title and description, threshold 0.4,
location 0, distance 100) finding a word only where it starts within the first 40 characters. No
frontend reads a per-pack index.json or any metadata inside a workflow (an ``index.json`` in
``workflows/`` would even show as a template card named "index"). So the name carries it all:
``<Title> - Patchbay <Category>``: a card shows about the first 30 characters of its name (1.49.6 at
1920x1080, four cards a row), so the title comes first and is at most TITLE_LENGTH long, which keeps
"Patchbay" and the category (Hooks, Schedules, Regions, Merging) within search's reach; the category
also heads the thumbnail's caption. The source in devtools/workflow_sources keeps its short slug (and
the workflow id derived from it); the builder (devtools/build_workflows.py) writes
``workflows/<file name>.json`` and its captioned thumbnail from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import devpaths

CATEGORIES = ("Hooks", "Schedules", "Regions", "Merging")
SEARCH_REACH = 40  # a match must start within this many characters of the name (threshold x distance)
TITLE_LENGTH = 28  # what a card shows in full; with " - Patchbay Schedules" the category still starts by 40


@dataclass(frozen=True)
class Template:
    """One bundled workflow in the template browser."""

    category: str
    title: str
    description: str  # what it shows, in the thumbnail's caption
    subjects: tuple[str, ...]  # what a user searches it by (each must be found: tests/test_t2_discovery.py)

    @property
    def caption(self) -> str:
        """The thumbnail's caption: the category, then what the workflow shows."""
        return f"{self.category}: {self.description}"

    @property
    def file_name(self) -> str:
        return f"{self.title} - Patchbay {self.category}"


def _t(category: str, title: str, description: str, *subjects: str) -> Template:
    return Template(category, title, description, subjects)


CATALOG: dict[str, Template] = {
    "scheduled_lora_one_node": _t("Schedules", "Scheduled LoRA in one node",
                                  "A LoRA off for the first half, on from the middle step (0@0, 1@0.5).",
                                  "scheduled lora", "lora"),
    "clip_scheduled_lora": _t("Schedules", "LoRA scheduled on CLIP too",
                              "A LoRA hook scheduled on the text encoder as well (schedule_clip).",
                              "lora", "clip"),
    "model_as_lora_fade_in": _t("Schedules", "Model as LoRA fading in",
                                "A second checkpoint as a hook, fading in with eased keyframes.",
                                "model as lora", "fading"),
    "schedule_preview": _t("Schedules", "Hook schedule preview",
                           "A plot of three hooks' strengths over 20 steps, drawn without sampling.",
                           "schedule preview", "hook"),
    "floats_text_lora_schedule": _t("Schedules", "FLOATS typed, LoRA 0 to 1",
                                    "A LoRA hook whose strength follows a typed list: 0, 0.25, 0.75, 1.",
                                    "floats", "lora"),
    "floats_ramp_lora_fade_out": _t("Schedules", "FLOATS ramp, LoCon fade-out",
                                    "A LoCon hook fading out along an eased ramp, 0 on the last step.",
                                    "floats", "ramp", "locon"),
    "floats_repeat_lora_pulse": _t("Schedules", "FLOATS pulse, LoHa repeated",
                                   "A LoHa hook pulsing with a repeated strength pattern.",
                                   "floats", "pulse", "loha"),
    "trace_timeline_hook_schedule": _t("Schedules", "Trace timeline of a LoRA",
                                       "A FLOATS-scheduled LoRA hook traced step by step, drawn as a "
                                       "timeline.",
                                       "trace", "timeline"),
    "regional_lora_two_characters": _t("Regions", "Regional LoRA, 2 characters",
                                       "Two characters, two regional LoRAs, one Regional LoRA node and its "
                                       "region diagram.", "regional lora", "characters"),
    "regional_lora_four_regions": _t("Regions", "Four regions, 4 LoRA formats",
                                     "Four quadrants, each its own prompt and LoRA format (LoRA, LoCon, "
                                     "LoHa, LoKr).", "four regions", "lora"),
    "attention_couple_four_characters": _t("Regions", "Attention couple, 4 LoRAs",
                                           "Four characters in one batch row, each its prompt and LoRA "
                                           "inside its stripe.", "attention couple", "lora"),
    "regional_two_characters_core_hooks": _t("Regions", "Core hooks made fast",
                                             "Two characters with core's hook nodes, made fast by one Fast "
                                             "Hooks node.", "core hooks", "fast"),
    "prompt_lora_tags": _t("Hooks", "LoRA tags in the prompt",
                           "A prompt with A1111 <lora:name:0.8> and scheduled <lora:name:0@0,1@0.5> tags.",
                           "lora tags", "prompt"),
    "lora_stack_scheduled_hooks": _t("Hooks", "LoRA stack, scheduled hooks",
                                     "A LORA_STACK turned into hooks, two of them scheduled, on the "
                                     "positive prompt.", "lora stack", "hooks"),
    "lora_block_weights_hook": _t("Hooks", "LoRA block weights",
                                  "A LoRA hook kept out of the output blocks (OUT*=0), switched on at 40%.",
                                  "block weights", "lora"),
    "wan22_two_stage_lora": _t("Hooks", "Wan 2.2, LoRA on high noise",
                               "Wan 2.2 14B's two samplers: a LoRA on the high-noise stage only, a style "
                               "LoRA scheduled by sigma across both.",
                               "wan", "high noise", "lora"),
    "patch_order_lora": _t("Hooks", "Patch order of a LoRA",
                           "A LoRA on a model with Patchbay's per-model patch order (weight_patch_first).",
                           "patch order", "lora"),
    "recipe_hook_fade_in": _t("Merging", "Merge as a hook, fading in",
                              "A weighted_sum merge as a Recipe Hook: off for the first half, then "
                              "fading in.",
                              "merge", "hook"),
    "merge_two_checkpoints": _t("Merging", "Merge two checkpoints",
                                "Two checkpoints merged in the graph, sampled, and the recipe as text.",
                                "merge", "checkpoints"),
    "merge_grid_alpha_blocks": _t("Merging", "Merge grid, alpha x blocks",
                                  "A 3x3 grid: weighted_sum alpha across, pushed further to b per block "
                                  "group down.",
                                  "merge", "grid"),
    "merge_block_weights_sd15": _t("Merging", "Merge block weights, SD1.5",
                                   "The input blocks of one checkpoint, the output blocks of another.",
                                   "merge", "block weights", "sd1.5"),
    "merge_ties_three_models": _t("Merging", "TIES merge of three models",
                                  "Two fine-tunes' differences from their base trimmed, sign-elected, "
                                  "added back.",
                                  "ties", "merge"),
    "merge_lora_stack": _t("Merging", "LoRA stack merged into one",
                           "Three LoRAs merged into one rank-16 LoRA, its error per module, and used.",
                           "lora stack", "merge"),
    "merge_save_checkpoint": _t("Merging", "Save a merged checkpoint",
                                "A merge streamed into a checkpoint file (Save Merge) and sampled in "
                                "the graph.",
                                "save", "merged checkpoint"),
    "merge_extract_lora": _t("Merging", "Extract LoRA from 2 models",
                             "A LoRA extracted from the difference of two checkpoints, used in the same run.",
                             "extract", "lora"),
    "merge_recipe_from_text": _t("Merging", "Merge recipe from text",
                                 "An sd-mecha recipe pasted as text and run.", "merge", "recipe"),
    "merge_lora_delta_key_patterns": _t("Merging", "LoRA merged in by key",
                                        "A LoRA baked into a MODEL per key pattern (cross-attention full, "
                                        "feed-forward half).", "lora", "merged", "key"),
    "merge_sdxl_lora_block_weights": _t("Merging", "SDXL LoRA merged per block",
                                        "An SDXL LoRA baked into a UNet-only file, OUT blocks only, saved.",
                                        "sdxl", "lora", "merged", "block"),
}


def template(slug: str) -> Template:
    """The catalogue entry of source ``slug``; a source without one cannot be bundled."""
    try:
        return CATALOG[slug]
    except KeyError:
        raise KeyError(f"devtools/workflow_catalog.py has no entry for workflow source {slug!r}: add its "
                       f"category, title, description and subjects") from None


def bundled_path(slug: str, folder: Path = devpaths.WORKFLOWS_DIR) -> Path:
    """``workflows/<file name>.json`` of source ``slug`` (a leading "_" marks a builder test source,
    which keeps its slug)."""
    name = slug if slug.startswith("_") else template(slug).file_name
    return folder / f"{name}.json"
