"""T1: Fast Hooks on GGUF-quantized models loaded by ComfyUI-GGUF (the vendored pack, 795e451).

Models: the tiny SD1.5 UNet and Flux transformer in Q8_0 and Q4_K (devtools/tiny_gguf.py), loaded by
ComfyUI-GGUF's own ``UnetLoaderGGUF`` (devtools/gguf_sampling.py). Each result is checked against
ComfyUI-GGUF's own patch path or an exact equivalent:

- a LoRA hook on every cond == ``LoraLoaderModelOnly`` on the GGUF model (ComfyUI-GGUF adds the LoRA
  to the weight when its layer dequantizes it);
- a model-as-LoRA hook at strength s on every cond == ``ModelMergeSimple(gguf, other, 1 - s)`` on the
  GGUF model (W + s (W2 - W) is that merge, patched in at dequantize time the same way);
- regional (two masked conds, two LoRAs; on SD1.5 one scheduled by keyframes) and model-as-LoRA over a
  LoraLoader LoRA == core's hook path on a float32 copy holding the values the GGUF layers compute
  with (core's hook path cannot run on the GGUF model itself: ``test_core_hooks_fail_on_gguf_models``).

Tolerance: both sides use the same dequantized weights, so they differ by float32 rounding only (the
LoRA is added to the layer's output instead of its weight): 1e-3 of the hook's effect (max |latent
with the LoRA - latent without|). Measured for a LoRA hook vs LoraLoader: 1.3e-5 to 2.0e-5 of the effect
(SD1.5 and Flux, Q8_0 and Q4_K), while quantization itself moves the latent by 0.11x (Q8_0) and 1.7-1.9x
(Q4_K) the effect; so the check is far inside quantization noise, and still fails on any real
difference. Every test also checks that its hook changes the latent by over 1 % of its range.
"""

from __future__ import annotations

import arch_sampling
import gguf_sampling
import pytest
import torch

pytestmark = pytest.mark.t1

STEPS = 1  # the GGUF layers dequantize every weight in every step: one model call per sampling where
# one is enough, two where a keyframe must change between steps
LATENT = 8  # latent pixels: 64x64 images for both architectures
LORAS = {"sd15": ("patchbay-lora-r4.safetensors", "patchbay-locon-r8.safetensors"),
         "flux": arch_sampling.FLUX_LORAS}
CKPT_B = "patchbay-sd15-tiny-b.safetensors"  # the model-as-LoRA source
EFFECT_REL = 1e-3


@pytest.fixture(scope="module")
def n(comfy):
    gguf_sampling.load_comfyui_gguf()
    return comfy.nodes.NODE_CLASS_MAPPINGS


@pytest.fixture(scope="module")
def pb(comfy):
    return comfy.pack.patcher.model_patcher


def fast(n, model, rounding="compute"):
    return n["PatchbayHookEngine"]().execute(model, 2048.0, rounding=rounding)[0]


def sample(arch, model, positive=None, negative=None, hooks=None, steps=STEPS):
    """KSampler's latent, in inference mode as ComfyUI's executor runs every node."""
    positive = positive or arch_sampling.make_cond(arch, 1, hooks=hooks)
    negative = negative or arch_sampling.make_cond(arch, 2, hooks=hooks)
    with torch.inference_mode():
        return arch_sampling.sample(model, positive, negative, seed=0, steps=steps, latent_size=LATENT)


_PLAIN: dict = {}


def plain(arch, qtype):
    """The GGUF model's latent without any hook (sampled once per model)."""
    if (arch, qtype) not in _PLAIN:
        _PLAIN[arch, qtype] = sample(arch, gguf_sampling.shared_gguf(arch, qtype))
    return _PLAIN[arch, qtype]


def assert_same_within_effect(actual, expected, without, what):
    effect = (expected - without).abs().max().item()
    assert effect > 1e-2 * expected.abs().max().item(), f"{what}: the hook barely changes the latent"
    diff = (actual - expected).abs().max().item()
    assert diff <= EFFECT_REL * effect, f"{what}: |diff| {diff:.3g} > {EFFECT_REL:g} x effect {effect:.3g}"


