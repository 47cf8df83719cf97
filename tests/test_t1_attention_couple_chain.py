"""T1: Attention Couple from Regions (a chain of Couple Region nodes, nodes/couple_region.py) samples
exactly as Attention Couple's 8 fixed slots (nodes/attention_couple.py) given the same regions: the same
positive conditioning and a bit-identical sampled latent, on the tiny SD1.5 checkpoint (four stripes, the
four LoRA formats, one of them scheduled, one at a negative strength, feathered) and on the tiny Flux.1
(two regions, its kohya LoRA scheduled on one; Flux's CLIP-L + T5-XXL cannot be tiny, so a stand-in CLIP
gives devtools/arch_sampling.py's synthesized conditioning per prompt text, to both nodes alike). The
Couple Region nodes run through ComfyUI's own executor (a V3 node's locked class) and validator. Bad input:
a ninth region, a missing, empty or batched mask, a bad schedule, something else than a chain; each refused
with the value and the fix. The couple's references themselves: tests/test_t1_attention_couple*.py.
"""

from __future__ import annotations

import asyncio
import types
import zlib

import arch_sampling
import pytest
import torch
from hook_rig import Rig

pytestmark = pytest.mark.t1

LORAS = ("patchbay-lora-r4.safetensors", "patchbay-locon-r4.safetensors", "patchbay-loha-r4.safetensors",
         "patchbay-lokr-r4.safetensors")
STEPS = 2
BASE = "four friends in a park"


def run_node(comfy, node_id: str, **inputs) -> list:
    """The node's outputs as ComfyUI's executor makes them."""
    import execution

    cls = comfy.nodes.NODE_CLASS_MAPPINGS[node_id]
    data = {name: [value] for name, value in inputs.items()}
    output, _ui, _subgraph, _pending = asyncio.run(execution.get_output_data("t1", "1", cls(), data))
    return [values[0] for values in output]


def validate(comfy, inputs: dict) -> tuple[bool, list[dict]]:
    """ComfyUI's validation of a one-node prompt of Couple Region with ``inputs``."""
    import execution

    prompt = {"1": {"class_type": "PatchbayCoupleRegion", "inputs": inputs}}
    valid, errors, _ = asyncio.run(execution.validate_inputs("t1", prompt, "1", {}))
    return valid, errors


def region_inputs(prompt, mask, lora="None", strength=1.0, schedule=""):
    return {"prompt": prompt, "mask": mask, "lora": lora, "strength": strength, "schedule": schedule}


def chain(comfy, regions: list[dict]) -> tuple:
    """The regions through Couple Region nodes, each taking the one before."""
    previous = None
    for inputs in regions:
        extra = {} if previous is None else {"prev_regions": previous}
        (previous,) = run_node(comfy, "PatchbayCoupleRegion", **inputs, **extra)
    return previous


def slots(regions: list[dict]) -> dict:
    """The same regions as Attention Couple's inputs prompt_1, mask_1, lora_1 ..."""
    return {f"{name}_{i}": value for i, inputs in enumerate(regions, 1) for name, value in inputs.items()}


def stripes(count: int) -> list[torch.Tensor]:
    """``count`` vertical stripes covering the 64x64 image."""
    masks = []
    for i in range(count):
        mask = torch.zeros((1, 64, 64))
        mask[:, :, i * 64 // count:(i + 1) * 64 // count] = 1.0
        masks.append(mask)
    return masks


def both(comfy, model, clip, regions: list[dict], feather: int) -> tuple[tuple, tuple]:
    """(MODEL, positive) of Attention Couple's slots and of Attention Couple from Regions' chain."""
    nodes = comfy.nodes.NODE_CLASS_MAPPINGS
    fixed = nodes["PatchbayAttentionCouple"]().couple(model, clip, BASE, feather, **slots(regions))
    chained = nodes["PatchbayAttentionCoupleRegions"]().couple(model, clip, chain(comfy, regions), BASE,
                                                               feather)
    return fixed, chained


def assert_same_positive(fixed: list, chained: list) -> None:
    assert len(fixed) == len(chained) == 1
    assert torch.equal(fixed[0][0], chained[0][0])
    assert fixed[0][1].keys() == chained[0][1].keys()
    for key, value in fixed[0][1].items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, chained[0][1][key]), key
    hooks = [[(h.hook_id, h.strength) for h in c[0][1]["hooks"].hooks] for c in (fixed, chained)]
    assert hooks[0] == hooks[1]


@pytest.fixture(scope="module")
def rig(comfy):
    return Rig(comfy)


# The Flux test runs first: it needs no rig, and the tiny SD1.5 the rig loads would otherwise sit beside
# the tiny Flux (module peak 4.77 GB, 4.05 GB in this order; tests/conftest.py frees the Flux after it).
class StandInClip:
    """What the couple nodes call on a CLIP, for a model whose text encoder cannot be tiny: each prompt
    text gives arch_sampling's synthesized Flux conditioning (seeded by the text); a region LoRA's CLIP
    part registers on a patcher that keeps nothing (the tiny Flux LoRAs have no text encoder keys)."""

    def __init__(self) -> None:
        self.cond_stage_model = torch.nn.Module()  # no weights: check_lora_fits finds no CLIP keys
        self.patcher = types.SimpleNamespace(forced_hooks=None,
                                             register_all_hook_patches=lambda hooks, target: None)
        self.apply_hooks_to_conds = None
        self.use_clip_schedule = False

    def clone(self) -> StandInClip:
        return StandInClip()

    def tokenize(self, text: str) -> str:
        return text

    def encode_from_tokens_scheduled(self, text: str) -> list:
        return arch_sampling.make_cond("flux", zlib.crc32(text.encode()))


