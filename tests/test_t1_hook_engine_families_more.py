"""T1: Hook Block Weights, LyCORIS, fp8 / nvfp4 and GGUF on the 2026 families (issue 31 items 3, 4).

The tiny models and LoRAs of devtools/tiny_dits.py (ComfyUI's own classes and loader), sampled 2 steps with
devtools/arch_sampling.py; LoraLoader (``comfy.sd.load_lora_for_models``, the node's body) is the reference.
The engine must plan every hook (``plans_built``) and leave the weights as they were.

- Hook Block Weights (the ``PatchbayHookBlockWeights`` node; block names of merge/architectures.py, whose
  family it detects from the model): one group of blocks at 0 and another at 0.5 equals LoraLoader with the
  first group's LoRA tensors left out and the second's loaded by a second LoraLoader at half strength,
  within 1e-4 of the LoRA's effect (measured 4e-6 to 1.6e-5). Wan and LTX-Video get two blocks
  (``tiny_dits.deeper``) so a map can tell blocks apart; Flux.2 and HunyuanVideo 1.5 zero their double
  block and halve the single one (HunyuanVideo 1.0, HunyuanImage 2.1 too); SD3.5 has two joint blocks;
  Cosmos Predict2 gets two blocks; SD2.x zeroes IN01 and halves OUT00-01 (sd-mecha's names, a kohya LoRA
  in diffusers-style names). A LoHa on Wan 2.1 takes block weights too.
- LyCORIS LoHa and LoKr in kohya names (``lora_unet_blocks_0_self_attn_q.hada_w1_a``) on Wan 2.1: Fast Hooks
  equals LoraLoader within 1e-4 of the effect, every module mapped by ComfyUI and claimed by the engine.
- ComfyUI's quantized formats (``tiny_dits.quantized``: devtools/tiny_quant.py's layouts and ComfyUI's own
  quantizers, loaded by ``load_diffusion_model_state_dict`` with the metadata a file's header gives): fp8
  mixed precision (every linear of the blocks) on Wan 2.1 and SD3.5; on Wan 2.1 also the older scaled fp8
  (every linear: 0.3.75's ``scaled_fp8_ops`` cast any linear without a scale to fp8) and, on ComfyUI 0.33,
  nvfp4 (comfy-kitchen's eager CPU kernels). Fast Hooks equals LoraLoader on a float32 copy of the
  dequantized weights within 1e-3 of the effect (float rounding), and LoraLoader on the quantized model
  itself within 3x the quantization noise (|latent of the quantized model - latent of the 16-bit one|
  without a LoRA: fp8 mixed 0.19x the LoRA's effect on Wan 2.1, 0.28x on SD3.5; scaled fp8 0.41x; nvfp4
  0.82x). LoraLoader rounds W + LoRA back into the format stochastically (test_t1_hook_engine_quantized.py),
  so it differs by more than the file's own noise: measured 0.66-1.6x that noise. Every quantized weight
  keeps its class, dtype, storage and bytes. Core's hook path fails at the first step and leaves the model
  unchanged, as the README says for the SD1.5 files: 0.33 ``AttributeError`` (no ``weight_scale``
  attribute, in ``get_key_weight``), 0.3.75 ``AssertionError`` in the layer's ``set_weight``; on 0.3.75's
  scaled fp8 layers it runs and equals LoraLoader.
- GGUF: the tiny SD3.5 and Wan 2.1 in Q8_0 (``tiny_dits.write_gguf``: devtools/tiny_gguf.py's writer with
  ComfyUI-GGUF's rules for SD3 and Wan: Wan's modulation and 5-D patch embedding F32, as convert.py and
  fix_5d_tensors.py keep them) through ComfyUI-GGUF's own UnetLoaderGGUF. ComfyUI-GGUF's LoraLoader adds
  the LoRA where a layer dequantizes its weight, so Fast Hooks equals it within 1e-3 of the effect (kohya
  and diffusers LoRAs on SD3.5, a musubi-tuner LoRA on Wan, a block map on SD3.5; quantization moves the
  latent by 0.033-0.039x the effect); the GGML tensors keep their type and bytes. Core's hook path fails
  on ComfyUI-GGUF's fake ``temp.weight`` entry, as the README says for SD1.5 and Flux.

Flux.2 and Cosmos Predict2 are built small on ComfyUI 0.33 only (tiny_dits): not collected on 0.3.75.
"""

