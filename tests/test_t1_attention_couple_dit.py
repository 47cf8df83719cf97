"""T1: the attention couple on DiT joint attention (hooks/couple_dit.py) against its references.

Issue 34 item 2 on the tiny Flux.1 (devtools/tiny_arch.py's file, its kohya LoRA), the tiny SD3.5 and, on
ComfyUI 0.33, the tiny Flux.2 (devtools/tiny_dits.py, in memory): one region over everything equals the
plain prompt (and its LoRA the plain LoRA hook / LoraLoader); two regions with one prompt equal the plain
prompt; on one block the image tokens outside a region's mask are bit-identical when that region's prompt
or LoRA changes; a region LoRA at strength 0 changes nothing; bad input is refused with the value and the
fix. Conditioning is synthesized (devtools/arch_sampling.py). 2 steps, 8x8 latents (Flux.1, SD3.5: a 4x4
patch grid; Flux.2: 8x8).
"""

from __future__ import annotations

import importlib

import arch_sampling
import pytest
import tiny_dits
import torch
from hook_rig import assert_close

pytestmark = pytest.mark.t1

STEPS = 2
LORA = arch_sampling.FLUX_LORAS[0]  # kohya names: double_blocks_0_{img,txt}_attn_{qkv,proj}, single linear1/2
DITS = [name for name in ("sd35", "flux2") if name in tiny_dits.families()]


@pytest.fixture(scope="module")
def lib(comfy):
    return importlib.import_module(comfy.pack.__name__ + ".hooks.couple")


@pytest.fixture(scope="module")
def flux(comfy):
    return arch_sampling.shared_model("flux")


def full():
    return torch.ones((1, 64, 64))


def left():
    mask = torch.zeros((1, 64, 64))
    mask[:, :, :32] = 1.0
    return mask


def cond(seed, pooled_seed=None, arch="flux"):
    """A synthesized prompt; ``pooled_seed``: another prompt's pooled vector (one block's image tokens
    see the pooled vector through the modulation, so a changed prompt keeps it to show the mask)."""
    out = arch_sampling.make_cond(arch, seed)
    if pooled_seed is not None:
        out[0][1]["pooled_output"] = arch_sampling.make_cond(arch, pooled_seed)[0][1]["pooled_output"]
    return out


def couple(lib, model, regions, base=None, feather=0, arch="flux"):
    base = cond(9, arch=arch) if base is None else base
    return lib.attention_couple(model, base, [lib.CoupleRegion(*r) for r in regions], feather)


def sample(model, pos, neg=None, cfg=2.0, steps=STEPS, latent_shape=None):
    neg = cond(2) if neg is None else neg
    return arch_sampling.sample(model, pos, neg, seed=0, steps=steps, cfg=cfg, latent_size=8,
                                latent_shape=latent_shape)


@pytest.fixture(scope="module")
def plain(flux):
    return sample(flux, cond(1))


def test_flux_one_region_over_everything_is_the_plain_prompt(lib, flux, plain):
    latent = sample(*couple(lib, flux, [(cond(1), full())]))
    assert_close(latent, plain, "Flux: one region, base elsewhere (nowhere)")
    assert not torch.equal(sample(*couple(lib, flux, [(cond(3), full())])), plain)


def test_flux_one_region_with_its_lora_is_the_plain_lora_hook_and_loraloader(lib, flux, plain, comfy):
    enable = importlib.import_module(comfy.pack.__name__ + ".hooks.enable").enable_hook_engine
    hooks = arch_sampling.hook_lora(LORA)
    latent = sample(*couple(lib, flux, [(cond(1), full(), hooks)]))
    hooked = sample(enable(flux), arch_sampling.make_cond("flux", 1, hooks=hooks))
    assert_close(latent, hooked, "Flux: one region with a LoRA vs the LoRA hook on the plain prompt")
    assert not torch.equal(latent, plain)
    model, pos = couple(lib, flux, [(cond(1), full(), hooks)])
    loaded = arch_sampling.load_lora(flux, LORA)
    assert_close(sample(model, pos, cfg=1.0), sample(loaded, cond(1), cfg=1.0),
                 "Flux: one region with a LoRA vs LoraLoader (cfg 1: the positive alone)")


def test_flux_two_regions_with_one_prompt_are_the_plain_prompt(lib, flux, plain):
    latent = sample(*couple(lib, flux, [(cond(1), left()), (cond(1), 1.0 - left())], feather=12))
    assert_close(latent, plain, "Flux: two regions, the same prompt, feathered")
    two = sample(*couple(lib, flux, [(cond(1), left()), (cond(3), 1.0 - left())]))
    assert not torch.equal(two, plain)


