"""T1: Fast Hooks on ComfyUI's own quantized models (``comfy/quant_ops.py``, ``comfy/ops.py``).

Models: the tiny SD1.5 UNet in ComfyUI's fp8 formats (devtools/tiny_quant.py), loaded by the UNETLoader
node: "fp8mixed" (mixed-precision ``_quantization_metadata``: ``QuantizedTensor`` weights on both
versions) and "fp8scaled" (the older ``scaled_fp8`` layout: 0.3.75's ``scaled_fp8_ops``, a float8 weight
times ``scale_weight``; 0.33 converts it to ``QuantizedTensor``); on ComfyUI 0.33 also nvfp4, built in
memory with 0.33's own quantizer (``tiny_quant.nvfp4_state_dict``) and loaded by
``comfy.sd.load_diffusion_model_state_dict``.

Two references for a hook on every cond:

- exact: LoraLoader on a float32 copy holding the values the quantized layers compute with (their own
  ``convert_weight``). The engine adds the LoRA to that same weight's output, so the two differ by
  float32 rounding only: 1e-3 of the hook's effect (max |latent with the LoRA - latent without|), as
  for GGUF (test_t1_hook_engine_gguf.py); measured 1.3e-5 to 2.5e-5 on both versions;
- LoraLoader on the quantized model itself. It requantizes W + delta into the layer's format (0.33 with
  a recalculated scale), so it differs from the engine by one more quantization of each patched
  weight: the check is that the difference stays within the quantization noise, measured as
  |latent of the quantized model - latent of the float checkpoint| without any LoRA (``NOISE_BOUND``).

The weights stay quantized: the engine's run leaves every quantized layer's weight of the same class
and dtype, with the same stored data (address and bytes). Core's hook path does not
run on these models, but for 0.3.75's scaled fp8 layers (``test_core_hooks_on_quantized_models``).
"""

from __future__ import annotations

import hashlib
import logging

import arch_sampling
import devpaths
import pytest
import tiny_quant
import torch

pytestmark = pytest.mark.t1


def _newer() -> bool:
    """ComfyUI 0.33 (nvfp4, comfy-kitchen's QuantizedTensor); False where no ComfyUI is set (t0 alone
    collects this file without one, and deselects it)."""
    try:
        return devpaths.comfyui_version() != "0.3.75"
    except RuntimeError:
        return False


NEWER = _newer()
FORMATS = (*tiny_quant.FORMATS, *(("nvfp4",) if NEWER else ()))
LATENT = 8
LORA, LOCON, LOHA = ("patchbay-lora-r4.safetensors", "patchbay-locon-r8.safetensors",
                     "patchbay-loha-r4.safetensors")
CKPT, CKPT_B = "patchbay-sd15-tiny-a.safetensors", "patchbay-sd15-tiny-b.safetensors"
AS_LORA = "CreateHookModelAsLoraModelOnly"
EXACT_REL = 1e-3  # of the hook's effect: float32 rounding (the LoRA on the output instead of the weight)
# x the quantization noise. LoraLoader rounds every patched weight back into the file's format with
# stochastic rounding (comfy.float.stochastic_rounding: an error of up to a whole quantization step,
# where the file's round-to-nearest errs by half a step at most), so its latent carries about twice the
# file's own noise more than Fast Hooks', which keeps the file's weights: measured 1.3-2.0x (fp8, both
# versions) and 1.7-2.1x (nvfp4).
NOISE_BOUND = 3.0


@pytest.fixture(scope="module")
def engine(comfy):
    return comfy.pack.hooks.enable


_MODELS: dict = {}


@pytest.fixture(scope="module")
def loaded(comfy):
    yield _MODELS
    _MODELS.clear()