from __future__ import annotations

import hashlib
import logging

import arch_sampling
import pytest
import tiny_dits
import torch

pytestmark = pytest.mark.t1


NEWER = tiny_dits.newer_comfyui()
FAMILIES = tiny_dits.families(NEWER)
STEPS = 2
STRENGTH = 0.8
EXACT = 1e-4  # of the LoRA's effect (the largest change LoraLoader makes to the latent)
EXACT_REL = 1e-3  # of the effect, quantized models: float32 rounding (the LoRA on the output, not the weight)
NOISE_BOUND = 3.0  # x the quantization noise, Fast Hooks vs LoraLoader on an fp8 model (module docstring)


class Models:
    """Tiny models (``deeper``: two blocks where a family has one stack of one), built once per module."""

    def __init__(self) -> None:
        self._models: dict[tuple[str, bool], object] = {}

    def get(self, name: str, deeper: bool = False) -> tuple:
        family = tiny_dits.FAMILIES[name]
        family = tiny_dits.deeper(family) if deeper else family
        if (name, deeper) not in self._models:
            self._models[name, deeper] = tiny_dits.load(family)
        return family, self._models[name, deeper]


@pytest.fixture(scope="module")
def dits(comfy) -> Models:
    return Models()


@pytest.fixture(scope="module")
def engine(comfy):
    return comfy.pack.hooks.enable


def sample(family, model, hooks=None) -> torch.Tensor:
    """KSampler's latent, in inference mode as ComfyUI's executor runs every node."""
    positive = arch_sampling.make_cond(family.name, 1, hooks=hooks)
    negative = arch_sampling.make_cond(family.name, 2, hooks=hooks)
    with torch.inference_mode():
        return arch_sampling.sample(model, positive, negative, seed=0, steps=STEPS,
                                    latent_shape=family.latent)


def effect_of(with_lora, without, what) -> float:
    effect = (with_lora - without).abs().max().item()
    assert effect > 1e-2 * with_lora.abs().max().item(), f"{what}: the LoRA does (almost) nothing"
    return effect


def assert_within(diff: float, bound: float, scale: float, what: str, unit: str = "effect") -> None:
    """``diff`` <= ``bound`` x ``scale`` (the LoRA's effect, or the quantization noise), reported as such."""
    print(f"{what}: {diff / scale:.2g} x {unit}")
    assert diff <= bound * scale, f"{what}: max |diff| {diff:.3g} > {bound} x {unit} {scale:.3g}"


def claimed_sample(engine, family, model, hooks) -> torch.Tensor:
    """Fast Hooks' latent; the engine must plan the hooks."""
    fast = engine.enable_hook_engine(model)
    plans = engine.hook_engine_of(fast).plans_built
    latent = sample(family, fast, hooks)
    assert engine.hook_engine_of(fast).plans_built == plans + 1, "the engine did not plan the hooks"
    return latent


def lora_of(family, model, kind: str) -> dict[str, torch.Tensor]:
    """The LoRA of ``family``: a format of tiny_dits (``family.loras``) or a LyCORIS algo."""
    if kind in ("loha", "lokr"):
        return tiny_dits.lycoris(family, model, kind)
    return tiny_dits.lora(family, model, next(f for f in family.loras if f.name == kind))