def test_flux_chain_samples_exactly_as_the_eight_slots(comfy):
    flux = arch_sampling.shared_model("flux")
    left = stripes(2)[0]
    regions = [region_inputs("a knight", left, arch_sampling.FLUX_LORAS[0], 0.8, "0@0, 1@0.5"),
               region_inputs("a dragon", 1.0 - left)]
    (fixed_model, fixed_pos), (chained_model, chained_pos) = both(comfy, flux, StandInClip(), regions, 12)
    assert_same_positive(fixed_pos, chained_pos)
    negative = arch_sampling.make_cond("flux", 2)
    fixed = arch_sampling.sample(fixed_model, fixed_pos, negative, steps=STEPS, latent_size=8)
    chained = arch_sampling.sample(chained_model, chained_pos, negative, steps=STEPS, latent_size=8)
    assert torch.equal(chained, fixed)
    no_lora = [region_inputs("a knight", left), regions[1]]
    model, pos = both(comfy, flux, StandInClip(), no_lora, 12)[1]
    assert not torch.equal(arch_sampling.sample(model, pos, negative, steps=STEPS, latent_size=8), fixed)


def test_sd15_chain_samples_exactly_as_the_eight_slots(rig, comfy):
    prompts = ("a knight in silver armor", "a wizard in a blue robe", "a robot with red lights",
               "a pirate with a parrot")
    strengths, schedules = (1.0, 0.7, 1.0, -0.5), ("", "0@0, 1@0.5", "", "")
    regions = [region_inputs(*args) for args in zip(prompts, stripes(4), LORAS, strengths, schedules,
                                                    strict=True)]
    (fixed_model, fixed_pos), (chained_model, chained_pos) = both(comfy, rig.model, rig.clip, regions, 6)
    assert_same_positive(fixed_pos, chained_pos)
    fixed = rig.sample(fixed_model, fixed_pos, steps=STEPS)
    assert torch.equal(rig.sample(chained_model, chained_pos, steps=STEPS), fixed)
    assert not torch.equal(fixed, rig.sample(rig.model, rig.encode(BASE), steps=STEPS))
    _, unscheduled = both(comfy, rig.model, rig.clip, [{**r, "schedule": ""} for r in regions], 6)
    (hook,) = [h for h in chained_pos[0][1]["hooks"].hooks if h.hook_id == LORAS[1]]
    assert [(k.strength, k.start_percent) for k in hook.hook_keyframe.keyframes] == [(0.0, 0.0), (1.0, 0.5)]
    assert not any(h.hook_keyframe.keyframes for h in unscheduled[1][0][1]["hooks"].hooks)


def test_a_ninth_region_is_refused_by_the_region_and_by_the_couple(rig, comfy):
    eight = chain(comfy, [region_inputs(f"person {i}", mask) for i, mask in enumerate(stripes(8))])
    assert len(eight) == 8
    with pytest.raises(ValueError, match="would be region 9; an attention couple takes at most 8: merge"):
        run_node(comfy, "PatchbayCoupleRegion", **region_inputs("one more", stripes(8)[0]),
                 prev_regions=eight)
    node = comfy.nodes.NODE_CLASS_MAPPINGS["PatchbayAttentionCoupleRegions"]()
    nine = (*eight, eight[0])
    with pytest.raises(ValueError, match="the chain holds 9 regions, at most 8: merge regions"):
        node.couple(rig.model, rig.clip, nine, BASE, 0)
    with pytest.raises(ValueError, match="regions is a list, not a chain of Couple Region nodes: connect"):
        node.couple(rig.model, rig.clip, list(eight), BASE, 0)


def test_a_missing_mask_is_refused_before_the_prompt_runs(comfy):
    inputs = region_inputs("a knight", None)
    del inputs["mask"]
    valid, errors = validate(comfy, inputs)
    assert not valid
    assert [(e["type"], e["details"]) for e in errors] == [("required_input_missing", "mask")]


@pytest.mark.parametrize(("mask", "words"), [
    (torch.zeros((1, 64, 64)), ("region 2's mask is empty", "draw the region")),
    (torch.ones((2, 64, 64)), ("region 2's mask has shape (2, 64, 64)", "pick one mask of the batch")),
])
def test_an_empty_or_batched_mask_is_refused_at_its_region(comfy, mask, words):
    first = chain(comfy, [region_inputs("a knight", stripes(2)[0])])
    with pytest.raises(ValueError) as error:
        run_node(comfy, "PatchbayCoupleRegion", **region_inputs("a dragon", mask), prev_regions=first)
    assert all(w in str(error.value) for w in words), str(error.value)


def test_a_bad_schedule_is_refused_before_the_prompt_runs(comfy):
    inputs = region_inputs("a knight", stripes(2)[0], LORAS[0], 1.0, "0@0, 1@half")
    valid, errors = validate(comfy, {k: v for k, v in inputs.items() if k != "mask"})
    assert not valid and any(e["details"].startswith("schedule - schedule '0@0, 1@half'") for e in errors)
    with pytest.raises(ValueError, match="region 1's schedule '0@0, 1@half'"):
        run_node(comfy, "PatchbayCoupleRegion", **inputs)


def test_the_chain_is_not_changed_by_the_next_region(comfy):
    first = chain(comfy, [region_inputs("a knight", stripes(2)[0])])
    (second,) = run_node(comfy, "PatchbayCoupleRegion", **region_inputs("a dragon", stripes(2)[1]),
                         prev_regions=first)
    assert len(first) == 1 and len(second) == 2 and second[0] is first[0]
    assert [r.prompt for r in second] == ["a knight", "a dragon"]
