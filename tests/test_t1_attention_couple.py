"""T1: the attention couple (hooks/couple.py, nodes/attention_couple.py) against its references.

Issue 34 item 2 on the UNets: one region over everything equals the plain prompt (and its LoRA the plain
LoRA hook / LoraLoader); two regions with one prompt equal the plain prompt; on one attention layer the
output outside a region's mask is bit-identical when that region's prompt or LoRA changes; a region LoRA
at strength 0 changes nothing; bad input is refused with the value and the fix. SD1.5: the tiny
checkpoint and its CLIP (devtools/hook_rig.py); SDXL: devtools/arch_sampling.py's tiny model and
synthesized conds. 2 steps, 8x8 latents.
"""

from __future__ import annotations

import importlib

import arch_sampling
import pytest
import torch
from hook_rig import Rig, assert_close

pytestmark = pytest.mark.t1

LORA = "patchbay-lora-r4.safetensors"
STEPS = 2
LAYER = "down_blocks_0_attentions_0_transformer_blocks_0_attn2"  # input_blocks[1][1]'s block 0, diffusers


class Couple(Rig):
    def __init__(self, comfy):
        super().__init__(comfy)
        self.lib = importlib.import_module(comfy.pack.__name__ + ".hooks.couple")
        self.empty = self.encode("")
        self.left = torch.zeros((1, 64, 64))
        self.left[:, :, :32] = 1.0
        self._plain2 = None

    def couple(self, regions, base=None, feather=0, model=None):
        return self.lib.attention_couple(model or self.model, self.empty if base is None else base,
                                         [self.lib.CoupleRegion(*r) for r in regions], feather)

    def run(self, regions, base=None, feather=0, steps=STEPS):
        model, pos = self.couple(regions, base, feather)
        return self.sample(model, pos, steps=steps)

    def sample_cfg1(self, model, pos):
        """cfg 1: core evaluates the positive alone, so a LoRA baked by LoraLoader acts on that row only."""
        sampler = self.n["KSampler"]()
        (out,) = sampler.sample(model, 7, STEPS, 1.0, "euler", "normal", pos, self.neg, self.latent)
        return out["samples"]

    def plain2(self):
        if self._plain2 is None:
            self._plain2 = self.sample(self.model, self.pos, steps=STEPS)
        return self._plain2


@pytest.fixture(scope="module")
def rig(comfy):
    return Couple(comfy)


def full():
    return torch.ones((1, 64, 64))


def test_one_region_over_everything_is_the_plain_prompt(rig):
    latent = rig.run([(rig.pos, full())], base=rig.right)
    assert_close(latent, rig.plain2(), "one region, base elsewhere (nowhere)")
    assert not torch.equal(rig.run([(rig.right, full())]), rig.plain2())  # the region's prompt is what counts


def test_one_region_with_its_lora_is_the_plain_lora_hook_and_loraloader(rig):
    hooks = rig.hook(LORA)
    couple = rig.run([(rig.pos, full(), hooks)])
    hooked = rig.sample(rig.fast(), rig.with_hooks(rig.pos, hooks), steps=STEPS)
    assert_close(couple, hooked, "one region with a LoRA vs the LoRA hook on the plain prompt")
    (loaded,) = rig.n["LoraLoaderModelOnly"]().load_lora_model_only(rig.model, LORA, 1.0)
    model, pos = rig.couple([(rig.pos, full(), hooks)])
    assert_close(rig.sample_cfg1(model, pos), rig.sample_cfg1(loaded, rig.pos),
                 "one region with a LoRA vs LoraLoader")
    assert not torch.equal(couple, rig.plain2())


def test_scheduled_region_lora_follows_its_keyframes_like_the_plain_hook(rig):
    scheduled = rig.hook(LORA, schedule=(0.0, 1.0))  # off on the first step, on at the second
    couple = rig.run([(rig.pos, full(), scheduled)])
    hooked = rig.sample(rig.fast(), rig.with_hooks(rig.pos, scheduled), steps=STEPS)
    assert_close(couple, hooked, "one region with a scheduled LoRA vs the scheduled LoRA hook")
    assert not torch.equal(couple, rig.run([(rig.pos, full(), rig.hook(LORA))]))


