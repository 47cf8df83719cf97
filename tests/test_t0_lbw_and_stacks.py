"""T0: A1111 LoRA Block Weight presets and lists (hooks/lbw.py), lbw= in LoRA tags (hooks/prompt_tags.py) and
LORA_STACK entries as other packs make them (hooks/lora_stack.py)."""

from __future__ import annotations

import ntpath

import pytest

pytestmark = pytest.mark.t0

SD15 = ("BASE", *(f"IN{i:02}" for i in range(12)), "M00", *(f"OUT{i:02}" for i in range(12)))


@pytest.fixture(scope="module")
def lbw(pack):
    from patchbay.hooks import lbw

    return lbw


@pytest.fixture(scope="module")
def stacks(pack):
    from patchbay.hooks import lora_stack

    return lora_stack


def ones(*blocks: str) -> dict[str, float]:
    """SD1.5's 26 blocks: 1 on ``blocks``, 0 elsewhere (what a 17-value vector leaves out is 0)."""
    return {b: 1.0 if b in blocks else 0.0 for b in SD15}


# the README's 17-value layout (BASE, IN01, IN02, IN04, IN05, IN07, IN08, M00, OUT03..OUT11) read by hand
OUT = [f"OUT{i:02}" for i in range(3, 12)]
PRESET_BLOCKS = {
    "NONE": ones(),
    "ALL": ones("BASE", "IN01", "IN02", "IN04", "IN05", "IN07", "IN08", "M00", *OUT),
    "INS": ones("BASE", "IN01", "IN02", "IN04"),
    "IND": ones("BASE", "IN05", "IN07", "IN08"),
    "INALL": ones("BASE", "IN01", "IN02", "IN04", "IN05", "IN07", "IN08"),
    "MIDD": ones("BASE", "IN05", "IN07", "IN08", "M00", "OUT03", "OUT04", "OUT05", "OUT06"),
    "OUTD": ones("BASE", "OUT03", "OUT04", "OUT05", "OUT06"),
    "OUTS": ones("BASE", "OUT07", "OUT08", "OUT09", "OUT10", "OUT11"),
    "OUTALL": ones("BASE", *OUT),
}


@pytest.mark.parametrize("preset", sorted(PRESET_BLOCKS))
def test_sd15_presets_give_the_documented_blocks(lbw, preset):
    assert lbw.block_map(preset, "sd15").blocks == PRESET_BLOCKS[preset]


@pytest.mark.parametrize("spec", ["OUTALL", "MIDD", "1,0,0,0,0,0,0,0,1,1,1,1,1,1,1,1,1",
                                  ",".join(["0.5"] * 26)])
def test_sd2_takes_the_sd15_vectors_and_presets(lbw, spec):
    """The extension applies its SD1 vectors to SD2 LoRAs (the same UNet blocks and kohya key names)."""
    assert lbw.block_map(spec, "sd2").blocks == lbw.block_map(spec, "sd15").blocks


def test_half_preset_lower_case_and_comments(lbw):
    half = {b: v * 0.5 for b, v in PRESET_BLOCKS["ALL"].items()}
    assert lbw.block_map("ALL0.5", "sd15").blocks == half
    commented = "outall  # the deep and shallow out blocks"
    assert lbw.block_map(commented, "sd15").blocks == PRESET_BLOCKS["OUTALL"]


def test_number_lists_in_each_layout(lbw):
    seventeen = "1,0,0,0,0,0,0,0,1,1,1,1,1,1,1,1,1"
    assert lbw.block_map(seventeen, "sd15").blocks == PRESET_BLOCKS["OUTALL"]
    full = [0.1 * i for i in range(26)]
    assert lbw.block_map(",".join(map(str, full)), "sd15").blocks == dict(zip(SD15, full, strict=True))
    twelve = lbw.block_map("1, 0,0,0,0, 0.5, 1,1,1,1,1,1", "sdxl").blocks
    assert (twelve["M00"], twelve["OUT05"], twelve["OUT06"], twelve["IN00"]) == (0.5, 1.0, 0.0, 0.0)
    assert len(lbw.block_map(",".join(["1"] * 20), "sdxl").blocks) == 20