def lora_hook(n, lora, strength):
    return n["CreateHookLoraModelOnly"]().create_hook_model_only(lora, strength)[0]


def test_gguf_files_load_quantized(n):
    """UnetLoaderGGUF reads the tiny files as GGML tensors of the file's type (and F16 for the kept
    layers), detected as the right model."""
    import comfy.model_base

    for arch, base in (("sd15", comfy.model_base.BaseModel), ("flux", comfy.model_base.Flux)):
        for qtype in gguf_sampling.QTYPES:
            model = gguf_sampling.shared_gguf(arch, qtype)
            assert type(model.model) is base
            kinds = {getattr(p, "tensor_type", None) for p in model.model.parameters()}
            assert {kind.name for kind in kinds if kind is not None} == {qtype, "F16"}, (arch, qtype, kinds)


def test_fast_hooks_keeps_the_gguf_patcher_class(n, pb):
    """Fast Hooks upgrades a clone of the GGUFModelPatcher to Patchbay's class mixed into it; its clones
    (ComfyUI-GGUF's clone forces GGUFModelPatcher) and LoraLoader's keep both; the input is untouched."""
    model = gguf_sampling.shared_gguf("sd15", "Q4_K")
    gguf_class = type(model)
    hooked = fast(n, model)
    loraloader = n["LoraLoaderModelOnly"]().load_lora_model_only(hooked, LORAS["sd15"][0], 0.5)[0]
    for patcher in (hooked, hooked.clone(), hooked.clone().clone(), loraloader):
        assert isinstance(patcher, gguf_class) and pb.is_upgraded(patcher), type(patcher).__mro__
    assert type(model) is gguf_class and not pb.is_upgraded(model)


@pytest.mark.parametrize(("arch", "qtype", "rounding"), [
    ("sd15", "Q8_0", "compute"), ("sd15", "Q4_K", "loraloader"), ("flux", "Q4_K", "compute")])
def test_lora_hook_equals_gguf_loraloader(n, arch, qtype, rounding):
    """rounding "loraloader" rounds W + LoRA into weights stored below fp32, as LoraLoader does; on
    quantized weights ComfyUI-GGUF's LoraLoader does not round (it adds the LoRA at dequantize time),
    so both settings must give its latent."""
    model = gguf_sampling.shared_gguf(arch, qtype)
    lora = LORAS[arch][0]
    expected = sample(arch, n["LoraLoaderModelOnly"]().load_lora_model_only(model, lora, 0.8)[0])
    actual = sample(arch, fast(n, model, rounding), hooks=lora_hook(n, lora, 0.8))
    assert_same_within_effect(actual, expected, plain(arch, qtype), f"{arch} {qtype} LoRA hook vs LoraLoader")
    assert not model.patches and not model.hook_patches


def test_model_as_lora_hook_equals_gguf_merge(n):
    """Model-as-LoRA at strength s is W + s (W2 - W): ModelMergeSimple at ratio 1 - s on the GGUF model."""
    model = gguf_sampling.shared_gguf("sd15", "Q4_K")
    other = n["CheckpointLoaderSimple"]().load_checkpoint(CKPT_B)[0]
    expected = sample("sd15", n["ModelMergeSimple"]().merge(model, other, 0.5)[0])
    (hooks,) = n["CreateHookModelAsLoraModelOnly"]().create_hook_model_only(CKPT_B, 0.5)
    actual = sample("sd15", fast(n, model), hooks=hooks)
    assert_same_within_effect(actual, expected, plain("sd15", "Q4_K"), "model-as-LoRA hook vs GGUF merge")