def test_node_one_region_with_lora_equals_loraloader_model_and_clip(rig):
    node = rig.n["PatchbayAttentionCouple"]()
    model, pos = node.couple(rig.model, rig.clip, "", 0, prompt_1="a knight in armor", mask_1=full(),
                             lora_1=LORA, strength_1=0.7)
    latent = rig.sample_cfg1(model, pos)
    loaded, clip = rig.n["LoraLoader"]().load_lora(rig.model, rig.clip, LORA, 0.7, 0.7)
    reference = rig.sample_cfg1(loaded, rig.n["CLIPTextEncode"]().encode(clip, "a knight in armor")[0])
    assert_close(latent, reference, "node: one region with a LoRA (model and CLIP) vs LoraLoader")
    _, scheduled = node.couple(rig.model, rig.clip, "", 0, prompt_1="a knight", mask_1=full(), lora_1=LORA,
                               schedule_1="0@0, 1@0.5")
    (hook,) = scheduled[0][1]["hooks"].hooks
    assert [(k.strength, k.start_percent) for k in hook.hook_keyframe.keyframes] == [(0.0, 0.0), (1.0, 0.5)]


def test_two_regions_with_one_prompt_are_the_plain_prompt(rig):
    latent = rig.run([(rig.pos, rig.left), (rig.pos, 1.0 - rig.left)], base=rig.right, feather=6)
    assert_close(latent, rig.plain2(), "two regions, the same prompt, feathered")
    two = rig.run([(rig.pos, rig.left), (rig.right, 1.0 - rig.left)])
    assert not torch.equal(two, rig.plain2())


def _stripes(count):
    """``count`` vertical stripes covering the 64x64 image."""
    stripes = torch.zeros((count, 1, 64, 64))
    for i in range(count):
        stripes[i, :, :, i * 64 // count:(i + 1) * 64 // count] = 1.0
    return stripes


def test_four_regions_run_in_one_model_call_with_the_negative(rig):
    """The couple's conditioning carries the base prompt's tokens, so core batches it with the negative
    (a [base | 4 regions] context is 5x the negative's: core's can_concat refuses over 4x); the full
    context is swapped in per block. Four same-prompt regions, each with its own LoRA hook, equal the
    LoRA hook on the plain prompt."""
    regions = [(rig.pos, stripe, rig.hook(LORA)) for stripe in _stripes(4)]
    model, pos = rig.couple(regions)
    assert pos[0][0].shape == rig.empty[0][0].shape
    rows = []
    unet = model.get_model_object("diffusion_model")
    handle = unet.register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[0]))
    try:
        latent = rig.sample(model, pos, steps=STEPS)
    finally:
        handle.remove()
    assert rows == [2] * STEPS  # one call per step: positive and negative rows together
    hooks = rig.hook(LORA)
    assert_close(latent, rig.sample(rig.fast(), rig.with_hooks(rig.pos, hooks), steps=STEPS),
                 "four same-prompt regions with a LoRA each vs the LoRA hook on the plain prompt")


def test_batch_of_two_latents_is_the_plain_prompt(rig):
    (latent,) = rig.n["EmptyLatentImage"]().generate(64, 64, 2)
    sampler = rig.n["KSampler"]()
    model, pos = rig.couple([(rig.pos, rig.left), (rig.pos, 1.0 - rig.left)], base=rig.right)
    (couple,) = sampler.sample(model, 7, STEPS, 7.0, "euler", "normal", pos, rig.neg, latent)
    (plain,) = sampler.sample(rig.model, 7, STEPS, 7.0, "euler", "normal", rig.pos, rig.neg, latent)
    assert_close(couple["samples"], plain["samples"], "two same-prompt regions, a batch of two latents")


def test_couple_model_leaves_a_prompt_that_is_not_the_couples_alone(rig):
    model, _ = rig.couple([(rig.right, rig.left), (rig.neg, 1.0 - rig.left)])
    assert_close(rig.sample(model, rig.pos, steps=STEPS), rig.plain2(), "the couple's model, a plain prompt")


def _layer_lora():
    """The LoRA's deltas on one attention layer only (to_q, to_k, to_v, to_out: down, up, alpha)."""
    one = {k: v for k, v in arch_sampling.lora_state_dict(LORA).items() if LAYER in k}
    assert len(one) == 12
    return one


def _first_attn2_output(rig, regions):
    """The first model call's output of input_blocks[1][1]'s first attn2 (after its LoRA deltas)."""
    model, pos = rig.couple(regions)
    block = model.get_model_object("diffusion_model").input_blocks[1][1].transformer_blocks[0]
    seen = []
    handle = block.attn2.to_out.register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    try:
        rig.sample(model, pos, steps=1)
    finally:
        handle.remove()
    return seen[0].view(seen[0].shape[0], 8, 8, -1)  # rows, h, w, channels (8x8 latent)


