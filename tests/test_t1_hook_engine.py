"""T1: the hook engine runs ComfyUI's own hook objects and gives the same latents as core.

References: LoraLoader (a hook on every cond at strength s must equal LoraLoader at s) and core's
own hook path (regional, scheduled and positive-only hooks). Tolerance: 1e-4 x max |latent|, fp32.
"""

from __future__ import annotations

import logging

import pytest
import torch
from hook_rig import STEPS, Rig, assert_close

pytestmark = pytest.mark.t1

CKPT_B = "patchbay-sd15-tiny-b.safetensors"
LORA_R4 = "patchbay-lora-r4.safetensors"
FORMATS = ("lora-r4", "locon-r8", "loha-r4", "lokr-r4")


@pytest.fixture(scope="module")
def rig(comfy):
    return Rig(comfy)


@pytest.mark.parametrize("fmt", FORMATS)
def test_hook_on_every_cond_equals_loraloader(rig, fmt):
    lora = f"patchbay-{fmt}.safetensors"
    strength = 0.7
    hooks = rig.hook(lora, strength)
    baked, _ = rig.n["LoraLoader"]().load_lora(rig.model, rig.clip, lora, strength, 0.0)
    expected = rig.sample(baked, rig.pos)
    plain = rig.plain()
    assert (expected - plain).abs().max() > 1e-2 * plain.abs().max(), "the LoRA has no effect to compare"
    fast = rig.fast()
    actual = rig.sample(fast, rig.with_hooks(rig.pos, hooks), rig.with_hooks(rig.neg, hooks))
    assert_close(actual, expected, f"{fmt} hook vs LoraLoader")
    engine = rig.engine(fast)
    assert engine.parses == 1 and engine.plans_built == 1, "the engine did not run the hook"
    assert not fast.hook_patches, "the engine must not register core hook patches"


def test_positive_only_and_scheduled_hooks_equal_core(rig):
    for schedule in (None, (0.0, 0.5, 1.0, 0.25)):
        hooks = rig.hook("patchbay-lora-r4.safetensors", 1.0, schedule)
        pos = rig.with_hooks(rig.pos, hooks)
        expected = rig.sample(rig.model, pos)
        assert_close(rig.sample(rig.fast(), pos), expected, f"positive-only hook, schedule {schedule}")


def test_masked_regional_hooks_equal_core(rig):
    cond = rig.regions(rig.hook("patchbay-lora-r4.safetensors"),
                       rig.hook("patchbay-locon-r4.safetensors", 0.8))
    expected = rig.sample(rig.model, cond)
    assert_close(rig.sample(rig.fast(), cond), expected, "two masked regions with two LoRA hooks")


def test_model_as_lora_hook_equals_core(rig):
    other, _, _ = rig.n["CheckpointLoaderSimple"]().load_checkpoint(CKPT_B)
    (hooks,) = rig.n["CreateHookModelAsLoraModelOnly"]().create_hook_model_only(CKPT_B, 0.5)
    del other
    pos = rig.with_hooks(rig.pos, hooks)
    expected = rig.sample(rig.model, pos)
    fast = rig.fast()
    assert_close(rig.sample(fast, pos), expected, "model-as-LoRA hook")
    assert rig.engine(fast).cache.bytes > 0, "model-as-LoRA deltas are cached"


def test_dense_cache_stays_within_its_budget(rig):
    hooks = rig.hook("patchbay-loha-r8.safetensors", 1.0, (1.0, 0.5, 0.75, 0.25))
    pos = rig.with_hooks(rig.pos, hooks)
    expected = rig.sample(rig.model, pos)
    budget_mb = 1.0
    fast = rig.fast(cache_mb=budget_mb)
    assert_close(rig.sample(fast, pos), expected, "LoHa with a tiny cache")
    cache = rig.engine(fast).cache
    assert 0 < cache.bytes <= budget_mb * 2**20 and cache.misses > len(cache), "evictions happened"


def test_seed_rerun_reparses_and_repatches_nothing(rig):
    baked, _ = rig.n["LoraLoader"]().load_lora(rig.model, rig.clip, "patchbay-lora-r16.safetensors", 0.5, 0.0)
    fast = rig.fast(baked)
    pos = rig.with_hooks(rig.pos, rig.hook("patchbay-lora-r4.safetensors"))
    rig.sample(fast, pos, seed=1)
    engine, uuid_before = rig.engine(fast), fast.patches_uuid
    counts = (engine.parses, engine.plans_built)
    second = rig.sample(fast, pos, seed=2)
    assert (engine.parses, engine.plans_built) == counts, "a seed-only re-run re-parsed or re-planned"
    assert fast.patches_uuid == uuid_before, "hooks rerolled patches_uuid (ordinary patches re-applied)"
    assert fast.model.current_weight_patches_uuid == fast.patches_uuid, "ordinary patches not kept applied"
    assert_close(second, rig.sample(baked, pos, seed=2), "seed re-run vs core")