def test_presets_on_sdxl_go_by_block_name_as_the_extension_applies_them(lbw):
    xl = lbw.block_map("OUTALL", "sdxl").blocks
    assert xl == {b: v for b, v in PRESET_BLOCKS["OUTALL"].items() if b in xl}
    assert [b for b, v in xl.items() if v] == ["BASE", "OUT03", "OUT04", "OUT05", "OUT06", "OUT07", "OUT08"]
    assert "OUT09" not in xl and len(xl) == 20


def test_flux_vector_names(lbw):
    values = [0.0, 0.5, 0.25, *[1.0] * 19, *[2.0] * 38, 3.0]  # CLIP, T5, IN, D00..D18, S00..S37, OUT
    found = lbw.block_map(",".join(map(str, values)), "flux")
    assert found.blocks["BASE"] == 0.0 and found.text == (("t5xxl.", 0.5),)
    assert found.blocks["img_in"] == found.blocks["guidance_in"] == 0.25
    assert found.blocks["double_blocks.18"] == 1.0 and found.blocks["single_blocks.37"] == 2.0
    assert found.blocks["final_layer"] == 3.0
    assert set(lbw.block_map("FLUXALL", "flux").blocks.values()) == {1.0}


@pytest.mark.parametrize(("spec", "arch", "needles"), [
    ("OUTAL", "sd15", ["'OUTAL' is no LoRA Block Weight preset", "did you mean 'OUTALL'", "MIDD"]),
    ("MID", "sd15", ["did you mean 'MIDD'"]),
    ("1,1,1", "sd15", ["has 3 values", "sd15: 17 or 26; sd2: 17 or 26; sdxl: 12 or 20; flux: 61"]),
    (",".join(["1"] * 17), "sdxl", ["a list of 17 values does not fit sdxl, which takes 12 or 20 values"]),
    (",".join(["1"] * 12), "sd15", ["does not fit sd15, which takes 17 or 26"]),
    ("OUTALL", "flux", ["preset 'OUTALL' (an SD1.5 LoRA vector, 17 values) does not fit flux"]),
    ("FLUXALL", "sd15", ["preset 'FLUXALL' (a Flux vector, 61 values) does not fit sd15"]),
    ("1,R,0", "sd15", ["value 2 ('R')", "random values are not supported"]),
    ("ALL", "sd3", ["defined for sd15, sd2, sdxl, flux, not sd3", "block=strength items"]),
])
def test_lbw_errors_name_the_value_and_the_fix(lbw, spec, arch, needles):
    with pytest.raises(lbw.LbwError) as info:
        lbw.block_map(spec, arch)
    for needle in needles:
        assert needle in str(info.value)


def test_which_texts_are_lbw(lbw):
    assert lbw.is_lbw("OUTALL") and lbw.is_lbw("1,0,1 # note") and lbw.is_lbw("OUT05")
    assert not lbw.is_lbw("IN00=0, OUT*=1") and not lbw.is_lbw("# only a comment")


# --- lbw= in LoRA tags -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tags(pack):
    from patchbay.hooks import prompt_tags

    return prompt_tags


def test_lbw_in_tags(tags):
    clean, found = tags.split_prompt("a <lora:ink:0.8:lbw=OUTALL> knight <lora:x:lbw=1,0,0,0,0,0,0,0,1,1,1,1,"
                                     "1,1,1,1,1> <lora:y:0@0,1@0.5:lbw=MIDD>")
    assert clean == "a knight"
    assert [(t.name, t.strength, t.blocks) for t in found] == [
        ("ink", 0.8, "OUTALL"), ("x", 1.0, "1,0,0,0,0,0,0,0,1,1,1,1,1,1,1,1,1"), ("y", 1.0, "MIDD")]
    assert found[2].schedule is not None
    assert tags.split_prompt("<lora:plain:0.5>")[1][0].blocks is None


@pytest.mark.parametrize(("text", "needle"), [
    ("<lora:x:1:lbw=OUTAL>", "'<lora:x:1:lbw=OUTAL>' at column 1: 'OUTAL' is no LoRA Block Weight preset"),
    ("<lora:x:1:lbw=1,1>", "has 2 values; expected sd15: 17 or 26"),
    ("<lora:x:1:stop=10>", "stop= is not supported (only lbw=)"),
    ("<lora:x:1:0.5>", "has 2 strengths"),
])
def test_lbw_tag_errors(tags, text, needle):
    with pytest.raises(ValueError) as info:
        tags.split_prompt(text)
    assert needle in str(info.value)