def test_one_layer_outside_a_region_does_not_see_its_prompt_or_lora(rig, comfy):
    import comfy.hooks

    one = _layer_lora()
    lora_a = comfy.hooks.create_hook_lora(one, 1.0, 1.0)
    lora_b = comfy.hooks.create_hook_lora({k: v * 3 if "up" in k else v for k, v in one.items()}, 1.0, 1.0)
    right = 1.0 - rig.left
    ref = _first_attn2_output(rig, [(rig.pos, rig.left), (rig.right, right, lora_a)])
    for what, region in (("prompt", (rig.neg, right, lora_a)), ("LoRA", (rig.right, right, lora_b)),
                         ("no LoRA", (rig.right, right))):
        out = _first_attn2_output(rig, [(rig.pos, rig.left), region])
        assert torch.equal(out[:, :, :4], ref[:, :, :4]), f"region 2's {what} changed the output outside it"
        assert not torch.equal(out[:, :, 4:], ref[:, :, 4:]), f"region 2's {what} changed nothing inside it"


def test_region_lora_at_strength_zero_changes_nothing(rig, comfy):
    import comfy.hooks

    zero = comfy.hooks.create_hook_lora(arch_sampling.lora_state_dict(LORA), 0.0, 0.0)
    regions = [(rig.pos, rig.left), (rig.right, 1.0 - rig.left)]
    without = rig.run(regions, base=rig.neg)
    with_zero = rig.run([regions[0], (*regions[1], zero)], base=rig.neg)
    assert torch.equal(with_zero, without)
    one = comfy.hooks.create_hook_lora(arch_sampling.lora_state_dict(LORA), 1.0, 1.0)
    assert not torch.equal(rig.run([regions[0], (*regions[1], one)], base=rig.neg), without)


def test_weights_share_overlaps_and_leave_the_rest_to_the_base(rig):
    half = rig.left[0]
    weights = rig.lib.couple_weights([torch.ones((64, 64)), half])
    assert torch.equal(weights[0], torch.zeros((64, 64)))  # the masks cover everything: no base
    assert torch.equal(weights[1], 1.0 - 0.5 * half) and torch.equal(weights[2], 0.5 * half)  # overlap shared
    weights = rig.lib.couple_weights([half * 0.25], feather_px=0)
    assert torch.equal(weights[0], 1.0 - 0.25 * half) and torch.equal(weights[1], 0.25 * half)
    soft = rig.lib.couple_weights([half, 1.0 - half], feather_px=6)
    assert torch.allclose(soft.sum(0), torch.ones((64, 64))) and 0 < float(soft[1, 0, 30]) < 1


@pytest.mark.parametrize(("masks", "words"), [
    ([torch.ones((2, 64, 64))], ("region 1", "(2, 64, 64)", "one mask")),
    ([torch.ones((64, 64)), torch.zeros((64, 64))], ("region 2", "empty", "draw the region")),
    ([torch.ones((64, 64))] * 9, ("9 regions", "at most 8")),
    ([torch.ones((64, 64)), torch.ones((32, 32))], ("differ in size", "(32, 32)", "one size")),
    ([], ("no region",)),
])
def test_bad_masks_are_refused_with_the_value_and_the_fix(rig, masks, words):
    with pytest.raises(rig.lib.CoupleError) as error:
        rig.couple([(rig.pos, m) for m in masks])
    assert all(w in str(error.value) for w in words), str(error.value)


def test_mask_of_another_aspect_than_the_latent_is_refused_when_sampling(rig):
    with pytest.raises(rig.lib.CoupleError, match=r"64x32 \(HxW\) but the latent is 8x8.*image's size"):
        rig.run([(rig.pos, torch.ones((64, 32)))], steps=1)


def test_inputs_are_not_changed(rig):
    options = repr(rig.model.model_options)
    cond = rig.pos[0][0].clone()
    mask = rig.left.clone()
    rig.couple([(rig.pos, rig.left, rig.hook(LORA))], base=rig.right)
    assert repr(rig.model.model_options) == options
    assert torch.equal(rig.pos[0][0], cond) and torch.equal(rig.left, mask) and "hooks" not in rig.pos[0][1]


# ---- SDXL (synthesized conds) ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sdxl(comfy):
    model = arch_sampling.shared_model("sdxl")
    return model, arch_sampling.make_cond("sdxl", 1), arch_sampling.make_cond("sdxl", 2)


def _sdxl(model, pos, neg):
    return arch_sampling.sample(model, pos, neg, seed=0, steps=STEPS, latent_size=8)