# --- Hook Block Weights ------------------------------------------------------------------------------
# (family, LoRA: a format of tiny_dits or a LyCORIS algo) -> (table family, block map, LoRA key prefixes
# of the blocks it sets to 0, of those it sets to 0.5)
_WAN_KOHYA = (("lora_unet_blocks_0_",), ("lora_unet_blocks_1_",))
_LTXV = tuple((f"diffusion_model.transformer_blocks.{i}.",) for i in (0, 1))
BLOCK_CASES = {
    ("flux2", "diffusers"): ("flux2", "double_blocks.*=0, single_blocks.*=0.5",
                             ("transformer.transformer_blocks.",),
                             ("transformer.single_transformer_blocks.",)),
    ("sd35", "diffusers"): ("sd3", "joint_blocks.0=0\njoint_blocks.1=0.5",
                            ("transformer.transformer_blocks.0.",), ("transformer.transformer_blocks.1.",)),
    ("wan21", "kohya"): ("wan21", "blocks.0=0, blocks.1=0.5", *_WAN_KOHYA),
    ("wan21", "loha"): ("wan21", "blocks.0-0=0; blocks.1=0.5", *_WAN_KOHYA),
    ("wan22_5b", "ai-toolkit"): ("wan22_5b", "blocks.0=0, blocks.1=0.5", ("diffusion_model.blocks.0.",),
                                 ("diffusion_model.blocks.1.",)),
    ("hunyuan10", "diffusion-pipe"): ("hunyuan_video", "double_blocks.*=0, single_blocks.0=0.5",
                                      ("transformer.double_blocks.",), ("transformer.single_blocks.",)),
    ("hunyuan15", "diffusion-pipe"): ("hunyuan_video15", "double_blocks.*=0, single_blocks.0=0.5",
                                      ("transformer.double_blocks.",), ("transformer.single_blocks.",)),
    ("ltxv", "ltx-trainer"): ("ltxv", "transformer_blocks.0=0, transformer_blocks.1=0.5", *_LTXV),
    ("hunyuan21", "kohya"): ("hunyuan_image21", "double_blocks.*=0, single_blocks.0=0.5",
                             ("lora_unet_double_blocks_",), ("lora_unet_single_blocks_",)),
    ("cosmos2", "kohya"): ("cosmos_predict2", "blocks.0=0, blocks.1=0.5", *_WAN_KOHYA),
    # SD2.x: sd-mecha's block names; kohya names the UNet's modules as diffusers does
    ("sd2", "kohya"): ("sd2", "IN01=0\nOUT00-01=0.5", ("lora_unet_down_blocks_0_",),
                       ("lora_unet_up_blocks_0_",)),
}
BLOCK_IDS = [case for case in BLOCK_CASES if case[0] in FAMILIES]


def block_map_diff(comfy, engine, family, model, lora, case) -> tuple[float, float]:
    """(max |Fast Hooks with the ``case``'s block map - LoraLoader on those blocks|, the LoRA's effect):
    the zeroed blocks' tensors left out, the halved ones loaded by a second LoraLoader at half strength."""
    blocks = comfy.pack.nodes.hook_blocks
    table_id, text, zeroed, halved = case
    assert blocks.model_blocks(model)[0] == table_id, "the architecture table detects another family"
    rest = {k: v for k, v in lora.items() if not k.startswith(zeroed + halved)}
    half = {k: v for k, v in lora.items() if k.startswith(halved)}
    assert half and len(rest) + len(half) < len(lora), "the case must zero some blocks and halve others"
    once = arch_sampling.load_lora(model, rest, STRENGTH) if rest else model
    expected = sample(family, arch_sampling.load_lora(once, half, STRENGTH / 2))
    whole = sample(family, arch_sampling.load_lora(model, lora, STRENGTH))
    effect = effect_of(whole, sample(family, model), f"{family.name} {text!r}")
    assert (expected - whole).abs().max() > 0.1 * effect, "the block map barely changes the LoRA"
    hooks = arch_sampling.hook_lora(lora, STRENGTH)
    (weighted,) = blocks.PatchbayHookBlockWeights().execute(hooks, model, text)
    actual = claimed_sample(engine, family, model, weighted)
    return (actual - expected).abs().max().item(), effect


@pytest.mark.parametrize(("name", "kind"), BLOCK_IDS, ids=[f"{n}-{k}" for n, k in BLOCK_IDS])
def test_block_weights_equal_loraloader_without_and_at_half_on_those_blocks(
        comfy, dits, engine, weights_digest, name, kind):
    family, model = dits.get(name, deeper=True)
    before = weights_digest(model)
    lora = lora_of(family, model, kind)
    diff, effect = block_map_diff(comfy, engine, family, model, lora, BLOCK_CASES[name, kind])
    assert_within(diff, EXACT, effect, f"{name} {kind} block map vs LoraLoader on those blocks")
    assert weights_digest(model) == before and not model.patches and not model.hook_patches


