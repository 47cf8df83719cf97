"""T1: a LoRA extracted by merge/extract.py loads in ComfyUI's LoraLoader without a warning and adds
the delta it was extracted from, exactly where the delta has low rank, up to the SVD truncation
error elsewhere; and LoRA files used as merge inputs (merge/lora.py) add what LoraLoader adds."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import save_file

pytestmark = pytest.mark.t1

UNET = "model.diffusion_model."
CLIP = "cond_stage_model.transformer."
LOW_RANK = {UNET + "input_blocks.1.0.in_layers.2.weight": 3,  # 3x3 convolution
            CLIP + "text_model.encoder.layers.0.self_attn.q_proj.weight": 4}
FULL_RANK = (UNET + "input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight",  # linear 320x768
             UNET + "input_blocks.1.1.proj_in.weight")  # 1x1 convolution
DROPPED = UNET + "input_blocks.1.0.in_layers.2.bias"
RANK = 8


@pytest.fixture(scope="module")
def extracted(merge_library, comfy, models, tmp_path_factory):
    """(LoRA path, deltas) for subtract(tuned, base) over a few keys of tiny checkpoint a."""
    extract = merge_library.extract
    io = merge_library.io
    R = merge_library.recipe

    folder = tmp_path_factory.mktemp("extract")
    checkpoint = io.SafetensorsFile(models.checkpoints["patchbay-sd15-tiny-a"])
    gen = torch.Generator().manual_seed(0)
    base, tuned, deltas = {}, {}, {}
    for key in (*LOW_RANK, *FULL_RANK, DROPPED):
        weight = checkpoint.read(key).float()
        flat = (weight.shape[0], weight[0].numel())
        if key in LOW_RANK:
            delta = torch.randn(flat[0], LOW_RANK[key], generator=gen) @ torch.randn(LOW_RANK[key], flat[1],
                                                                                     generator=gen)
        else:
            delta = torch.randn(flat if weight.dim() > 1 else flat[:1], generator=gen)
        deltas[key] = (delta * weight.std() * 0.05).reshape(weight.shape)
        base[key], tuned[key] = weight, weight + deltas[key]
    save_file(base, str(folder / "base.safetensors"))
    save_file(tuned, str(folder / "tuned.safetensors"))
    loras = folder / "loras"
    loras.mkdir()
    out = loras / "patchbay-extracted.safetensors"
    recipe = R.subtract(R.model(str(folder / "tuned.safetensors")), R.model(str(folder / "base.safetensors")))
    report = extract.extract_lora(recipe, out, extract.ExtractOptions(rank=RANK, dtype="fp32"))
    assert report.modules == 4 and DROPPED not in report.ranks
    comfy.folder_paths.add_model_folder_path("loras", str(loras))
    yield out, deltas
    comfy.folder_paths.folder_names_and_paths["loras"][0].remove(str(loras))


def test_extracted_lora_loads_without_warnings_and_adds_the_truncated_delta(comfy, extracted, caplog):
    path, deltas = extracted
    model, clip, _ = comfy.nodes.CheckpointLoaderSimple().load_checkpoint("patchbay-sd15-tiny-a.safetensors")
    with caplog.at_level(logging.WARNING):
        patched_model, patched_clip = comfy.nodes.LoraLoader().load_lora(model, clip, path.name, 1.0, 1.0)
    assert not caplog.records, [r.getMessage() for r in caplog.records]  # "lora key not loaded: ..."
    assert len(patched_model.patches) == 3 and len(patched_clip.patcher.patches) == 1
    patched = {**_patched_weights(patched_model, "diffusion_model.", UNET),
               **_patched_weights(patched_clip.patcher, "clip_l.transformer.", CLIP)}
    original = {**_patched_weights(model, "diffusion_model.", UNET),
                **_patched_weights(clip.patcher, "clip_l.transformer.", CLIP)}
    for key, delta in deltas.items():
        if key == DROPPED:
            continue
        added = patched[key].float() - original[key].float()
        scale = delta.norm()
        if key in LOW_RANK:  # rank below RANK: reproduced up to float rounding
            assert (added - delta).norm() / scale < 2e-3, key
        else:  # the best rank-8 approximation: its error is the energy of the dropped singular values
            s = torch.linalg.svdvals(delta.reshape(delta.shape[0], -1))
            expected = (s[RANK:].square().sum().sqrt() / s.square().sum().sqrt()).item()
            assert abs((added - delta).norm().item() / scale - expected) < 2e-3, key


def test_extracted_lokr_loads_without_warnings_and_adds_the_nearest_kronecker_product(merge_library, comfy,
                                                                                     extracted, caplog):
    """``kronecker_ratio`` writes a LoKr (lokr_w1, lokr_w2): ComfyUI adds kron(w1, w2), which is
    ``truncate_kronecker`` of each delta (exact SVD, same ratio)."""
    extract = merge_library.extract
    R = merge_library.recipe
    KeyContext = merge_library.context.KeyContext
    get = merge_library.method_registry.get

    path, deltas = extracted
    folder, lokr = path.parent.parent, path.with_name("patchbay-extracted-lokr.safetensors")
    recipe = R.subtract(R.model(str(folder / "tuned.safetensors")), R.model(str(folder / "base.safetensors")))
    extract.extract_lora(recipe, lokr, extract.ExtractOptions(dtype="fp32", kronecker_ratio=0.5))
    model, clip, _ = comfy.nodes.CheckpointLoaderSimple().load_checkpoint("patchbay-sd15-tiny-a.safetensors")
    with caplog.at_level(logging.WARNING):
        patched_model, patched_clip = comfy.nodes.LoraLoader().load_lora(model, clip, lokr.name, 1.0, 1.0)
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    weights = [{**_patched_weights(m, "diffusion_model.", UNET),
                **_patched_weights(c.patcher, "clip_l.transformer.", CLIP)}
               for m, c in ((patched_model, patched_clip), (model, clip))]
    for key in (*LOW_RANK, *FULL_RANK):
        nearest = get("truncate_kronecker").fn(deltas[key], kronecker_ratio=0.5, use_approximate_basis=False,
                                               ctx=KeyContext(key=key))
        added = weights[0][key].float() - weights[1][key].float()
        assert (added - nearest).norm() / nearest.norm() < 2e-3, key


def _patched_weights(patcher, prefix: str, canonical: str,
                     keys: set[str] | None = None) -> dict[str, torch.Tensor]:
    """Weights of ``keys`` (checkpoint names) with the patcher's patches applied as ComfyUI applies them."""
    import comfy.lora

    keys = keys or {*LOW_RANK, *FULL_RANK}
    wanted = {prefix + k[len(canonical):] for k in keys if k.startswith(canonical)}
    out = {}
    for key, weight in patcher.model.state_dict().items():
        if key in wanted:
            weight = weight.detach().float().clone()
            if key in patcher.patches:
                weight = comfy.lora.calculate_weight(patcher.patches[key], weight, key)
            out[canonical + key[len(prefix):]] = weight
    return out


