"""T1: Fast Hooks on the 2026 families: tiny Flux.2, SD3.5, Wan 2.1, 2.2 5B, HunyuanVideo 1.0, 1.5, LTX-Video,
HunyuanImage 2.1, Cosmos Predict2, and an SD2.x UNet.

Each model is built in memory with ComfyUI's own classes and loaded by its real loader (detection
included), each LoRA in the format its trainers write (devtools/tiny_dits.py; which families cannot be
made small, and why, is said there). Conditioning is synthesized (devtools/arch_sampling.py).

- A LoRA hook on both conds equals LoraLoader, and so does core's own hook path, within 1e-4 of the
  LoRA's effect; the engine plans the hook and claims every weight LoraLoader patches; the model's
  weights are byte-identical afterwards.
- Two masked regions, a scheduled hook on one and a plain hook on the other, equal core's hook path. On
  the video families the scheduled hook's mask applies to every frame (one ``[1, H, W]`` mask) and the
  other is a per-frame ``[T, H, W]`` mask.
- Wan 2.2 14B's two stages (KSamplerAdvanced, steps 0-2 of 3 on the high-noise expert, 2-3 on the
  low-noise one) with a LoRA hook on the high-noise stage only equal LoraLoader on the high-noise model.
- SD2.1 768-v: the tiny SD2 UNet with v-prediction set by core's ModelSamplingDiscrete, as the first test.
- A diffusers LoRA on fused weights (SD3.5's qkv) is claimed for a TorchCompileModel model's graphs.

Flux.2 and Cosmos Predict2 are built small on ComfyUI 0.33 only (0.3.75 fixes Flux.2's 48 heads, 6144
wide, and Cosmos Predict2's 10 blocks): they are not collected on 0.3.75.
"""

from __future__ import annotations

import dataclasses

import arch_sampling
import pytest
import tiny_dits
import torch

pytestmark = pytest.mark.t1


FAMILIES = tiny_dits.families()
FORMATS = [(name, fmt.name) for name in FAMILIES for fmt in tiny_dits.FAMILIES[name].loras]
STEPS = 2
STRENGTH = 0.8
EXACT = 1e-4  # of the LoRA's effect (the largest change LoraLoader makes to the latent)


class Models:
    """Each family's tiny model and LoRAs, built on first use and shared by the module's tests."""

    def __init__(self) -> None:
        self._models: dict[str, object] = {}

    def get(self, name: str, fmt: str | None = None) -> tuple:
        """(family, model, LoRA tensors in format ``fmt``: default the family's first)."""
        family = tiny_dits.FAMILIES[name]
        if name not in self._models:
            self._models[name] = tiny_dits.load(family)
        lora_format = next(f for f in family.loras if f.name == (fmt or family.loras[0].name))
        return family, self._models[name], tiny_dits.lora(family, self._models[name], lora_format)


@pytest.fixture(scope="module")
def dits(comfy) -> Models:
    return Models()


@pytest.fixture(scope="module")
def engine(comfy):
    return comfy.pack.hooks.enable


def sample(family, model, positive=None, negative=None, hooks=None) -> torch.Tensor:
    positive = positive or arch_sampling.make_cond(family.name, 1, hooks=hooks)
    negative = negative or arch_sampling.make_cond(family.name, 2, hooks=hooks)
    return arch_sampling.sample(model, positive, negative, seed=0, steps=STEPS, latent_shape=family.latent)


def assert_within(actual, expected, effect, what):
    diff = (actual - expected).abs().max().item()
    assert diff <= EXACT * effect, f"{what}: max |diff| {diff:.3g} > {EXACT} x the LoRA's effect {effect:.3g}"