def quantized(loaded, fmt):
    """The tiny UNet in ``fmt`` (loaded once per module; clone it, never patch it)."""
    if fmt not in loaded:
        import comfy.sd

        import nodes

        # in inference mode, as ComfyUI's executor runs UNETLoader: 0.33's quantized layers loaded outside
        # it cannot be moved inside it, where the samplers run
        with torch.inference_mode():
            if fmt == "nvfp4":
                state = tiny_quant.nvfp4_state_dict(devpaths.models_dir())
                loaded[fmt] = comfy.sd.load_diffusion_model_state_dict(state)
            else:
                name = f"{tiny_quant.STEM}-{fmt}.safetensors"
                loaded[fmt] = nodes.UNETLoader().load_unet(name, "default")[0]
    return loaded[fmt]


def float_model(loaded):
    """The float checkpoint's UNet, the source of every quantized file."""
    if "float" not in loaded:
        import nodes

        with torch.inference_mode():
            loaded["float"] = nodes.CheckpointLoaderSimple().load_checkpoint(CKPT)[0]
    return loaded["float"]


def dequantized_copy(loaded, fmt):
    """Core's layers, float32 weights: the values the ``fmt`` model's layers compute with."""
    key = ("copy", fmt)
    if key not in loaded:
        import comfy.sd

        state = {}
        with torch.inference_mode():
            for name, module in quantized(loaded, fmt).model.diffusion_model.named_modules():
                for param_name, param in module.named_parameters(recurse=False):
                    convert = getattr(module, f"convert_{param_name}", None)
                    value = convert(param, inplace=False) if convert is not None else param
                    state[f"{name}.{param_name}" if name else param_name] = value.to(torch.float32).clone()
            loaded[key] = comfy.sd.load_diffusion_model_state_dict(state)
    return loaded[key]


def sample(model, hooks=None, steps=1):
    """KSampler's latent in inference mode (as ComfyUI's executor runs every node)."""
    positive = arch_sampling.make_cond("sd15", 1, hooks=hooks)
    negative = arch_sampling.make_cond("sd15", 2, hooks=hooks)
    with torch.inference_mode():
        return arch_sampling.sample(model, positive, negative, seed=0, steps=steps, latent_size=LATENT)