# one file per algorithm (the LoKr one with decompose_both): the others differ only in rank
SD15_LORAS = ["patchbay-lora-r16", "patchbay-locon-r4", "patchbay-loha-r8", "patchbay-lokr-r8"]


@pytest.fixture(scope="module")
def tiny_a(comfy):
    return comfy.nodes.CheckpointLoaderSimple().load_checkpoint("patchbay-sd15-tiny-a.safetensors")[:2]


@pytest.mark.parametrize("stem", SD15_LORAS)
def test_lora_inputs_add_what_loraloader_adds(merge_library, comfy, models, tiny_a, stem):
    """merge/lora.py's delta equals ComfyUI's own patch at strength 1 (every 6th key it touches)."""
    io = merge_library.io
    lora = merge_library.lora

    checkpoint = models.checkpoints["patchbay-sd15-tiny-a"]
    source = lora.LoraSource(io.SafetensorsFile(models.loras[stem]), io.SafetensorsFile(checkpoint))
    model, clip = tiny_a
    loader = comfy.nodes.LoraLoader()
    patched_model, patched_clip = loader.load_lora(model, clip, models.loras[stem].name, 1.0, 1.0)
    keys = set(source.keys()[::6])
    original = {**_patched_weights(model, "diffusion_model.", UNET, keys),
                **_patched_weights(clip.patcher, "clip_l.transformer.", CLIP, keys)}
    patched = {**_patched_weights(patched_model, "diffusion_model.", UNET, keys),
               **_patched_weights(patched_clip.patcher, "clip_l.transformer.", CLIP, keys)}
    assert set(patched) == keys and any(k.startswith(CLIP) for k in keys)
    for key in keys:
        torch.testing.assert_close(source.delta(key), patched[key] - original[key], rtol=1e-4, atol=1e-6,
                                   msg=key)


@pytest.mark.parametrize(("config", "arch", "count"), [("sd1-ldm", "sd15", 782), ("sdxl-sgm", "sdxl", 2102)])
def test_kohya_names_equal_comfyuis_whole_unet_map(merge_library, comfy, config, arch, count):
    """merge/lora_keys.py's fixed layouts give ComfyUI's own kohya map (``model_lora_keys_unet`` on the
    config ComfyUI detects), name for name, for every weight of the real SD1.5 and SDXL UNets (key
    names and shapes from sd-mecha's model configs, as meta tensors: nothing is allocated)."""
    import types
    from pathlib import Path

    import comfy.lora
    import comfy.model_detection
    import sd_mecha
    import yaml

    io = merge_library.io
    lora_keys = merge_library.lora_keys

    spec = Path(sd_mecha.__path__[0]) / f"extensions/builtin/model_configs/{config}.yaml"
    unet = yaml.safe_load(spec.read_text())["components"]["diffuser"]
    state = {key: torch.empty(meta["shape"], device="meta") for key, meta in unet.items()}
    model_config = comfy.model_detection.model_config_from_unet(state, UNET)
    model = types.SimpleNamespace(state_dict=lambda: {key.removeprefix("model."): None for key in state},
                                  model_config=model_config)
    theirs = {name: "model." + key for name, key in comfy.lora.model_lora_keys_unet(model, {}).items()
              if name.startswith("lora_unet_") and "model." + key in state}
    infos = {key: io.TensorInfo("F16", tuple(meta["shape"]), 0, 0) for key, meta in unet.items()}
    assert io.detect_architecture(infos) == (arch, False)
    ours = lora_keys.kohya_names(list(state), arch)
    assert len(theirs) == count and ours == theirs
    modules = [key.removeprefix(UNET).removesuffix(".weight") for key in state]
    assert lora_keys.layout_for(arch, modules) is lora_keys.LAYOUTS[arch]  # the fixed one, not a detected one