def test_model_as_lora_over_a_gguf_lora_uses_the_unpatched_weight(n):
    """Core takes a model-as-LoRA's W from the unpatched weight; ComfyUI-GGUF keeps a LoraLoader LoRA on
    the quantized tensor and adds it at dequantize time, so the engine dequantizes without it."""
    model = gguf_sampling.shared_gguf("sd15", "Q8_0")
    lora = LORAS["sd15"][0]
    (hooks,) = n["CreateHookModelAsLoraModelOnly"]().create_hook_model_only(CKPT_B, 0.5)
    with_lora = n["LoraLoaderModelOnly"]().load_lora_model_only
    reference = gguf_sampling.dequantized_copy(model, "sd15")
    expected = sample("sd15", with_lora(reference, lora, 0.8)[0], hooks=hooks)
    without = sample("sd15", with_lora(reference, lora, 0.8)[0])
    actual = sample("sd15", fast(n, with_lora(model, lora, 0.8)[0]), hooks=hooks)
    assert_same_within_effect(actual, expected, without, "model-as-LoRA over a LoRA vs core on a copy")


def regions(n, arch, first, second):
    """Two conds masked to the left and right halves, carrying ``first`` and ``second`` hooks."""
    side = 8 * LATENT
    left = torch.zeros((side, side))
    left[:, : side // 2] = 1.0
    return (arch_sampling.make_cond(arch, 1, hooks=first, mask=left)
            + arch_sampling.make_cond(arch, 3, hooks=second, mask=1 - left))


@pytest.mark.heavy
@pytest.mark.parametrize(("arch", "qtype", "scheduled"), [("sd15", "Q4_K", True), ("flux", "Q8_0", False)])
def test_regional_hooks_equal_core_on_a_dequantized_copy(n, arch, qtype, scheduled):
    """Two masked conds with a LoRA each, in one batch on the GGUF model; core's hook path gives the
    reference on the float32 copy. Scheduled: the left LoRA goes 1.0 -> 0.3 from 30 % (the second of
    two steps)."""
    model = gguf_sampling.shared_gguf(arch, qtype)
    first = lora_hook(n, LORAS[arch][0], 1.0)
    if scheduled:
        (keyframes,) = n["CreateHookKeyframe"]().create_hook_keyframe(1.0, 0.0)
        (keyframes,) = n["CreateHookKeyframe"]().create_hook_keyframe(0.3, 0.3, keyframes)
        (first,) = n["SetHookKeyframes"]().set_hook_keyframes(first, keyframes)
    hooked = regions(n, arch, first, lora_hook(n, LORAS[arch][1], 0.6))
    negative = arch_sampling.make_cond(arch, 2)
    steps = 2 if scheduled else 1
    reference = arch_sampling.without_hook_cache(gguf_sampling.dequantized_copy(model, arch))
    expected = sample(arch, reference, hooked, negative, steps=steps)
    del reference
    without = sample(arch, model, regions(n, arch, None, None), negative, steps=steps)
    actual = sample(arch, fast(n, model), hooked, negative, steps=steps)
    what = f"{arch} {qtype} regional hooks (scheduled: {scheduled})"
    assert_same_within_effect(actual, expected, without, what)


@pytest.mark.parametrize("arch", ["sd15", "flux"])
def test_core_hooks_fail_on_gguf_models(n, arch):
    """Measured, ComfyUI 0.3.75 and 0.33: core's hook path (LoRA and model-as-LoRA hooks) stops on a
    ComfyUI-GGUF model at the first step, before it patches anything. ``patch_hooks`` reads every key
    of ``model.state_dict()``, and ComfyUI-GGUF's layers add a fake ``temp.weight`` entry (for its
    memory estimate) that is no attribute."""
    model = gguf_sampling.shared_gguf(arch, "Q8_0")
    hooks = [lora_hook(n, LORAS[arch][0], 0.8)]
    if arch == "sd15":
        hooks.append(n["CreateHookModelAsLoraModelOnly"]().create_hook_model_only(CKPT_B, 0.5)[0])
    for hook in hooks:
        with pytest.raises(AttributeError, match="object has no attribute 'temp'"):
            sample(arch, model, hooks=hook)
    if arch == "sd15":
        assert torch.equal(sample(arch, model), plain(arch, "Q8_0")), "the failed run left the model changed"