def stored_weights(model):
    """{layer: (class, dtype, address and sha256 of its stored data)} of every quantized layer (ComfyUI
    0.33 wraps a QuantizedTensor in a new Parameter whenever it moves the model, even to where it is,
    so the stored data, not the Parameter object, tells whether a weight was replaced)."""
    import comfy.quant_ops

    out = {}
    for name, module in model.model.diffusion_model.named_modules():
        weight = getattr(module, "weight", None)
        quantized = isinstance(weight, comfy.quant_ops.QuantizedTensor)
        if not (quantized or getattr(weight, "dtype", None) == tiny_quant.FP8):
            continue
        data = getattr(weight, "_qdata", weight)
        digest = hashlib.sha256(data.detach().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()
        out[name] = (type(weight), weight.dtype, data.data_ptr(), digest)
    return out


# 7 transformer blocks x 10 linears; nvfp4 keeps the cross-attentions' k and v (tiny_quant.NVFP4_KEEP);
# 0.3.75's scaled_fp8_ops makes every Linear float8, the 10 the file keeps in fp16 with scale 1.
QUANTIZED_LAYERS = {"fp8mixed": 70, "fp8scaled": 70 if NEWER else 80, "nvfp4": 56}


def test_quantized_models_load_quantized(loaded):
    """Every transformer linear of each format is kept quantized (a QuantizedTensor; on 0.3.75 the older
    scaled fp8 layers keep a float8 weight and its scale_weight), detected as SD1.5."""
    import comfy.model_base
    import comfy.quant_ops

    for fmt in FORMATS:
        model = quantized(loaded, fmt)
        assert type(model.model) is comfy.model_base.BaseModel, fmt
        weights = stored_weights(model)
        assert len(weights) == QUANTIZED_LAYERS[fmt], (fmt, sorted(weights))
        for name, (cls, dtype, _, _) in weights.items():
            if fmt == "fp8scaled" and not NEWER:
                assert dtype == torch.float8_e4m3fn, (fmt, name, dtype)
                assert model.get_model_object(f"diffusion_model.{name}").scale_weight.dtype == torch.float32
            else:
                assert issubclass(cls, comfy.quant_ops.QuantizedTensor), (fmt, name, cls)


def effect_of(with_hook, without, what):
    effect = (with_hook - without).abs().max().item()
    assert effect > 1e-2 * with_hook.abs().max().item(), f"{what}: the hook barely changes the latent"
    return effect


def claimed_run(engine, model, hooks, caplog):
    """Fast Hooks' latent, checking that the engine planned the hooks and left none to core."""
    fast = engine.enable_hook_engine(model)
    plans = engine.hook_engine_of(fast).plans_built
    with caplog.at_level(logging.DEBUG, logger="patchbay.hooks"):
        latent = sample(fast, hooks=hooks)
    assert engine.hook_engine_of(fast).plans_built == plans + 1, "the engine did not plan the hooks"
    assert "weight-swapping path" not in caplog.text, caplog.text
    return latent


# A LoRA on every format; LoCon on the older scaled fp8 layers (a torch Linear on 0.3.75); LoHa, a dense
# delta the engine makes from the dequantized weight, on the QuantizedTensor layers.
CASES = ([(fmt, LORA) for fmt in FORMATS] + [("fp8scaled", LOCON)]
         + [(fmt, LOHA) for fmt in FORMATS if fmt != "fp8scaled"])


@pytest.mark.parametrize(("fmt", "lora"), CASES)
def test_hook_equals_loraloader_and_weights_stay_quantized(loaded, engine, caplog, fmt, lora):
    """A LoRA / LoCon / LoHa hook on every cond: equal to LoraLoader on the float32 copy within float
    rounding, to LoraLoader on the quantized model within the quantization noise; the engine's run
    leaves every quantized weight as it was (the same class, dtype, storage and bytes)."""
    import comfy.model_management

    model = quantized(loaded, fmt)
    with torch.inference_mode():  # as everything ComfyUI does to these models (0.33 cannot mix the modes)
        comfy.model_management.unload_all_models()  # takes off what an earlier LoraLoader run patched in
    before = stored_weights(model)
    actual = claimed_run(engine, model, arch_sampling.hook_lora(lora, 0.8), caplog)
    after = stored_weights(model)
    assert after == before, f"{fmt}: the engine's run changed a quantized weight"
    copy = dequantized_copy(loaded, fmt)
    exact = sample(arch_sampling.load_lora(copy, lora, 0.8))
    effect = effect_of(exact, plain(loaded, ("copy", fmt)), f"{fmt} {lora}")
    exact_diff = (actual - exact).abs().max().item()
    assert exact_diff <= EXACT_REL * effect, f"{fmt} {lora}: {exact_diff:.3g}, effect {effect:.3g}"
    loraloader = sample(arch_sampling.load_lora(model, lora, 0.8))
    noise = quantization_noise(loaded, fmt)
    diff = (actual - loraloader).abs().max().item()
    print(f"{fmt} {lora}: vs the copy {exact_diff / effect:.2g}, vs LoraLoader {diff / effect:.3g} x effect, "
          f"{diff / noise:.3g} x noise (noise {noise / effect:.3g} x effect)")
    assert diff <= NOISE_BOUND * noise, f"{fmt} {lora}: vs LoraLoader |diff| {diff:.3g}, noise {noise:.3g}"
    assert not model.patches and not model.hook_patches


def plain(loaded, which):
    """The latent without any hook of the float checkpoint ("float"), a quantized model (its format) or
    its float32 copy (("copy", format)); sampled once."""
    if ("plain", which) not in loaded:
        if which == "float":
            model = float_model(loaded)
        elif isinstance(which, tuple):
            model = dequantized_copy(loaded, which[1])
        else:
            model = quantized(loaded, which)
        loaded["plain", which] = sample(model)
    return loaded["plain", which]


def quantization_noise(loaded, fmt):
    """max |latent of the ``fmt`` model - latent of the float checkpoint|, without any hook."""
    return (plain(loaded, fmt) - plain(loaded, "float")).abs().max().item()


@pytest.mark.heavy
@pytest.mark.parametrize("fmt", FORMATS)
def test_model_as_lora_hook_dequantizes_through_comfyui(loaded, engine, caplog, fmt):
    """A model-as-LoRA hook needs W (its delta is W2 - W): the engine takes W from the layer's own
    convert_weight, so the hook equals core's hook path on the float32 copy."""
    import nodes

    (hooks,) = nodes.NODE_CLASS_MAPPINGS[AS_LORA]().create_hook_model_only(CKPT_B, 0.5)
    copy = dequantized_copy(loaded, fmt)
    exact = sample(copy, hooks=hooks)
    effect = effect_of(exact, plain(loaded, ("copy", fmt)), f"{fmt} model-as-LoRA")
    actual = claimed_run(engine, quantized(loaded, fmt), hooks, caplog)
    diff = (actual - exact).abs().max().item()
    assert diff <= EXACT_REL * effect, f"{fmt}: |diff| {diff:.3g} > {EXACT_REL} x effect {effect:.3g}"


# What core's hook path does on each version and format (measured; LoRA and model-as-LoRA hooks alike):
# 0.33 reads every entry of the model's state dict and asks each layer for it, but a quantized layer's
# state dict has a ``weight_scale`` entry that is no attribute; 0.3.75 gets past that and stops in the
# mixed-precision layer's set_weight, which refuses the in-place update core's hook path asks for. Only
# 0.3.75's older scaled fp8 layers take it: they requantize W + LoRA in place, as LoraLoader does.
NO_ATTRIBUTE = (AttributeError, "'Linear' object has no attribute 'weight_scale'")
CORE_HOOKS = {"fp8mixed": NO_ATTRIBUTE if NEWER else (AssertionError, ""),
              "fp8scaled": NO_ATTRIBUTE if NEWER else None, "nvfp4": NO_ATTRIBUTE}


@pytest.mark.parametrize("fmt", FORMATS)
def test_core_hooks_on_quantized_models(loaded, fmt):
    """Core's hook path on the quantized model (no Fast Hooks): it fails at the first step, before a
    weight is changed, except on 0.3.75's scaled fp8 layers, where it equals LoraLoader."""
    import nodes

    model = quantized(loaded, fmt)
    lora = arch_sampling.hook_lora(LORA, 0.8)
    (as_lora,) = nodes.NODE_CLASS_MAPPINGS[AS_LORA]().create_hook_model_only(CKPT_B, 0.5)
    if CORE_HOOKS[fmt] is None:
        expected = sample(arch_sampling.load_lora(model, LORA, 0.8))
        assert torch.equal(sample(model, hooks=lora), expected)
        return
    error, message = CORE_HOOKS[fmt]
    for hooks in (lora, as_lora):
        with pytest.raises(error, match=message):
            sample(model, hooks=hooks)
    assert torch.equal(sample(model), plain(loaded, fmt)), "the failed run left the model changed"


def test_a_weight_the_layer_cannot_dequantize_is_refused_with_a_fix(loaded, engine):
    """Where the layer's own convert_weight fails (a format this device has no kernel for), a hook that
    needs the weight stops with an error naming the layer and the fix, not inside core."""
    model = quantized(loaded, "fp8mixed")
    layer = model.get_model_object("diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q")

    def no_kernel(weight, **kwargs):
        raise NotImplementedError("no kernel for this layout here")

    layer.convert_weight = no_kernel  # this instance only, removed below
    try:
        with pytest.raises(TypeError, match=r"attn1\.to_q\.weight .* convert_weight failed: no kernel .* "
                                            r"Use a LoRA/LoCon hook .* or load it with LoraLoader"):
            sample(engine.enable_hook_engine(model), hooks=arch_sampling.hook_lora(LOHA, 0.8))
    finally:
        del layer.convert_weight