def test_sdxl_one_region_and_two_regions_are_the_plain_prompt(rig, sdxl):
    model, pos, neg = sdxl
    plain = _sdxl(model, pos, neg)
    other = arch_sampling.make_cond("sdxl", 3)
    for what, regions in (("one region", [(pos, full())]),
                          ("two regions", [(pos, rig.left), (pos, 1.0 - rig.left)])):
        couple_model, couple_pos = rig.lib.attention_couple(model, other, [rig.lib.CoupleRegion(*r)
                                                                           for r in regions], 4)
        assert_close(_sdxl(couple_model, couple_pos, neg), plain, f"SDXL {what}")


def test_sdxl_one_region_with_its_lora_is_the_plain_lora_hook(rig, sdxl):
    model, pos, neg = sdxl
    hooks = arch_sampling.hook_lora(arch_sampling.SDXL_LORAS[0])
    region = rig.lib.CoupleRegion(pos, full(), hooks)
    couple_model, couple_pos = rig.lib.attention_couple(model, neg, [region])
    latent = _sdxl(couple_model, couple_pos, neg)
    hooked = rig.fast(model)
    reference = _sdxl(hooked, arch_sampling.make_cond("sdxl", 1, hooks=hooks), neg)
    assert_close(latent, reference, "SDXL one region with a LoRA vs the LoRA hook")
    assert not torch.equal(latent, _sdxl(model, pos, neg))


# ---- the packed context (issue 34 item 3): each prompt's keys and values projected once -------------


def test_negative_is_not_tiled_and_keeps_its_own_lora(rig):
    """to_k/to_v project the couple's prompts once and the negative's own 77 tokens (not tiled to the
    couple's length), as rows of 77 tokens; a LoRA hook on the negative acts on its rows only. A batch of
    two latents; two same-prompt regions with a LoRA each (on to_k/to_v too) equal the plain prompt with
    that LoRA hook, the negative with another hook, on Fast Hooks."""
    (latent,) = rig.n["EmptyLatentImage"]().generate(64, 64, 2)
    neg = rig.with_hooks(rig.neg, rig.hook(LORA, 0.5))
    model, pos = rig.couple([(rig.pos, rig.left, rig.hook(LORA)), (rig.pos, 1.0 - rig.left, rig.hook(LORA))],
                            base=rig.right)
    to_k = model.get_model_object("diffusion_model").input_blocks[1][1].transformer_blocks[0].attn2.to_k
    shapes = []
    handle = to_k.register_forward_pre_hook(lambda m, args: shapes.append(tuple(args[0].shape)))
    sampler = rig.n["KSampler"]()
    try:
        (couple,) = sampler.sample(model, 7, STEPS, 7.0, "euler", "normal", pos, neg, latent)
    finally:
        handle.remove()
    positive = rig.with_hooks(rig.pos, rig.hook(LORA))
    (plain,) = sampler.sample(rig.fast(), 7, STEPS, 7.0, "euler", "normal", positive, neg, latent)
    assert_close(couple["samples"], plain["samples"], "packed context, a hooked negative, two latents")
    width = rig.pos[0][0].shape[-1]
    assert shapes == [(6, 77, width)] * STEPS  # one call: 2 latents x (2 region prompts + the negative)


def test_packed_and_tiled_contexts_attend_alike(rig):
    """One attention block by hand: the packed context (each row's tokens once) and the tiled one (what a
    model compiled by TorchCompileModel gets: the negative repeated to the couple's length) give the same
    output, and the negative's row is plain attention over its own tokens."""
    from comfy.ldm.modules import attention

    torch.manual_seed(0)
    base, region_a, region_b, neg = (torch.randn(1, 77, 16) for _ in range(4))
    weights = rig.lib.CoupleWeights(rig.lib.couple_weights([rig.left[0] * 0.5, 1.0 - rig.left[0]]))
    segments, full = rig.lib._layout([base, region_a, region_b], drop_base=False)
    project = torch.nn.Linear(16, 32, bias=False)
    q = torch.randn(2, 64, 32)  # rows: the couple's, the negative's; 8x8 latent
    compiled = type("Run", (), {"compiled": object()})()
    outs = []
    for run in (None, compiled):
        patch = rig.lib.CoupleContext(base, full, segments)
        options = {"cond_or_uncond": [0, 1], "n_heads": 2, "original_shape": [2, 4, 8, 8],
                   "patchbay.hooks.run": run}
        both = torch.cat([base, neg])
        _, context, value = patch(q, both, both, options)
        assert value is context
        assert context.shape == ((4, 77, 16) if run is None else (2, 231, 16))
        k = project(context)
        outs.append(rig.lib.CoupleAttention(weights, segments)(q, k, k, options))
    assert_close(outs[0], outs[1], "packed vs tiled context")
    own = project(neg)
    assert torch.equal(outs[0][1:], attention.optimized_attention(q[1:], own, own, 2))