def test_unsupported_hook_falls_back_to_core_with_a_debug_line(rig, caplog):
    from comfy.hooks import WeightHook

    key = "diffusion_model.out.2.weight"
    shape = rig.model.model.state_dict()[key].shape
    delta = 0.05 * torch.randn(shape, generator=torch.Generator().manual_seed(0))
    nested = WeightHook()  # a patch in core's nested-list form: the engine leaves it to core
    nested.weights, nested.need_weight_init = {key: [(delta, lambda a, **kw: a)]}, False
    (hooks,) = rig.n["CreateHookLora"]().create_hook("patchbay-lora-r4.safetensors", 1.0, 1.0)
    group = hooks.clone()
    group.add(nested)
    pos = rig.with_hooks(rig.pos, group)
    expected = rig.sample(rig.model, pos)
    with caplog.at_level(logging.DEBUG, logger="patchbay.hooks"):
        actual = rig.sample(rig.fast(), pos)
    assert_close(actual, expected, "one engine hook plus one core fallback hook")
    lora_only = rig.sample(rig.model, rig.with_hooks(rig.pos, hooks))
    assert (actual - lora_only).abs().max() > 1e-3, "the fallback hook had no effect"
    assert any("nested patch list" in r.getMessage() for r in caplog.records), caplog.text


@pytest.mark.parametrize("failure", ["error", "interrupt"])
def test_weights_byte_identical_after_failed_runs(rig, weights_digest, failure):
    import comfy.model_management
    import comfy.sample

    fast = rig.fast()
    pos = rig.with_hooks(rig.pos, rig.hook("patchbay-loha-r4.safetensors"))
    comfy.model_management.unload_all_models()  # no other test's LoraLoader patches left on the weights
    before = weights_digest(fast)
    latent = rig.latent["samples"]
    noise = comfy.sample.prepare_noise(latent, 3)

    def callback(step, *args):
        if step == 1 and failure == "error":
            raise RuntimeError("boom")
        if step == 1:
            comfy.model_management.interrupt_current_processing(True)

    expected = RuntimeError if failure == "error" else comfy.model_management.InterruptProcessingException
    try:
        with pytest.raises(expected):
            comfy.sample.sample(fast, noise, STEPS, 7.0, "euler", "normal", pos, rig.neg, latent,
                                callback=callback, disable_pbar=True)
    finally:
        comfy.model_management.interrupt_current_processing(False)
    assert weights_digest(fast) == before
    cache = rig.engine(fast).cache
    assert 0 < cache.bytes <= cache.budget_bytes, "LoHa deltas are cached, within the budget"
    assert not fast.hook_patches and not fast.hook_backup
    for module in fast.model.modules():
        assert not module._forward_hooks, f"a forward hook was left on {type(module).__name__}"
    rig.sample(fast, pos)  # the model still samples
    assert weights_digest(fast) == before


def test_scheduled_clip_hooks_encode_once_per_range_and_are_cached(rig):
    n = rig.n
    clip_cache_of = rig.engine_module.clip_cache_of

    create = n["CreateHookLora"]()  # one node, as in a server: it keeps the file it loaded

    def clip_hooks(model_strength, clip_strength):
        (hooks,) = create.create_hook(LORA_R4, model_strength, clip_strength)
        # keyframes at 0, 0.5 and 1: two strength ranges, (0, 0.5) at 1 and (0.5, 1) at 0.25
        (kf,) = n["CreateHookKeyframesFromFloats"]().create_hook_keyframes([1.0, 0.25, 0.25], 0.0, 1.0)
        return n["SetHookKeyframes"]().set_hook_keyframes(hooks, kf)[0]

    def encode(clip, hooks):
        (hooked_clip,) = n["SetClipHooks"]().apply_hooks(clip, True, True, hooks)
        return n["CLIPTextEncode"]().encode(hooked_clip, "a knight in armor")[0], hooked_clip

    def same(a, b):
        return len(a) == len(b) and all(
            torch.equal(x[0], y[0]) and torch.equal(x[1]["pooled_output"], y[1]["pooled_output"])
            and x[1]["clip_start_percent"] == y[1]["clip_start_percent"] for x, y in zip(a, b, strict=True))

    expected, _ = encode(rig.clip, clip_hooks(1.0, 1.0))
    assert len(expected) == 2 and not torch.equal(expected[0][0], expected[1][0]), "two encoded ranges"
    _, fast_clip = n["PatchbayHookEngine"]().execute(rig.model, 2048.0, rig.clip)
    first, hooked = encode(fast_clip, clip_hooks(1.0, 1.0))
    cache = clip_cache_of(hooked)
    assert same(first, expected) and (cache.misses, cache.hits) == (2, 0), "once per strength range"
    again, _ = encode(fast_clip, clip_hooks(0.3, 1.0))  # only the model strength changed
    assert same(again, expected) and (cache.misses, cache.hits) == (2, 2), "the same prompt and CLIP hooks"
    other, _ = encode(fast_clip, clip_hooks(1.0, 0.5))
    assert cache.misses == 4 and not torch.equal(other[0][0], expected[0][0]), "a new CLIP strength encodes"
    assert fast_clip.patcher.patches_uuid == rig.clip.patcher.patches_uuid
