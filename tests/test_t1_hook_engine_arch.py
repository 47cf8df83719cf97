"""T1: the hook engine on the tiny SDXL- and Flux-architecture models (devtools/tiny_arch.py).

Conditioning is synthesized (devtools/arch_sampling.py). A hook on both conds equals LoraLoader, also
for Flux kohya, diffusers and BFL-layout LoRAs; a BFL-layout Flux control LoRA (one that widens
img_in) is refused with a clear error; masked regional and scheduled hooks equal core's hook path; Hook
Block Weights on SDXL and Flux LoRAs equals the LoRA file without those blocks.
"""

from __future__ import annotations

import logging

import arch_sampling
import hook_rig
import pytest
import torch

pytestmark = pytest.mark.t1

STEPS = {"sdxl": 3, "flux": 2}
# heavy on the tiny Flux: LoraLoader's backups of the weights it patches beside the model, 4.67 GB (what ran
# beside another lane's heavy test at the suite's 9.8 GB peak, memwatch's summary)
EQUAL_TO_LORALOADER = [("sdxl", name) for name in arch_sampling.SDXL_LORAS] + [
    pytest.param("flux", name, marks=pytest.mark.heavy) for name in arch_sampling.FLUX_LORAS]
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


# --- Hook Block Weights on SDXL and Flux LoRAs (the node; its SD1.5 cases: test_t1_hook_nodes.py) ---------
# arch "auto" throughout: ComfyUI detects the tiny SDXL as KOALA_700M, a pruned SDXL (a subclass of SDXL).
# (LoRA, block map entry that zeroes a group of blocks, key prefixes of that group in the file)
ARCH_BLOCK_CASES = [
    ("sdxl", "patchbay-sdxl-locon-r8.safetensors", "OUT*=0", ("lora_unet_output_blocks_",)),
    ("flux", "patchbay-flux-kohya-r8.safetensors", "single_blocks.*=0", ("lora_unet_single_blocks_",)),
    ("flux", "patchbay-flux-diffusers-r8.safetensors", "single_blocks.*=0",
     ("transformer.single_transformer_blocks.",)),
    # BFL layout (img_in keeps its shape): the detection keys (img_in, single_blocks.0 norms) stay
    ("flux", "patchbay-flux-bfl-keep-r8.safetensors", "double_blocks.*=0", ("double_blocks.",)),
]


@pytest.mark.once
@pytest.mark.parametrize(("arch", "lora", "zeroed", "prefixes"), ARCH_BLOCK_CASES,
                         ids=[case[1].removesuffix(".safetensors") for case in ARCH_BLOCK_CASES])
def test_block_weights_on_sdxl_and_flux_loras_equal_the_file_without_those_blocks(
        comfy, engine, arch, lora, zeroed, prefixes):
    """Run once: which keys a block map zeroes is the pack's (hooks/block_weights.py); both sides load the
    LoRA through the same ComfyUI, and its key mapping per version is test_t1_hook_engine_families'."""
    import comfy.sd as core_sd  # as core_sd: ``comfy`` is the fixture here

    weigh = comfy.nodes.NODE_CLASS_MAPPINGS["PatchbayHookBlockWeights"]().execute
    model = arch_sampling.shared_model(arch)
    fast = engine.enable_hook_engine(model)
    steps = {"sdxl": 3, "flux": 2}[arch]

    def run(m, hooks=None):
        return arch_sampling.sample(m, arch_sampling.make_cond(arch, 1, hooks=hooks),
                                    arch_sampling.make_cond(arch, 2, hooks=hooks), seed=0, steps=steps)

    full = arch_sampling.lora_state_dict(lora)
    kept = {k: v for k, v in full.items() if not k.startswith(prefixes)}
    assert 0 < len(kept) < len(full), "the case must drop some keys and keep others"
    expected = run(core_sd.load_lora_for_models(model, None, kept, 1.0, 0.0)[0])  # LoraLoader's body
    whole = run(arch_sampling.load_lora(model, lora, 1.0))
    assert (expected - whole).abs().max() > 1e-3 * expected.abs().max(), "the dropped blocks change nothing"
    (weighted,) = weigh(arch_sampling.hook_lora(lora, 1.0), model, zeroed, "auto")
    hook_rig.assert_close(run(fast, weighted), expected, f"{lora} {zeroed} on the fast engine")
    (half,) = weigh(arch_sampling.hook_lora(lora, 1.0), model, "default=0.5", "auto")
    hook_rig.assert_close(run(fast, half), run(fast, arch_sampling.hook_lora(lora, 0.5)),
                          f"{lora} default=0.5")