@pytest.mark.parametrize(("name", "fmt"), FORMATS)
def test_fast_hooks_equal_loraloader_and_core_hooks(dits, engine, weights_digest, name, fmt):
    import comfy.lora
    import comfy.lora_convert

    family, model, lora = dits.get(name, fmt)
    before = weights_digest(model)
    base = sample(family, model)
    expected = sample(family, arch_sampling.load_lora(model, lora, STRENGTH))
    effect = (expected - base).abs().max().item()
    assert effect > 1e-2 * expected.abs().max().item(), "the LoRA does (almost) nothing"

    core = sample(family, model, hooks=arch_sampling.hook_lora(lora, STRENGTH))
    assert_within(core, expected, effect, f"{name} {fmt}: core's hook vs LoraLoader")

    fast = engine.enable_hook_engine(model)
    hooks = arch_sampling.hook_lora(lora, STRENGTH)
    plans = engine.hook_engine_of(fast).plans_built
    actual = sample(family, fast, hooks=hooks)
    assert_within(actual, expected, effect, f"{name} {fmt}: Fast Hooks vs LoraLoader")

    assert engine.hook_engine_of(fast).plans_built == plans + 1, "the engine did not plan the hook"
    # every patch ran as A and B, slices of fused weights too (q, k, v of a diffusers LoRA on a fused
    # qkv): no delta the size of a weight was made
    assert len(engine.hook_engine_of(fast).cache) == 0, f"{name} {fmt}: a LoRA patch became a dense delta"
    parsed = engine.hook_engine_of(fast).hook_patches(fast.model, hooks.hooks[0])
    key_map = comfy.lora.model_lora_keys_unet(model.model, {})
    with arch_sampling.logged() as unmatched:  # "lora key not loaded: ..."
        loraloader_keys = comfy.lora.load_lora(comfy.lora_convert.convert_lora(lora), key_map)
    modules = sum(key.endswith((".lora_A.weight", ".lora_down.weight")) for key in lora)
    assert not unmatched and len(loraloader_keys) == modules, "ComfyUI does not map every LoRA module"
    assert parsed.reason is None and set(parsed.patches) == set(loraloader_keys), "not every weight claimed"
    assert weights_digest(model) == before and not model.patches and not model.hook_patches


def test_sd2_768_v_fast_hooks_equal_loraloader_and_core_hooks(dits, engine, weights_digest):
    """SD2.1 768-v is the tiny SD2 UNet sampled as v-prediction: ComfyUI reads the prediction from
    output_blocks.11's norm bias, which a one-level UNet lacks (tiny_dits), so core's
    ModelSamplingDiscrete node sets it, as for any v-prediction file detection misses."""
    import comfy.model_sampling

    import nodes

    family, model, lora = dits.get("sd2")
    before = weights_digest(model)
    (vpred,) = nodes.NODE_CLASS_MAPPINGS["ModelSamplingDiscrete"]().patch(model, "v_prediction", False)
    expected = sample(family, arch_sampling.load_lora(vpred, lora, STRENGTH))
    effect = (expected - sample(family, vpred)).abs().max().item()
    assert effect > 1e-2 * expected.abs().max().item(), "the LoRA does (almost) nothing"
    assert isinstance(vpred.get_model_object("model_sampling"), comfy.model_sampling.V_PREDICTION)
    core = sample(family, vpred, hooks=arch_sampling.hook_lora(lora, STRENGTH))
    assert_within(core, expected, effect, "sd2 768-v: core's hook vs LoraLoader")
    fast = engine.enable_hook_engine(vpred)
    plans = engine.hook_engine_of(fast).plans_built
    actual = sample(family, fast, hooks=arch_sampling.hook_lora(lora, STRENGTH))
    assert_within(actual, expected, effect, "sd2 768-v: Fast Hooks vs LoraLoader")
    assert engine.hook_engine_of(fast).plans_built == plans + 1, "the engine did not plan the hook"
    assert len(engine.hook_engine_of(fast).cache) == 0, "sd2 768-v: a LoRA patch became a dense delta"
    assert weights_digest(model) == before and not model.patches and not model.hook_patches