# --- LyCORIS -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("algo", ["loha", "lokr"])
def test_lycoris_on_wan21_equals_loraloader(dits, engine, weights_digest, algo):
    """LoHa / LoKr in kohya names on every attention and feed-forward linear of Wan 2.1's block."""
    import comfy.lora
    import comfy.lora_convert

    family, model = dits.get("wan21")
    lora = tiny_dits.lycoris(family, model, algo)
    key_map = comfy.lora.model_lora_keys_unet(model.model, {})
    with arch_sampling.logged() as unmatched:  # "lora key not loaded: ..."
        loraloader_keys = comfy.lora.load_lora(comfy.lora_convert.convert_lora(lora), key_map)
    modules = sum(key.endswith(".alpha") for key in lora)  # self- and cross-attention q, k, v, o; ffn 0, 2
    assert not unmatched and len(loraloader_keys) == modules == 10, "ComfyUI does not map every module"
    before = weights_digest(model)
    expected = sample(family, arch_sampling.load_lora(model, lora, STRENGTH))
    effect = effect_of(expected, sample(family, model), f"wan21 {algo}")
    hooks = arch_sampling.hook_lora(lora, STRENGTH)
    actual = claimed_sample(engine, family, model, hooks)
    assert_within((actual - expected).abs().max().item(), EXACT, effect, f"wan21 {algo} vs LoraLoader")
    fast = engine.enable_hook_engine(model)
    parsed = engine.hook_engine_of(fast).hook_patches(fast.model, hooks.hooks[0])
    assert parsed.reason is None and set(parsed.patches) == set(loraloader_keys), "not every weight claimed"
    assert weights_digest(model) == before and not model.patches and not model.hook_patches


# --- ComfyUI's quantized formats ----------------------------------------------------------------------
# (family, format): fp8 mixed precision on both families; the older scaled fp8 and nvfp4 (0.33) on Wan
QUANT_CASES = (("wan21", "fp8mixed"), ("sd35", "fp8mixed"), ("wan21", "fp8scaled"),
               *((("wan21", "nvfp4"),) if NEWER else ()))


class Quantized:
    """Per (family, format): the quantized model, its float32 dequantized copy and latents without a
    LoRA, made once."""

    def __init__(self, dits: Models) -> None:
        self.dits = dits
        self._cache: dict = {}

    def _get(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def model(self, name: str, fmt: str):
        import comfy.sd

        def make():
            tensors, metadata = tiny_dits.quantized(tiny_dits.FAMILIES[name], fmt)
            scales = (".weight_scale", ".scale_weight")
            layers = {key.rsplit(".", 1)[0] for key in tensors if key.endswith(scales)}
            self._cache["layers", name, fmt] = layers
            with torch.inference_mode():  # as the executor runs UNETLoader (0.33 cannot mix the modes)
                return comfy.sd.load_diffusion_model_state_dict(tensors, metadata=metadata)
        return self._get(("quantized", name, fmt), make)

    def layers(self, name: str, fmt: str) -> set[str]:
        """The layers the file quantizes (those with a weight scale)."""
        self.model(name, fmt)
        return self._cache["layers", name, fmt]

    def copy(self, name: str, fmt: str):
        """Core's layers, float32 weights: the values the quantized model's layers compute with."""
        import comfy.sd

        def make():
            state = {}
            with torch.inference_mode():
                for module_name, module in self.model(name, fmt).model.diffusion_model.named_modules():
                    prefix = f"{module_name}." if module_name else ""
                    for param_name, param in module.named_parameters(recurse=False):
                        convert = getattr(module, f"convert_{param_name}", None)
                        value = convert(param, inplace=False) if convert is not None else param
                        state[prefix + param_name] = value.to(torch.float32).clone()
                    for buffer_name, buffer in module.named_buffers(recurse=False):  # SD3's pos_embed
                        state[prefix + buffer_name] = buffer.to(torch.float32).clone()
                return comfy.sd.load_diffusion_model_state_dict(state)
        return self._get(("copy", name, fmt), make)

    def plain(self, name: str, fmt: str, which: str) -> torch.Tensor:
        """The latent without a LoRA of the "quantized" model, its "copy" or the 16-bit "float" one."""
        models = {"quantized": self.model, "copy": self.copy, "float": lambda n, _f: self.dits.get(n)[1]}
        family = tiny_dits.FAMILIES[name]
        return self._get(("plain", which, name, fmt), lambda: sample(family, models[which](name, fmt)))


@pytest.fixture(scope="module")
def quant(dits) -> Quantized:
    return Quantized(dits)


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


def stored_weights(model) -> dict:
    """{layer: (class, dtype, address and sha256 of the stored data)} of every quantized weight: a
    ``QuantizedTensor``, or a plain float8 weight (0.3.75's scaled fp8 layers)."""
    import comfy.quant_ops

    out = {}
    for name, module in model.model.diffusion_model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, comfy.quant_ops.QuantizedTensor) or getattr(weight, "dtype", None) == FP8:
            data = getattr(weight, "_qdata", weight)
            out[name] = (type(weight), weight.dtype, data.data_ptr(), digest(data))
    return out


FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize(("name", "fmt"), QUANT_CASES)
def test_fast_hooks_on_quantized_dits_equal_loraloader_and_weights_stay_quantized(
        dits, quant, engine, caplog, name, fmt):
    import comfy.model_management

    family, floating = dits.get(name)
    model = quant.model(name, fmt)
    before = stored_weights(model)
    assert set(before) == quant.layers(name, fmt) and len(before) >= 10, f"{name}: {sorted(before)} as {fmt}"
    with torch.inference_mode():
        comfy.model_management.unload_all_models()  # takes off what an earlier LoraLoader run patched in
    lora = tiny_dits.lora(family, floating)
    with caplog.at_level(logging.DEBUG, logger="patchbay.hooks"):
        actual = claimed_sample(engine, family, model, arch_sampling.hook_lora(lora, STRENGTH))
    assert "weight-swapping path" not in caplog.text, caplog.text
    assert stored_weights(model) == before, f"{name}: the engine's run changed a quantized weight"

    exact = sample(family, arch_sampling.load_lora(quant.copy(name, fmt), lora, STRENGTH))
    effect = effect_of(exact, quant.plain(name, fmt, "copy"), f"{name} {fmt}")
    what = f"{name} {fmt}"
    assert_within((actual - exact).abs().max().item(), EXACT_REL, effect, f"{what} vs the float32 copy")
    loraloader = sample(family, arch_sampling.load_lora(model, lora, STRENGTH))
    noise = (quant.plain(name, fmt, "quantized") - quant.plain(name, fmt, "float")).abs().max().item()
    diff = (actual - loraloader).abs().max().item()
    print(f"{what}: noise {noise / effect:.2g} x effect, vs LoraLoader {diff / noise:.2g} x noise")
    assert_within(diff, NOISE_BOUND, noise, f"{what} vs LoraLoader on it", "quantization noise")
    assert not model.patches and not model.hook_patches


# (the exception, its message, a function of ComfyUI's it is raised from)
CORE_FAILS = ((AttributeError, "'Linear' object has no attribute 'weight_scale'", "get_key_weight") if NEWER
              else (AssertionError, None, "set_weight"))
# 0.3.75 runs core's hooks on its scaled fp8 layers (plain float8 weights it rewrites in place)
CORE_RUNS = () if NEWER else (("wan21", "fp8scaled"),)


@pytest.mark.parametrize(("name", "fmt"), QUANT_CASES)
def test_core_hooks_on_quantized_dits(dits, quant, name, fmt):
    """As the README says for the SD1.5 files: core's hook path fails at the first step and leaves the
    model as it was, except on 0.3.75's scaled fp8 layers, where it equals LoraLoader."""
    family, floating = dits.get(name)
    model = quant.model(name, fmt)
    lora = tiny_dits.lora(family, floating)
    if (name, fmt) in CORE_RUNS:
        core = sample(family, model, arch_sampling.hook_lora(lora, STRENGTH))
        loraloader = sample(family, arch_sampling.load_lora(model, lora, STRENGTH))
        assert torch.equal(core, loraloader), (core - loraloader).abs().max().item()
        return
    error, message, where = CORE_FAILS
    with pytest.raises(error, match=message) as info:
        sample(family, model, arch_sampling.hook_lora(lora, STRENGTH))
    assert where in {entry.name for entry in info.traceback}, info.traceback
    after = sample(family, model)
    assert torch.equal(after, quant.plain(name, fmt, "quantized")), "the failed run changed the model"