def _block_lora():
    """The LoRA on the first double block's text path and its image attention's output projection: every
    delta there acts per token (the image q/k/v deltas inside a region reach every image token through
    image-to-image attention, as a UNet's self-attention does)."""
    keys = ("double_blocks_0_txt_attn_qkv", "double_blocks_0_txt_attn_proj", "double_blocks_0_img_attn_proj")
    one = {k: v for k, v in arch_sampling.lora_state_dict(LORA).items() if any(m in k for m in keys)}
    assert len(one) == 9
    return one


def _first_block_image(lib, flux, regions):
    """The first model call's image tokens out of double block 0, as [rows, 4, 4, channels]."""
    model, pos = couple(lib, flux, regions)
    block = model.get_model_object("diffusion_model").double_blocks[0]
    seen = []
    handle = block.register_forward_hook(lambda m, a, out: seen.append(out[0].detach().clone()))
    try:
        sample(model, pos, steps=1)
    finally:
        handle.remove()
    return seen[0].view(seen[0].shape[0], 4, 4, -1)


def test_flux_one_block_outside_a_region_does_not_see_its_prompt_or_lora(lib, flux, comfy):
    import comfy.hooks

    one = _block_lora()
    lora_a = comfy.hooks.create_hook_lora(one, 1.0, 1.0)
    lora_b = comfy.hooks.create_hook_lora({k: v * 3 if "up" in k else v for k, v in one.items()}, 1.0, 1.0)
    right = 1.0 - left()
    regions = [(cond(1), left()), (cond(3), right, lora_a)]
    ref = _first_block_image(lib, flux, regions)
    changed = (("prompt", (cond(4, pooled_seed=3), right, lora_a)), ("LoRA", (cond(3), right, lora_b)),
               ("no LoRA", (cond(3), right)))
    for what, region in changed:
        out = _first_block_image(lib, flux, [regions[0], region])
        assert torch.equal(out[:, :, :2], ref[:, :, :2]), f"region 2's {what} changed the image outside it"
        assert not torch.equal(out[:, :, 2:], ref[:, :, 2:]), f"region 2's {what} changed nothing inside it"


def test_flux_region_lora_at_strength_zero_changes_nothing(lib, flux, comfy):
    import comfy.hooks

    regions = [(cond(1), left()), (cond(3), 1.0 - left())]
    without = sample(*couple(lib, flux, regions))
    zero = comfy.hooks.create_hook_lora(arch_sampling.lora_state_dict(LORA), 0.0, 0.0)
    assert torch.equal(sample(*couple(lib, flux, [regions[0], (*regions[1], zero)])), without)
    one = arch_sampling.hook_lora(LORA)
    assert not torch.equal(sample(*couple(lib, flux, [regions[0], (*regions[1], one)])), without)


