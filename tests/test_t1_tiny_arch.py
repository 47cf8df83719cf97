"""T1: the tiny SDXL and Flux files (devtools/tiny_arch.py) are what ComfyUI's own loaders take them for.

UNETLoader detects them as SDXL-family / Flux and builds ``comfy.model_base.SDXL`` / ``Flux`` with no
missing or unexpected keys; LoraLoaderModelOnly maps every key of every LoRA file; devtools/arch_sampling.py
samples them deterministically.
"""

from __future__ import annotations

import logging

import arch_sampling
import pytest
import tiny_arch
import torch

pytestmark = pytest.mark.t1

KEY_MESSAGES = ("missing", "unexpected", "left over", "not loaded", "NOT LOADED")
ALL_LORAS = [("sdxl", name) for name in arch_sampling.SDXL_LORAS] + [
    ("flux", name)
    for name in (*arch_sampling.FLUX_LORAS, arch_sampling.FLUX_BFL_LORA, arch_sampling.FLUX_BFL_KEEP_LORA)
]


def test_unet_files_are_detected_as_sdxl_and_flux(comfy):
    import comfy.model_base
    import comfy.supported_models

    loaded = {}
    for arch in arch_sampling.ARCHES:  # a load of its own: the log of the shared one may be gone
        with arch_sampling.logged(level=logging.INFO) as records:
            loaded[arch] = arch_sampling.load_model(arch)
        messages = [r.getMessage() for r in records]
        assert not [m for m in messages if any(k in m for k in KEY_MESSAGES)], messages
    sdxl, flux = loaded["sdxl"], loaded["flux"]
    assert type(sdxl.model) is comfy.model_base.SDXL
    assert type(sdxl.model.model_config) is comfy.supported_models.KOALA_700M  # a subclass of SDXL's
    assert type(flux.model) is comfy.model_base.Flux
    assert type(flux.model.model_config) is comfy.supported_models.Flux
    for model, config in ((sdxl, tiny_arch.SDXL_UNET), (flux, tiny_arch.FLUX_DIT)):
        detected = model.model.model_config.unet_config
        assert {key: detected[key] for key in config} == config
        assert model.model.get_dtype() == torch.float32  # what the CPU runs: fp16 files are upcast


@pytest.mark.parametrize(("arch", "lora_name"), ALL_LORAS)
def test_loraloader_loads_every_lora_key(comfy, arch, lora_name):
    model = arch_sampling.shared_model(arch)
    keys = arch_sampling.lora_state_dict(lora_name).keys()
    with arch_sampling.logged() as records:
        patched = arch_sampling.load_lora(model, lora_name, 1.0)
    assert not [r.getMessage() for r in records]  # "lora key not loaded: ...", "NOT LOADED ..."
    # One patch per low-rank pair, plus (BFL) one per bias delta and one per replaced norm scale.
    counted = (".lora_down.weight", ".lora_A.weight", ".lora_B.bias", "_norm.scale")
    expected = sum(key.endswith(counted) for key in keys)
    assert sum(len(patches) for patches in patched.patches.values()) == expected
    assert not model.patches, "LoraLoader changed its input"


def test_sampling_is_deterministic_and_sane(comfy):
    for arch in arch_sampling.ARCHES:
        model = arch_sampling.shared_model(arch)
        positive, negative = arch_sampling.make_cond(arch, 1), arch_sampling.make_cond(arch, 2)
        latent = arch_sampling.sample(model, positive, negative, seed=0, steps=2)
        channels, size = (4, 16) if arch == "sdxl" else (16, 8)
        assert latent.shape == (1, channels, size, size) and torch.isfinite(latent).all(), arch
        assert latent.std() > 0.5, arch
        if arch == "sdxl":  # Flux's determinism is asserted bit for bit in test_t1_core_hooks_arch.py
            assert torch.equal(arch_sampling.sample(model, positive, negative, seed=0, steps=2), latent)
            assert not torch.equal(arch_sampling.sample(model, positive, negative, seed=1, steps=2), latent)