# --- GGUF --------------------------------------------------------------------------------------------
GGUF_FAMILIES = ("sd35", "wan21")  # a joint-attention image DiT and a video one


@pytest.fixture(scope="module")
def ggufs(comfy, tmp_path_factory) -> dict:
    """{family: the tiny model in Q8_0 through ComfyUI-GGUF's own UnetLoaderGGUF} (its folder added for
    the load)."""
    import folder_paths
    import gguf_sampling

    import nodes

    gguf_sampling.load_comfyui_gguf()
    folder = tmp_path_factory.mktemp("gguf_dits")
    paths, extensions = folder_paths.folder_names_and_paths["diffusion_models"]
    out = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(folder_paths.folder_names_and_paths, "diffusion_models",
                      ([*paths, str(folder)], extensions))
        for name in GGUF_FAMILIES:
            file = f"patchbay-{name}-tiny-Q8_0.gguf"
            tiny_dits.write_gguf(name, str(folder / file))
            out[name] = nodes.NODE_CLASS_MAPPINGS[gguf_sampling.LOADER]().load_unet(file)[0]
    return out


def gguf_weights(model) -> dict:
    """{parameter: (GGML type, sha256 of its stored blocks)} of the diffusion model."""
    return {name: (getattr(param, "tensor_type", None), digest(param.as_subclass(torch.Tensor)))
            for name, param in model.model.diffusion_model.named_parameters()}


@pytest.mark.parametrize(("name", "fmt"), [("sd35", "diffusers"), ("sd35", "kohya"), ("wan21", "kohya")])
def test_fast_hooks_on_a_gguf_dit_equal_its_loraloader(dits, engine, ggufs, name, fmt):
    import comfy.model_base

    family, floating = dits.get(name)
    model = ggufs[name]
    assert type(model.model) is getattr(comfy.model_base, family.model_class)
    before = gguf_weights(model)
    # (ComfyUI-GGUF loads F32 tensors, Wan's modulation and 5-D patch embedding, as plain tensors)
    assert {kind.name for kind, _ in before.values() if kind is not None} == {"Q8_0", "F16"}, before
    lora = lora_of(family, floating, fmt)
    plain = sample(family, model)
    expected = sample(family, arch_sampling.load_lora(model, lora, STRENGTH))  # added at dequantize time
    effect = effect_of(expected, plain, f"{name} Q8_0 {fmt}")
    print(f"{name} Q8_0: noise {(plain - sample(family, floating)).abs().max().item() / effect:.2g} x effect")
    actual = claimed_sample(engine, family, model, arch_sampling.hook_lora(lora, STRENGTH))
    diff = (actual - expected).abs().max().item()
    assert_within(diff, EXACT_REL, effect, f"{name} Q8_0 {fmt} vs LoraLoader")
    assert gguf_weights(model) == before and not model.patches and not model.hook_patches


def test_block_weights_on_a_gguf_sd35(comfy, dits, engine, ggufs):
    """Block weights on the GGUF SD3.5 (ComfyUI-GGUF's tensors report their logical shapes, so the table
    detects sd3 from the keys): as on the float model, against ComfyUI-GGUF's LoraLoader."""
    family, floating = dits.get("sd35")
    model = ggufs["sd35"]
    before = gguf_weights(model)
    case = BLOCK_CASES["sd35", "diffusers"]
    diff, effect = block_map_diff(comfy, engine, family, model, tiny_dits.lora(family, floating), case)
    assert_within(diff, EXACT_REL, effect, "sd35 Q8_0 block map vs LoraLoader on those blocks")
    assert gguf_weights(model) == before


@pytest.mark.parametrize("name", GGUF_FAMILIES)
def test_core_hooks_fail_on_a_gguf_dit(dits, ggufs, name):
    """As the README says for SD1.5 and Flux: ComfyUI-GGUF's fake ``temp.weight`` entry stops core."""
    family, floating = dits.get(name)
    with pytest.raises(AttributeError, match="object has no attribute 'temp'"):
        sample(family, ggufs[name], arch_sampling.hook_lora(tiny_dits.lora(family, floating), STRENGTH))
