"""T1: the Recipe Hook node (issue 16 item 4): a recipe minus its base as a core HOOKS value.

References: the Merge node's merged model (a recipe hook at strength 1 on the base samples the same
latent), the base model (strength 0), and core's model-as-LoRA hook with the same keyframes (for
weighted_sum(a, b, alpha) on base a the delta is alpha * (b - a), which CreateHookModelAsLoraModelOnly of
b at strength alpha adds). Each on Fast Hooks and on core's hook path; 1e-4 x max |latent|, fp32.
"""

from __future__ import annotations

import pytest
import torch
from hook_rig import Rig as EngineRig
from hook_rig import assert_close

pytestmark = pytest.mark.t1


CKPT_A, CKPT_B = "patchbay-sd15-tiny-a.safetensors", "patchbay-sd15-tiny-b.safetensors"
SDXL_UNET = "patchbay-sdxl-tiny.safetensors"
ALPHA = 0.3


class Rig(EngineRig):
    """The engine tests' rig (checkpoint a, prompts, 4-step euler) plus recipe nodes."""

    def __init__(self, comfy):
        super().__init__(comfy)
        self.fast_model = self.fast()

    def run(self, node_id, method, *args, **kwargs):
        with torch.inference_mode():  # as ComfyUI's executor runs nodes
            return getattr(self.n[node_id](), method)(*args, **kwargs)

    def ckpt(self, name):
        return self.run("PatchbayMergeCheckpoint", "make", ckpt_name=name)[0]

    def merge(self):
        """weighted_sum(a, b, ALPHA) and its base a, as recipes."""
        a, b = self.ckpt(CKPT_A), self.ckpt(CKPT_B)
        return self.run("PatchbayMethodWeightedSum", "build", a=a, b=b, alpha=ALPHA)[0], a

    def recipe_hook(self, recipe, base=None, strength=1.0, kf=None, cache_mb=0):
        return self.run("PatchbayRecipeHook", "create", recipe, strength, 0, cache_mb, base=base,
                        hook_kf=kf)[0]

    def both(self, hooks):
        return self.with_hooks(self.pos, hooks), self.with_hooks(self.neg, hooks)

    def on_both_paths(self, hooks):
        """(core's hook path, Fast Hooks) latents with ``hooks`` on the positive and negative conds."""
        return self.sample(self.model, *self.both(hooks)), self.sample(self.fast_model, *self.both(hooks))


@pytest.fixture(scope="module")
def rig(comfy):
    return Rig(comfy)


def test_recipe_hook_at_strength_1_samples_the_merged_model_and_at_0_the_base(rig):
    recipe, base = rig.merge()
    merged, _, _ = rig.run("PatchbayMerge", "merge", recipe, cache_mb=0)["result"]
    expected = rig.sample(merged, rig.pos)
    plain = rig.plain()
    assert (expected - plain).abs().max() > 0.05 * plain.abs().max(), "the merge matters"
    core_path, fast = rig.on_both_paths(rig.recipe_hook(recipe, base))
    assert_close(core_path, expected, "recipe hook at 1 on core's hook path vs Merge")
    assert_close(fast, expected, "recipe hook at 1 on Fast Hooks vs Merge")
    core_path, fast = rig.on_both_paths(rig.recipe_hook(recipe, base, strength=0.0))
    assert_close(core_path, plain, "recipe hook at 0 on core's hook path vs the base")
    assert_close(fast, plain, "recipe hook at 0 on Fast Hooks vs the base")


def test_a_keyframed_fade_in_equals_the_same_model_as_lora_hook_chain(rig):
    recipe, base = rig.merge()
    (kf,) = rig.n["PatchbayHookKeyframesFromText"]().execute("0@0, 0.5@0.4, 1@1", "percent")
    ours = rig.recipe_hook(recipe, base, kf=kf)
    (theirs,) = rig.n["CreateHookModelAsLoraModelOnly"]().create_hook_model_only(CKPT_B, ALPHA)
    (theirs,) = rig.n["SetHookKeyframes"]().set_hook_keyframes(theirs, kf)
    preview = rig.comfy.pack.hooks.preview
    sigmas = preview.sampling_sigmas(rig.model, 4, "normal")
    (trace,) = [t.strengths for t in preview.strength_trace(ours, rig.model, sigmas)]
    assert trace == (0.0, 0.0, 0.5, 1.0), "the strength changes over the steps"
    expected = rig.sample(rig.model, *rig.both(theirs))
    constant = rig.sample(rig.model, *rig.both(rig.recipe_hook(recipe, base)))
    assert (expected - constant).abs().max() > 1e-3 * expected.abs().max(), "the fade-in matters"
    core_path, fast = rig.on_both_paths(ours)
    assert_close(core_path, expected, "faded recipe hook on core's path vs model-as-LoRA")
    assert_close(fast, expected, "faded recipe hook on Fast Hooks vs model-as-LoRA")


