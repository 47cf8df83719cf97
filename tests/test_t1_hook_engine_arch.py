"""T1: the hook engine on the tiny SDXL- and Flux-architecture models (devtools/tiny_arch.py).

Conditioning is synthesized (devtools/arch_sampling.py). A hook on both conds equals LoraLoader, also
for Flux kohya, diffusers and BFL-layout LoRAs; a BFL-layout Flux control LoRA (one that widens
img_in) is refused with a clear error; masked regional and scheduled hooks equal core's hook path.
"""

from __future__ import annotations

import logging

import arch_sampling
import pytest
import torch

pytestmark = pytest.mark.t1

STEPS = {"sdxl": 3, "flux": 2}
EQUAL_TO_LORALOADER = [("sdxl", name) for name in arch_sampling.SDXL_LORAS] + [
    ("flux", name) for name in arch_sampling.FLUX_LORAS]
LORA = {"sdxl": arch_sampling.SDXL_LORAS[0], "flux": arch_sampling.FLUX_LORAS[0]}


@pytest.fixture(scope="module")
def engine(comfy):
    return comfy.pack.hooks.enable


def sample(arch, model, positive=None, negative=None, hooks=None):
    positive = positive or arch_sampling.make_cond(arch, 1, hooks=hooks)
    negative = negative or arch_sampling.make_cond(arch, 2, hooks=hooks)
    return arch_sampling.sample(model, positive, negative, seed=0, steps=STEPS[arch])


def assert_close(actual, expected, what):
    tolerance = 1e-4 * expected.abs().max().item()
    diff = (actual - expected).abs().max().item()
    assert diff <= tolerance, f"{what}: max |diff| {diff:.3g} > {tolerance:.3g}"


@pytest.mark.parametrize(("arch", "lora_name"), EQUAL_TO_LORALOADER)
def test_hook_on_every_cond_equals_loraloader(engine, arch, lora_name):
    model = arch_sampling.shared_model(arch)
    expected = sample(arch, arch_sampling.load_lora(model, lora_name, 0.8))
    assert (expected - sample(arch, model)).abs().max() > 1e-2 * expected.abs().max(), "no LoRA effect"
    actual = sample(arch, engine.enable_hook_engine(model), hooks=arch_sampling.hook_lora(lora_name, 0.8))
    assert_close(actual, expected, f"{arch} {lora_name} hook vs LoraLoader")
    assert not model.hook_patches and not model.patches


@pytest.mark.heavy
@pytest.mark.parametrize("arch", arch_sampling.ARCHES)
def test_regional_and_scheduled_hooks_equal_core(engine, arch):
    import comfy.hooks

    model = arch_sampling.shared_model(arch)
    side = 8 * arch_sampling.LATENT_SIZE[arch]
    left = torch.zeros((side, side))
    left[:, : side // 2] = 1.0
    keyframes = comfy.hooks.HookKeyframeGroup()
    for percent, strength in ((0.0, 1.0), (0.5, 0.3)):
        keyframes.add(comfy.hooks.HookKeyframe(strength=strength, start_percent=percent))
    scheduled = arch_sampling.hook_lora(LORA[arch], 1.0)
    scheduled.set_keyframes_on_hooks(keyframes)  # what SetHookKeyframes does
    plain_hook = arch_sampling.hook_lora(LORA[arch], 0.6)
    regions = (arch_sampling.make_cond(arch, 1, hooks=scheduled, mask=left)
               + arch_sampling.make_cond(arch, 3, hooks=plain_hook, mask=1 - left))
    negative = arch_sampling.make_cond(arch, 2)
    expected = sample(arch, arch_sampling.without_hook_cache(model), regions, negative)
    assert_close(sample(arch, engine.enable_hook_engine(model), regions, negative), expected,
                 f"{arch}: a scheduled and a plain LoRA hook on two masked regions")


def test_bfl_layout_flux_lora_that_keeps_img_in_runs_on_the_engine(engine, caplog):
    """ComfyUI's convert_lora adds an ``img_in.reshape_weight`` to every BFL-layout file; here it equals
    the weight's own shape [3072, 64], so nothing is widened: the whole file (LoRAs, bias diffs, set
    norm scales) runs on the engine, none of it on core's path, and equals LoraLoader."""
    model = arch_sampling.shared_model("flux")
    name = arch_sampling.FLUX_BFL_KEEP_LORA
    expected = sample("flux", arch_sampling.load_lora(model, name, 0.8))
    assert (expected - sample("flux", model)).abs().max() > 1e-2 * expected.abs().max(), "no LoRA effect"
    fast = engine.enable_hook_engine(model)
    plans = engine.hook_engine_of(fast).plans_built
    with caplog.at_level(logging.DEBUG, logger="patchbay.hooks"):
        actual = sample("flux", fast, hooks=arch_sampling.hook_lora(name, 0.8))
    assert_close(actual, expected, "BFL-layout LoRA hook vs LoraLoader")
    assert engine.hook_engine_of(fast).plans_built == plans + 1, "the engine did not plan the hook"
    assert "weight-swapping path" not in caplog.text, caplog.text


def test_bfl_layout_flux_control_lora_is_refused_with_a_fix(engine, weights_digest):
    """A BFL-layout control LoRA (canny/depth) widens the model's input from 64 to 128 channels
    (its ``img_in.reshape_weight`` is [3072, 128]). Core's hook path patches nothing from it, silently
    (test_t1_core_hooks_arch.py). No hook can widen the input of some prompts only, so the engine
    refuses the hook, before anything is patched, with an error naming both shapes and saying to use
    LoraLoader; the model is left as it was."""
    model = engine.enable_hook_engine(arch_sampling.shared_model("flux"))
    before = weights_digest(model)
    widening = arch_sampling.hook_lora(arch_sampling.FLUX_BFL_LORA, 0.8)
    expected = (r"widens diffusion_model\.img_in\.weight from \[3072, 64\] to \[3072, 128\]: .* "
                r"Load it with LoraLoader")
    with pytest.raises(ValueError, match=expected):
        sample("flux", model, hooks=widening)
    assert weights_digest(model) == before and not model.hook_patches and not model.patches