# --- LORA_STACK as other packs make it -------------------------------------------------------------
# Efficiency Nodes' LoRA Stacker: [(name, wt, wt) ...] ("simple" mode) with "None" names left out, then the
# incoming stack appended; Comfyroll's CR LoRA Stack: [(name, model_weight, clip_weight) ...]; LoRA
# Manager's Lora Stacker: (path relative to the loras root with the OS separator, or the absolute path of
# a file outside the roots it knows, float(strength), float(clip strength)).

def test_stack_formats_of_three_packs(stacks):
    efficiency = [("style/ink.safetensors", 0.8, 0.8), ("armor.safetensors", 1.0, 1.0)]
    comfyroll = [("armor.safetensors", 1.0, 0.5)]
    lora_manager = [(ntpath.join("style", "ink.safetensors"), 0.7, 0.3),
                    ("D:\\ComfyUI\\models\\loras\\armor.safetensors", 1.0, 1.0)]
    got = stacks.stack_entries(efficiency + comfyroll + lora_manager)
    assert [(e.position, e.name, e.strength_model, e.strength_clip) for e in got] == [
        (1, "style/ink.safetensors", 0.8, 0.8), (2, "armor.safetensors", 1.0, 1.0),
        (3, "armor.safetensors", 1.0, 0.5), (4, "style\\ink.safetensors", 0.7, 0.3),
        (5, "D:\\ComfyUI\\models\\loras\\armor.safetensors", 1.0, 1.0)]
    assert [e.stem for e in got] == ["ink", "armor", "armor", "ink", "armor"]
    assert stacks.stack_entries(None) == () and stacks.stack_entries([]) == ()
    assert [e.position for e in stacks.stack_entries([("None", 1.0, 1.0), ("a", 1, 0)])] == [2]


def test_schedules_by_position_and_by_name(stacks):
    entries = stacks.stack_entries([("style/ink.safetensors", 1.0, 1.0), ("armor.safetensors", 1.0, 1.0),
                                    ("D:\\loras\\Ink.safetensors", 0.5, 0.5)])
    text = "2: 0@0, 1@0.5  # fade in\n\nINK.safetensors: 1@0, 0@0.6\n"
    assert stacks.entry_schedules(text, entries) == {2: "0@0, 1@0.5", 1: "1@0, 0@0.6", 3: "1@0, 0@0.6"}
    assert stacks.entry_schedules("", entries) == {}


@pytest.mark.parametrize(("stack", "needle"), [
    ("ink.safetensors", "LORA_STACK is a str, not a list of (LoRA name, model strength, clip strength)"),
    ([()], "LORA_STACK entry 1 (()) is not (LoRA name, model strength, clip strength)"),
    ([("a", 1.0, 1.0), ("b", 1.0)], "LORA_STACK entry 2 (('b', 1.0)) is not"),
    ([("", 1.0, 1.0)], "LORA_STACK entry 1 (('', 1.0, 1.0)) has no LoRA name"),
    ([(None, 1.0, 1.0)], "has no LoRA name"),
    ([("a", "strong", 1.0)], "model strength 'strong' is not a finite number"),
    ([("a", 1.0, None)], "clip strength None is not a finite number"),
    ([("a", 1.0, float("nan"))], "clip strength nan is not a finite number"),
])
def test_bad_stack_entries(stacks, stack, needle):
    with pytest.raises(stacks.StackError) as info:
        stacks.stack_entries(stack)
    assert needle in str(info.value)


@pytest.mark.parametrize(("text", "needle"), [
    ("3: 1@0", "the stack has no LoRA at position 3 (positions held: 1, 2)"),
    ("inc: 1@0", "no LoRA named 'inc' in the stack; did you mean 'ink'?"),
    ("1@0, 0@1", "schedules line 1 ('1@0, 0@1') is not LABEL: schedule"),
    (": 1@0", "is not LABEL: schedule"),
])
def test_bad_schedule_lines(stacks, text, needle):
    entries = stacks.stack_entries([("ink.safetensors", 1.0, 1.0), ("armor.safetensors", 1.0, 1.0)])
    with pytest.raises(stacks.StackError) as info:
        stacks.entry_schedules(text, entries)
    assert needle in str(info.value)