def _regions(family, lora, repeat: bool = False) -> tuple[list, list]:
    """Positive: a scheduled hook on the left half (of every frame: one [1, H, W] mask, or with
    ``repeat`` that mask repeated for each frame) and a plain hook on the right half; on a video, under a
    per-frame mask ([T, H, W]: the right half of frame 0, all of the others). Negative: no hook."""
    import comfy.hooks

    frames, height, width = (1, *family.latent[1:]) if not family.video else family.latent[1:]
    every_frame = torch.zeros((1, height, width))
    every_frame[:, :, : width // 2] = 1.0
    per_frame = torch.ones((frames, height, width))
    per_frame[0] = 1.0 - every_frame[0]
    every_frame = every_frame.repeat(frames, 1, 1) if repeat else every_frame
    keyframes = comfy.hooks.HookKeyframeGroup()
    for percent, strength in ((0.0, 1.0), (0.5, 0.3)):
        keyframes.add(comfy.hooks.HookKeyframe(strength=strength, start_percent=percent))
    scheduled = arch_sampling.hook_lora(lora, 1.0)
    scheduled.set_keyframes_on_hooks(keyframes)  # what SetHookKeyframes does
    plain = arch_sampling.hook_lora(lora, 0.6)
    positive = (arch_sampling.make_cond(family.name, 1, hooks=scheduled, mask=every_frame)
                + arch_sampling.make_cond(family.name, 3, hooks=plain, mask=per_frame))
    return positive, arch_sampling.make_cond(family.name, 2)


@pytest.mark.parametrize("name", FAMILIES)
def test_regional_and_scheduled_hooks_equal_core(dits, engine, weights_digest, name):
    family, model, lora = dits.get(name)
    before = weights_digest(model)
    positive, negative = _regions(family, lora)
    expected = sample(family, model, positive, negative)
    unhooked = [[cond, {k: v for k, v in extra.items() if k != "hooks"}] for cond, extra in positive]
    effect = (expected - sample(family, model, unhooked, negative)).abs().max().item()
    assert effect > 1e-2 * expected.abs().max().item(), "the regional hooks do (almost) nothing"
    actual = sample(family, engine.enable_hook_engine(model), positive, negative)
    assert_within(actual, expected, effect, f"{name}: two masked regions, engine vs core")
    if family.video:  # core applies a [1, H, W] mask to every frame of a video latent
        repeated = sample(family, model, *_regions(family, lora, repeat=True))
        assert_within(repeated, expected, effect, f"{name}: the mask repeated for each frame, core")
    assert weights_digest(model) == before and not model.patches and not model.hook_patches


def two_stages(family, high, low, hooks=None) -> torch.Tensor:
    """Wan 2.2 14B's workflow: KSamplerAdvanced steps 0-2 of 3 on ``high`` (noise added, leftover noise
    returned), then 2-3 on ``low``; ``hooks`` on the high-noise stage's conds only."""
    import nodes

    sampler = nodes.KSamplerAdvanced()
    latent = {"samples": torch.zeros((1, *family.latent))}
    stages = ((high, hooks, "enable", 0, 2, "enable"), (low, None, "disable", 2, 3, "disable"))
    for model, stage_hooks, add_noise, start, end, leftover in stages:
        positive = arch_sampling.make_cond(family.name, 1, hooks=stage_hooks)
        negative = arch_sampling.make_cond(family.name, 2, hooks=stage_hooks)
        (latent,) = sampler.sample(model, add_noise, 0, 3, 2.0, "euler", "simple", positive, negative,
                                   latent, start, end, leftover)
    return latent["samples"]


def test_wan22_two_stages_with_a_lora_on_the_high_noise_model_only(engine, weights_digest):
    family = tiny_dits.FAMILIES["wan21"]  # Wan 2.2 14B: two Wan 2.1-layout experts
    high, low = tiny_dits.load(family, "high"), tiny_dits.load(family, "low")
    lora = tiny_dits.lora(family, high)
    before = weights_digest(high), weights_digest(low)
    base = two_stages(family, high, low)
    expected = two_stages(family, arch_sampling.load_lora(high, lora, STRENGTH), low)
    effect = (expected - base).abs().max().item()
    assert effect > 1e-2 * expected.abs().max().item(), "the LoRA does (almost) nothing"
    core = two_stages(family, high, low, arch_sampling.hook_lora(lora, STRENGTH))
    assert_within(core, expected, effect, "two stages: core's hook vs LoraLoader")
    fast_high, fast_low = engine.enable_hook_engine(high), engine.enable_hook_engine(low)
    plans = engine.hook_engine_of(fast_high).plans_built
    actual = two_stages(family, fast_high, fast_low, arch_sampling.hook_lora(lora, STRENGTH))
    assert_within(actual, expected, effect, "two stages: Fast Hooks vs LoraLoader")
    assert engine.hook_engine_of(fast_high).plans_built == plans + 1, "the engine did not plan the hook"
    assert (weights_digest(high), weights_digest(low)) == before


# --- a LoRA of another family or size -----------------------------------------------------------------
def _wider_wan() -> tiny_dits.Family:
    """Wan 2.1 at twice the tiny width: its LoRA has Wan 2.2 5B's key names and other shapes, as a real
    Wan 2.1 14B LoRA (5120 wide) has on Wan 2.2 5B (3072)."""
    wan = tiny_dits.FAMILIES["wan21"]
    return dataclasses.replace(wan, name="wan21", config={**wan.config, "dim": 256, "num_heads": 2,
                                                         "ffn_dim": 512})


def test_a_diffusers_lora_on_fused_weights_runs_in_the_graphs_of_a_compiled_model(comfy, dits, engine):
    """SD3.5's diffusers LoRA patches q, k and v as slices of the fused qkv (ComfyUI's offset patches).
    Run low-rank, they need no dense delta, so on a model compiled by TorchCompileModel the engine claims
    the hook for its compiled run instead of leaving it to core (a dense delta would: hooks/engine.py)."""
    family, model, lora = dits.get("sd35", "diffusers")
    compiled = comfy.nodes.NODE_CLASS_MAPPINGS["TorchCompileModel"].execute(model, "eager")[0]
    fast = engine.enable_hook_engine(compiled)
    hooks = arch_sampling.hook_lora(lora, STRENGTH)
    options = {**fast.model_options,
               "transformer_options": dict(fast.model_options.get("transformer_options", {}))}
    claimed = engine.hook_engine_of(fast).claim(fast, hooks, options)
    assert claimed == hooks.hooks, "the sliced LoRA was left to core on the compiled model"
    run = options["transformer_options"][comfy.pack.hooks.engine.RUN_KEY]
    assert run.compiled is not None, "the engine did not see the model as compiled"


def test_a_lora_of_another_size_is_refused_not_silently_skipped(comfy, dits, engine):
    """Bad input (issue 31): LoraLoader skips each misfitting patch with a log line, so the LoRA does
    nothing; Fast Hooks stops with an error naming the weight, both shapes and the fix, before a step
    runs, and Patchbay's LoRA nodes refuse it when they load it."""
    lora_hooks = comfy.pack.hooks.lora_hooks
    wide = _wider_wan()
    lora = tiny_dits.lora(wide, tiny_dits.load(wide))
    family, model, _ = dits.get("wan22_5b")
    plain = sample(family, model)
    assert torch.equal(sample(family, arch_sampling.load_lora(model, lora, STRENGTH)), plain)  # the no-op
    message = r"do not fit this model \(WAN22\) \(diffusion_model\.blocks\.0\..* is \[.*\] in this model"
    with pytest.raises(ValueError, match=message + r".*Pick a LoRA trained for this model"):
        sample(family, engine.enable_hook_engine(model), hooks=arch_sampling.hook_lora(lora, STRENGTH))
    with pytest.raises(lora_hooks.LoraMismatchError, match=message):
        lora_hooks.check_lora_fits(lora, "wan21-wide.safetensors", model)
    assert torch.equal(sample(family, model), plain), "the refused run changed the model"


def _flux1_lora_on_flux2_is_refused(comfy, dits, engine):
    """The tiny Flux.1's kohya LoRA (3072 wide) names Flux.2's blocks: refused, not a silent no-op."""
    lora_hooks = comfy.pack.hooks.lora_hooks
    lora = arch_sampling.lora_state_dict("patchbay-flux-kohya-r8.safetensors")
    family, model, _ = dits.get("flux2")
    message = r"do not fit this model \(Flux2\) \(diffusion_model\.double_blocks\.0\."
    with pytest.raises(lora_hooks.LoraMismatchError, match=message):
        lora_hooks.check_lora_fits(lora, "patchbay-flux-kohya-r8.safetensors", model)
    with pytest.raises(ValueError, match=message):
        sample(family, engine.enable_hook_engine(model), hooks=arch_sampling.hook_lora(lora, STRENGTH))


if "flux2" in FAMILIES:  # Flux.2 is built small on ComfyUI 0.33 only (module docstring)
    test_a_flux1_lora_on_flux2_is_refused = _flux1_lora_on_flux2_is_refused