def test_a_masked_recipe_hook_runs_on_fast_hooks_as_on_cores_path(rig):
    recipe, base = rig.merge()
    cond = rig.regions(rig.recipe_hook(recipe, base), None)
    expected = rig.sample(rig.model, cond)
    plain = rig.sample(rig.model, rig.regions(None, None))
    assert (expected - plain).abs().max() > 1e-3 * expected.abs().max(), "the hook matters"
    assert_close(rig.sample(rig.fast_model, cond), expected, "regional recipe hook on Fast Hooks")


def test_deltas_are_merged_when_sampling_needs_them_and_kept_in_the_merge_cache(rig):
    runtime = rig.comfy.pack.comfy_merge.runtime
    recipe, base = rig.merge()
    runtime.CACHE.clear()
    hooks = rig.recipe_hook(recipe, base, cache_mb=1024)
    assert runtime.CACHE.stats().entries == 0, "creating the hook merges nothing"
    first = rig.sample(rig.model, *rig.both(hooks))
    entries = runtime.CACHE.stats().entries
    assert entries > 0
    assert_close(rig.sample(rig.model, *rig.both(hooks)), first, "a second run from the cache")
    runtime.CACHE.clear()


def test_a_difference_recipe_needs_no_base(rig):
    a, b = rig.ckpt(CKPT_A), rig.ckpt(CKPT_B)
    (difference,) = rig.run("PatchbayMethodSubtract", "build", a=b, b=a)
    (theirs,) = rig.n["CreateHookModelAsLoraModelOnly"]().create_hook_model_only(CKPT_B, 0.5)
    expected = rig.sample(rig.model, *rig.both(theirs))
    assert_close(rig.sample(rig.fast_model, *rig.both(rig.recipe_hook(difference, strength=0.5))), expected,
                 "b - a at 0.5 on Fast Hooks vs model-as-LoRA b at 0.5")


def test_bad_recipes_are_refused_naming_the_fix(rig, weights_digest):
    recipe, base = rig.merge()
    with pytest.raises(ValueError, match=r"no base: .* connect base"):
        rig.recipe_hook(recipe)
    with pytest.raises(ValueError, match="already a difference"):
        rig.recipe_hook(rig.run("PatchbayMethodSubtract", "build", a=recipe, b=base)[0], base)
    (sdxl,) = rig.run("PatchbayMergeDiffusionModel", "make", unet_name=SDXL_UNET)
    with pytest.raises(ValueError, match="architecture") as info:
        rig.recipe_hook(recipe, sdxl)
    assert SDXL_UNET in str(info.value)
    (sdxl_delta,) = rig.run("PatchbayMethodSubtract", "build", a=sdxl, b=sdxl)
    wrong = rig.recipe_hook(sdxl_delta)
    digest = weights_digest(rig.model)
    for model in (rig.model, rig.fast_model):  # core's hook path, Fast Hooks
        with pytest.raises(ValueError, match=r"recipe hook .* do not fit .* another model architecture"):
            rig.sample(model, *rig.both(wrong))
    assert weights_digest(rig.model) == digest, "a refused hook leaves the model unpatched"


def test_on_a_text_encoder_the_recipe_hook_patches_nothing(rig):
    recipe, base = rig.merge()
    (clip,) = rig.n["SetClipHooks"]().apply_hooks(rig.clip, False, False, rig.recipe_hook(recipe, base))
    (cond,) = rig.n["CLIPTextEncode"]().encode(clip, "a knight in armor")
    assert torch.equal(cond[0][0], rig.pos[0][0]), "model only: the CLIP encodes as without the hook"