@pytest.mark.parametrize("name", DITS)
def test_dit_one_region_two_regions_and_its_lora(lib, name, comfy):
    """SD3.5 (and Flux.2 on 0.33, whose RoPE counts text positions: each prompt's restart at 0)."""
    enable = importlib.import_module(comfy.pack.__name__ + ".hooks.enable").enable_hook_engine
    family = tiny_dits.FAMILIES[name]
    model = tiny_dits.load(family)
    hooks = arch_sampling.hook_lora(tiny_dits.lora(family, model))
    side = 8 * family.latent[-1]
    whole, half = torch.ones((side, side)), torch.zeros((side, side))
    half[:, : side // 2] = 1.0
    pos, neg, other = (arch_sampling.make_cond(name, seed) for seed in (1, 2, 3))

    def run(model, pos):
        return sample(model, pos, neg, latent_shape=family.latent)

    plain = run(model, pos)
    for what, regions in (("one region", [(pos, whole)]),
                          ("two regions", [(pos, half), (pos, 1.0 - half)])):
        assert_close(run(*couple(lib, model, regions, other, feather=8, arch=name)), plain, f"{name} {what}")
    latent = run(*couple(lib, model, [(pos, whole, hooks)], other, arch=name))
    assert_close(latent, run(enable(model), arch_sampling.make_cond(name, 1, hooks=hooks)),
                 f"{name}: one region with a LoRA vs the LoRA hook")
    assert not torch.equal(latent, plain)
    assert not torch.equal(run(*couple(lib, model, [(pos, half), (other, 1.0 - half)], arch=name)), plain)


def test_sd35_couple_rows_batched_with_a_negative_of_the_same_length(lib, comfy):
    """A negative as long as the couple's context is batched with it in one model call: the couple's
    rows are masked, the negative's attended as usual (SD3.5: the cheapest model)."""
    enable = importlib.import_module(comfy.pack.__name__ + ".hooks.enable").enable_hook_engine
    family = tiny_dits.FAMILIES["sd35"]
    model = tiny_dits.load(family)
    hooks = arch_sampling.hook_lora(tiny_dits.lora(family, model))
    pos, other = arch_sampling.make_cond("sd35", 1), arch_sampling.make_cond("sd35", 3)
    neg = [[torch.cat([pos[0][0], other[0][0]], 1), dict(other[0][1])]]  # 16 tokens, as the couple's

    def run(model, pos):
        return sample(model, pos, neg, latent_shape=family.latent)

    calls = []

    def record(executor, *args, **kwargs):
        calls.append(list(args[5]["cond_or_uncond"]))
        return executor(*args, **kwargs)

    couple_model, couple_pos = couple(lib, model, [(pos, torch.ones((64, 64)), hooks)], other, arch="sd35")
    couple_model.add_wrapper_with_key("apply_model", "test.rows", record)
    latent = run(couple_model, couple_pos)
    assert [0, 1] in calls or [1, 0] in calls, f"the rows were not batched: {calls}"
    assert_close(latent, run(enable(model), arch_sampling.make_cond("sd35", 1, hooks=hooks)),
                 "sd35: one region with a LoRA batched with the negative vs the LoRA hook")


def test_flux_mask_of_another_aspect_than_the_latent_is_refused_when_sampling(lib, flux):
    with pytest.raises(lib.CoupleError, match=r"64x32 \(HxW\) but the latent is 8x8.*image's size"):
        sample(*couple(lib, flux, [(cond(1), torch.ones((64, 32)))]), steps=1)


def test_flux_reference_latents_are_refused_when_sampling(lib, flux):
    model, pos = couple(lib, flux, [(cond(1), full())])
    pos = [[pos[0][0], {**pos[0][1], "reference_latents": [torch.zeros((1, 16, 8, 8))]}]]  # ReferenceLatent
    with pytest.raises(lib.CoupleError, match=r"reference latents \(Flux Kontext.*Regional LoRA"):
        sample(model, pos, steps=1)


def test_sd35_scheduled_region_lora_follows_its_keyframes_like_the_plain_hook(lib, comfy):
    enable = importlib.import_module(comfy.pack.__name__ + ".hooks.enable").enable_hook_engine
    import comfy.hooks

    family = tiny_dits.FAMILIES["sd35"]
    model = tiny_dits.load(family)
    lora = tiny_dits.lora(family, model)
    scheduled = arch_sampling.hook_lora(lora)
    keyframes = comfy.hooks.HookKeyframeGroup()
    for percent, strength in ((0.0, 0.0), (0.5, 1.0)):  # off on the first step, on at the second
        keyframes.add(comfy.hooks.HookKeyframe(strength=strength, start_percent=percent))
    scheduled.set_keyframes_on_hooks(keyframes)
    pos, neg, other = (arch_sampling.make_cond("sd35", seed) for seed in (1, 2, 3))

    def run(model, pos):
        return sample(model, pos, neg, latent_shape=family.latent)

    latent = run(*couple(lib, model, [(pos, full(), scheduled)], other, arch="sd35"))
    assert_close(latent, run(enable(model), arch_sampling.make_cond("sd35", 1, hooks=scheduled)),
                 "sd35: one region with a scheduled LoRA vs the scheduled LoRA hook")
    plain_lora = arch_sampling.hook_lora(lora)
    assert not torch.equal(latent, run(*couple(lib, model, [(pos, full(), plain_lora)], other, arch="sd35")))


def test_a_dit_the_couple_does_not_know_is_refused(lib, comfy):
    family = tiny_dits.FAMILIES["wan21"]
    with pytest.raises(lib.CoupleError, match=r"Flux.1/Flux.2/SD3.*WanModel.*Regional LoRA"):
        couple(lib, tiny_dits.load(family), [(arch_sampling.make_cond("wan21", 1), full())],
               arch_sampling.make_cond("wan21", 2))


def test_joint_mask_rows_and_columns(lib, comfy):
    dit = importlib.import_module(comfy.pack.__name__ + ".hooks.couple_dit")
    weights = lib.CoupleWeights(lib.couple_weights([left()[0] * 0.5]))
    segments = lib.Segments(((0, 2), (2, 5)), 5)
    mask = dit.joint_mask(weights, segments, 10, (2, 2), torch.device("cpu"), torch.float32)
    inf = float("-inf")
    assert mask.shape == (14, 14)
    assert torch.equal(mask[0, :10], torch.tensor([0, 0, inf, inf, inf, 0, 0, inf, inf, inf]))  # tiled copy
    assert torch.equal(mask[:10, 10:], torch.zeros((10, 4)))  # text sees every image token
    assert torch.equal(mask[10:, 10:], torch.zeros((4, 4)))
    half = torch.tensor(0.5).log()
    assert torch.allclose(mask[10, :5], torch.tensor([half, half, half, half, half]))  # left: base and region
    assert torch.equal(mask[11, :5], torch.tensor([0, 0, inf, inf, inf]))  # right: the base alone



def _sampled_with_calls(comfy, model, pos, neg, separate=False, **kwargs):
    """(latent, the cond_or_uncond of every model call); ``separate``: without the couple's PaddedText
    (hooks/couple_dit.py), so a negative of another text length runs in a model call of its own."""
    calls = []

    def record(executor, *args, **kw):
        calls.append(tuple(args[5]["cond_or_uncond"]))
        return executor(*args, **kw)

    if separate:
        registry = importlib.import_module(comfy.pack.__name__ + ".patcher.registry")
        assert registry.remove_wrapper(model, "calc_cond_batch", "patchbay.couple")
    model.add_wrapper_with_key("apply_model", "test.rows", record)
    return sample(model, pos, neg, **kwargs), calls


def _longer(cond, *others):
    """``cond`` with the tokens of ``others`` appended (a longer prompt, same pooled vector)."""
    return [[torch.cat([cond[0][0], *(o[0][0] for o in others)], 1), dict(cond[0][1])]]


@pytest.mark.parametrize("negative", ["shorter", "longer"])
def test_flux_couple_and_negative_of_another_length_share_one_model_call(lib, flux, comfy, negative):
    """The couple's [base | regions] text and the negative's own (shorter: padded with zero tokens that
    the negative's attention leaves out; longer: the couple's rows padded, masked out) in one model call
    per step, equal to the same sample with the negative in a call of its own (the pooled vector and the
    guidance batched too: any cond that did not would split the call)."""
    hooks = arch_sampling.hook_lora(LORA)
    if negative == "shorter":
        regions, neg = [(cond(3), left(), hooks), (cond(4), 1.0 - left())], cond(2)  # 3 prompts vs 1
    else:
        regions, neg = [(cond(3), left(), hooks)], _longer(cond(2), cond(5), cond(6))  # 2 vs 3
    one, calls = _sampled_with_calls(comfy, *couple(lib, flux, regions), neg)
    assert len(calls) == STEPS and all(sorted(c) == [0, 1] for c in calls), calls
    two, apart = _sampled_with_calls(comfy, *couple(lib, flux, regions), neg, separate=True)
    assert len(apart) == 2 * STEPS, apart
    assert_close(one, two, f"Flux: a {negative} negative in the couple's model call vs in its own")
    assert not torch.equal(one, _sampled_with_calls(comfy, *couple(lib, flux, regions), cond(7))[0])


@pytest.mark.parametrize("name", DITS)
def test_dit_couple_and_a_shorter_negative_share_one_model_call(lib, name, comfy):
    """SD3.5 (no text positions) and Flux.2 (text positions counted from the front; the negative padded
    at the end keeps its own): one model call per step, equal to the negative in a call of its own."""
    family = tiny_dits.FAMILIES[name]
    model = tiny_dits.load(family)
    hooks = arch_sampling.hook_lora(tiny_dits.lora(family, model))
    side = 8 * family.latent[-1]
    half = torch.zeros((side, side))
    half[:, : side // 2] = 1.0
    pos, neg, other = (arch_sampling.make_cond(name, seed) for seed in (1, 2, 3))
    regions = [(pos, half, hooks), (other, 1.0 - half)]
    one, calls = _sampled_with_calls(comfy, *couple(lib, model, regions, other, arch=name), neg,
                                     latent_shape=family.latent)
    assert len(calls) == STEPS and all(sorted(c) == [0, 1] for c in calls), calls
    two, apart = _sampled_with_calls(comfy, *couple(lib, model, regions, other, arch=name), neg,
                                     separate=True, latent_shape=family.latent)
    assert len(apart) == 2 * STEPS, apart
    assert_close(one, two, f"{name}: the negative in the couple's model call vs in its own")
