"""T1: LORA_STACK lists from other packs as hooks, and A1111 LoRA Block Weight presets / lists on hooks.

References: a stack's hooks sample as core's CreateHookLora chain (KSampler latents within 1e-4 x max
|latent|) and encode as core's SetClipHooks with that chain; each preset resolves every LoRA target key
of the tiny SD1.5 (and synthetic SDXL / Flux keys, every block) to exactly the strength its hand-written
block-name form gives, and its hooks carry the same tensors; lbw= in a prompt tag equals the Prompt LoRA
+ Hook Block Weights chain.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from hook_rig import assert_close
from test_t0_lbw_and_stacks import PRESET_BLOCKS
from test_t1_hook_nodes import LOCON, LORA, Rig, assert_same_as_core

pytestmark = pytest.mark.t1

# the block-name form of each preset, written from the extension's README table (17-value layout)
SD15_FORMS = {
    "NONE": "default=0",
    "ALL": "BASE=1, IN01=1, IN02=1, IN04=1, IN05=1, IN07=1, IN08=1, M00=1, OUT0[3-9]=1, OUT1?=1, default=0",
    "INS": "BASE=1, IN01=1, IN02=1, IN04=1, default=0",
    "IND": "BASE=1, IN05=1, IN07=1, IN08=1, default=0",
    "INALL": "BASE=1, IN01=1, IN02=1, IN04=1, IN05=1, IN07=1, IN08=1, default=0",
    "MIDD": "BASE=1, IN05=1, IN07=1, IN08=1, M00=1, OUT03=1, OUT04=1, OUT05=1, OUT06=1, default=0",
    "OUTD": "BASE=1, OUT03=1, OUT04=1, OUT05=1, OUT06=1, default=0",
    "OUTS": "BASE=1, OUT07=1, OUT08=1, OUT09=1, OUT10=1, OUT11=1, default=0",
    "OUTALL": "BASE=1, OUT0[3-9]=1, OUT1?=1, default=0",
    "ALL0.5": "BASE=.5, IN01=.5, IN02=.5, IN04=.5, IN05=.5, IN07=.5, IN08=.5, M00=.5, OUT0[3-9]=.5, "
              "OUT1?=.5, default=0",
}
# SDXL: the extension applies the 17-value presets by block name (OUT09.. do not exist there)
SDXL_FORMS = {
    "OUTALL": "BASE=1, OUT0[3-8]=1, default=0",
    "INALL": SD15_FORMS["INALL"],
    "MIDD": SD15_FORMS["MIDD"],
    "ALL": "BASE=1, IN01=1, IN02=1, IN04=1, IN05=1, IN07=1, IN08=1, M00=1, OUT0[3-8]=1, default=0",
    "1,0,0,0,0,1,1,1,1,1,1,1": "BASE=1, M00=1, OUT0[0-5]=1, default=0",  # 12 values
    ",".join(["0.5"] * 20): "default=0.5",
}
TEXT_KEYS = ("clip_l.transformer.text_model.encoder.layers.0.mlp.fc1.weight",
             "clip_g.transformer.text_model.encoder.layers.0.mlp.fc1.weight")
SDXL_KEYS = (*(f"diffusion_model.input_blocks.{i}.1.proj_in.weight" for i in range(9)),
             "diffusion_model.middle_block.1.proj_in.weight",
             *(f"diffusion_model.output_blocks.{i}.1.proj_in.weight" for i in range(9)),
             "diffusion_model.time_embed.0.weight", "diffusion_model.label_emb.0.0.weight",
             "diffusion_model.out.2.weight", *TEXT_KEYS)
FLUX_KEYS = (*(f"diffusion_model.{m}.weight" for m in ("img_in", "txt_in", "time_in.in_layer",
                                                          "vector_in.in_layer", "guidance_in.in_layer",
                                                          "final_layer.linear")),
             *(f"diffusion_model.double_blocks.{i}.img_attn.qkv.weight" for i in range(19)),
             *(f"diffusion_model.single_blocks.{i}.linear1.weight" for i in range(38)), TEXT_KEYS[0])
T5_KEY = "t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.q.weight"


@pytest.fixture(scope="module")
def rig(comfy):
    return Rig(comfy)


@pytest.fixture(scope="module")
def blocks(comfy):
    return importlib.import_module(comfy.pack.__name__ + ".nodes.hook_blocks")


def same_hooks(actual, expected):
    """Hook by hook: name, strengths, schedule and every tensor equal."""
    assert len(actual.hooks) == len(expected.hooks)
    for a, b in zip(actual.hooks, expected.hooks, strict=True):
        assert (a.hook_id, a._strength_model, a._strength_clip) == \
            (b.hook_id, b._strength_model, b._strength_clip)
        assert [(k.strength, k.start_percent) for k in a.hook_keyframe.keyframes] == \
            [(k.strength, k.start_percent) for k in b.hook_keyframe.keyframes]
        assert a.weights.keys() == b.weights.keys()
        assert all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights), f"{a.hook_id}: tensors differ"


# --- LORA_STACK ------------------------------------------------------------------------------------

def test_stack_from_efficiency_and_comfyroll_equals_core_chain(rig):
    # Efficiency Nodes' LoRA Stacker (simple mode): (name, wt, wt), "None" slots left out
    efficiency = [(name, wt, wt) for name, wt in ((LORA, 0.8), ("None", 1.0)) if name != "None"]
    # Comfyroll's CR LoRA Stack fed that stack: incoming entries first, then its own (name, model, clip)
    stack = [entry for entry in efficiency if entry[0] != "None"] + [(LOCON, 1.0, 0.5)]
    (ours,) = rig.node("PatchbayLoraStackHooks").create(stack, f"1: 0@0, 1@0.5\n{LOCON}: 1@0, 0.5@0.5",
                                                        "percent")
    a = rig.core_hook(LORA, 0.8, rig.core_keyframes([(0.0, 0.0), (1.0, 0.5)]))
    (b,) = rig.node("CreateHookLora").create_hook(LOCON, 1.0, 0.5)
    (b,) = rig.node("SetHookKeyframes").set_hook_keyframes(b, rig.core_keyframes([(1.0, 0.0), (0.5, 0.5)]))
    (core,) = rig.node("CombineHooks2").combine_hooks(a, b)
    assert [h._strength_clip for h in ours.hooks] == [0.8, 0.5]
    assert_same_as_core(rig, ours, core, "LORA_STACK as hooks", neg_too=True)
    (ours_clip,) = rig.node("SetClipHooks").apply_hooks(rig.clip, False, True, ours)
    (core_clip,) = rig.node("SetClipHooks").apply_hooks(rig.clip, False, True, core)
    encoded = rig.encode_with(ours_clip, "a knight")[0][0]
    assert torch.equal(encoded, rig.encode_with(core_clip, "a knight")[0][0]), "the CLIP strengths differ"


def test_stack_from_lora_manager_paths(rig):
    # LoRA Manager's Lora Stacker: the OS separator, or an absolute path outside the roots it knows
    stack = [("D:\\ComfyUI\\models\\loras\\" + LOCON, 0.6, 0.6),
             (LORA.removesuffix(".safetensors"), 1.0, 0.0)]
    (ours,) = rig.node("PatchbayLoraStackHooks").create(stack, "", "percent")
    (a,) = rig.node("PatchbayHookLora").create(LOCON, 0.6, 0.6)
    (b,) = rig.node("PatchbayHookLora").create(LORA, 1.0, 0.0, prev_hooks=a)
    same_hooks(ours, b)


def test_lora_hook_stack_takes_a_stack_after_its_slots(rig):
    slots = {f"lora_{i}": "None" for i in range(2, 5)} | {"lora_1": LORA, "strength_1": 0.5,
                                                          "schedule_1": "0@0, 1@1"}
    (ours,) = rig.node("PatchbayHookLoraStack").create("percent", lora_stack=[(LOCON, 0.7, 0.2)], **slots)
    (expected,) = rig.node("PatchbayHookLoraStack").create("percent", **slots)
    (expected,) = rig.node("PatchbayHookLora").create(LOCON, 0.7, 0.2, prev_hooks=expected)
    same_hooks(ours, expected)


@pytest.mark.parametrize(("stack", "schedules", "needle"), [
    ([(LORA, 1.0, 1.0), ("patchbay-lora-r5.safetensors", 1.0, 1.0)], "",
     "LORA_STACK entry 2 ('patchbay-lora-r5.safetensors'): no lora named 'patchbay-lora-r5.safetensors'; "
     "did you mean 'patchbay-lora-r4.safetensors'"),
    ([(LORA, 1.0, 1.0)], "1: 0@0, x@1", f"LORA_STACK entry 1 ('{LORA}'): "),
    ([(LORA, 1.0)], "", "LORA_STACK entry 1"),
    ([(LORA, 1.0, 1.0)], "2: 1@0", "no LoRA at position 2"),
])
def test_stack_errors_name_the_entry(rig, stack, schedules, needle):
    with pytest.raises(ValueError) as info:
        rig.node("PatchbayLoraStackHooks").create(stack, schedules, "percent")
    assert needle in str(info.value)
    assert "column 6" in rig.n["PatchbayLoraStackHooks"].VALIDATE_INPUTS("1: 0@0, x@1", "percent")


# --- A1111 block weights -----------------------------------------------------------------------------

def lora_keys(rig):
    import comfy.lora

    key_map = comfy.lora.model_lora_keys_unet(rig.model.model, {})
    key_map = comfy.lora.model_lora_keys_clip(rig.clip.cond_stage_model, key_map)
    return sorted({v[0] if isinstance(v, tuple) else v for v in key_map.values()})


@pytest.mark.parametrize("preset", sorted(SD15_FORMS))
def test_each_preset_resolves_as_its_block_name_form(rig, blocks, preset):
    assert set(SD15_FORMS) == set(PRESET_BLOCKS) | {"ALL0.5"}
    keys = lora_keys(rig)
    ours, form = blocks.strength_map(preset, "sd15"), blocks.strength_map(SD15_FORMS[preset], "sd15")
    assert [ours(k) for k in keys] == [form(k) for k in keys]
    assert len({ours(k) for k in keys}) == (1 if preset == "NONE" else 2), "the preset must tell blocks apart"


@pytest.mark.parametrize("spec", sorted(SDXL_FORMS))
def test_sdxl_presets_and_lists_resolve_as_their_block_name_form(blocks, spec):
    ours, form = blocks.strength_map(spec, "sdxl"), blocks.strength_map(SDXL_FORMS[spec], "sdxl")
    assert [ours(k) for k in SDXL_KEYS] == [form(k) for k in SDXL_KEYS]


def test_flux_vector_resolves_as_its_block_name_form(blocks):
    values = [0.3, 0.7, 0.2, *[1.0] * 19, *[0.5] * 38, 0.0]  # CLIP, T5, IN, D00..D18, S00..S37, OUT
    ours = blocks.strength_map(",".join(map(str, values)), "flux")
    form = blocks.strength_map("BASE=0.3, img_in=.2, txt_in=.2, time_in=.2, vector_in=.2, guidance_in=.2, "
                               "double_blocks.*=1, single_blocks.*=0.5, final_layer=0", "flux")
    assert [ours(k) for k in FLUX_KEYS] == [form(k) for k in FLUX_KEYS]
    assert ours(T5_KEY) == 0.7, "T5 has a value of its own; CLIP-L takes BASE"
    every = blocks.strength_map("FLUXALL", "flux")
    assert {every(k) for k in (*FLUX_KEYS, T5_KEY)} == {1.0}


@pytest.mark.parametrize("preset", ["MIDD", "OUTALL"])
def test_preset_hooks_equal_block_name_hooks(rig, preset):
    weigh = rig.node("PatchbayHookBlockWeights").apply
    (hooks,) = rig.node("PatchbayHookLora").create(LOCON, 0.8, 0.8)
    same_hooks(weigh(hooks, rig.model, preset, "auto", rig.clip)[0],
               weigh(hooks, rig.model, SD15_FORMS[preset], "sd15", rig.clip)[0])


def test_prompt_lora_lbw_equals_the_block_weights_chain(rig):
    encode = rig.node("PatchbayPromptLora").encode
    cond, model, hooks = encode(rig.clip, f"a knight <lora:{LOCON}:0.8:lbw=OUTALL> in armor", rig.model)
    _, _, whole = encode(rig.clip, f"a knight <lora:{LOCON}:0.8> in armor", rig.model)
    (weighted,) = rig.node("PatchbayHookBlockWeights").apply(whole, rig.model, SD15_FORMS["OUTALL"], "sd15",
                                                            rig.clip)
    same_hooks(hooks, weighted)
    (core_clip,) = rig.node("SetClipHooks").apply_hooks(rig.clip, False, True, weighted)
    expected = rig.sample(rig.model, rig.encode_with(core_clip, "a knight in armor"))
    assert_close(rig.sample(model, cond), expected, "lbw=OUTALL on the fast engine")
    (whole_clip,) = rig.node("SetClipHooks").apply_hooks(rig.clip, False, True, whole)
    unweighted = rig.sample(rig.model, rig.encode_with(whole_clip, "a knight in armor"))
    assert (unweighted - expected).abs().max() > 1e-3 * expected.abs().max(), "OUTALL changed nothing"


@pytest.mark.parametrize(("text", "model", "needle"), [
    (f"<lora:{LORA}:lbw=OUTALL>", False, "LoRA tag at column 1: lbw=OUTALL needs the model input connected"),
    (f"x <lora:{LORA}:lbw=1,1,1,1,1,1,1,1,1,1,1,1>", True,
     "LoRA tag at column 3: block map '1,1,1,1,1,1,1,1,1,1,1,1' is not name=strength items"),
    (f"x <lora:{LORA}:lbw=1,1,1,1,1,1,1,1,1,1,1,1>", True, "does not fit sd15, which takes 17 or 26 values"),
])
def test_prompt_lora_lbw_errors(rig, text, model, needle):
    with pytest.raises(ValueError) as info:
        rig.node("PatchbayPromptLora").encode(rig.clip, text, rig.model if model else None)
    assert needle in str(info.value)
    assert "did you mean 'MIDD'" in rig.n["PatchbayPromptLora"].VALIDATE_INPUTS("<lora:x:1:lbw=MID>")
