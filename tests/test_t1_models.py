"""T1: the tiny generated models (devtools/tiny_models.py) load, patch and sample in a real ComfyUI."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import shutil

import pytest
import torch
from safetensors import safe_open

pytestmark = pytest.mark.t1

KEY_MESSAGES = ("unet missing", "unet unexpected", "clip missing", "clip unexpected", "Missing VAE keys",
                "Leftover VAE keys", "left over keys")
# ComfyUI's SD1.5 text encoder owns two tensors that SD1.5 checkpoints (and its own CheckpointSave)
# leave out; ComfyUI reports them at DEBUG level only.
EXPECTED_CLIP_MISSING = "clip missing: ['clip_l.logit_scale', 'clip_l.transformer.text_projection.weight']"
PROMPT, NEGATIVE = "a photo of a red fox in the snow", "blurry"


@contextlib.contextmanager
def root_log_records(level: int = logging.DEBUG):
    """Every record ComfyUI logs (it logs on the root logger) while the block runs."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level)
    handler.emit = records.append
    root = logging.getLogger()
    previous = root.level
    root.setLevel(level)
    root.addHandler(handler)
    try:
        yield records
    finally:
        root.removeHandler(handler)
        root.setLevel(previous)


def encode(nodes, clip, text=PROMPT):
    return nodes.CLIPTextEncode().encode(clip, text)[0]


def sample(nodes, model, positive, negative, steps=10):
    """The latent of a 64x64 euler sample at CFG 7, seed 0."""
    empty = nodes.EmptyLatentImage().generate(64, 64, 1)[0]
    return nodes.KSampler().sample(model, 0, steps, 7.0, "euler", "normal", positive, negative, empty)[0]


def relative_change(new: torch.Tensor, old: torch.Tensor) -> float:
    return ((new - old).abs().mean() / old.abs().mean()).item()


def lora_modules(path) -> tuple[set[str], set[str]]:
    """kohya module names in a LoRA file: (UNet ones, text encoder ones)."""
    with safe_open(str(path), "pt") as handle:
        modules = {key.split(".", 1)[0] for key in handle.keys()}  # noqa: SIM118 (safe_open is no dict)
    unet = {m for m in modules if m.startswith("lora_unet_")}
    clip = {m for m in modules if m.startswith("lora_te_")}
    assert unet | clip == modules, f"{path.name} has modules outside lora_unet_/lora_te_"
    return unet, clip


@pytest.fixture(scope="module")
def checkpoints(comfy, models):
    """``{stem: (model, clip, vae, log records of the load)}`` through CheckpointLoaderSimple."""
    loaded = {}
    for stem, path in models.checkpoints.items():
        with root_log_records() as records:
            outputs = comfy.nodes.CheckpointLoaderSimple().load_checkpoint(path.name)
        loaded[stem] = (*outputs, records)
    return loaded


@pytest.fixture(scope="module")
def conditioning(comfy, checkpoints):
    """(positive, negative) from checkpoint a's text encoder (b and c share its weights)."""
    clip = checkpoints["patchbay-sd15-tiny-a"][1]
    return encode(comfy.nodes, clip), encode(comfy.nodes, clip, NEGATIVE)


@pytest.fixture(scope="module")
def base_one_step(comfy, checkpoints, conditioning):
    """Checkpoint a's latent after one step, to compare LoRAs against."""
    return sample(comfy.nodes, checkpoints["patchbay-sd15-tiny-a"][0], *conditioning, steps=1)["samples"]


def test_checkpoints_load_as_sd15_without_key_messages(checkpoints):
    import comfy.supported_models

    assert len(checkpoints) == 3
    for stem, (model, clip, vae, records) in checkpoints.items():
        assert type(model.model.model_config) is comfy.supported_models.SD15, stem
        assert clip is not None and vae is not None, stem
        messages = [r.getMessage() for r in records if any(m in r.getMessage() for m in KEY_MESSAGES)]
        assert messages == [EXPECTED_CLIP_MISSING], (stem, messages)
        assert not [r.getMessage() for r in records if r.levelno >= logging.WARNING], stem


def test_checkpoints_sample_a_64px_image_and_differ(comfy, checkpoints, conditioning):
    latents = {}
    for stem, (model, _, vae, _) in checkpoints.items():
        samples = sample(comfy.nodes, model, *conditioning)
        latent, image = samples["samples"], comfy.nodes.VAEDecode().decode(vae, samples)[0]
        assert latent.shape == (1, 4, 8, 8) and torch.isfinite(latent).all(), stem
        assert latent.std() > 1.0, stem
        assert image.shape == (1, 64, 64, 3) and torch.isfinite(image).all(), stem
        assert image.std() > 0.05, f"{stem} decodes to a (nearly) flat image"
        assert (image.flatten(0, 2).std(dim=0) > 0.05).all(), f"{stem}: a colour channel is flat"
        latents[stem] = latent
    a, b, c = latents.values()
    for first, second in ((a, b), (a, c), (b, c)):
        assert relative_change(first, second) > 0.1


def test_controlnet_loads_as_an_sd15_controlnet_and_moves_the_latent(comfy, models, checkpoints, conditioning,
                                                                     base_one_step):
    from comfy.cldm.cldm import ControlNet as ControlModel
    from comfy.controlnet import ControlNet

    path = models.controlnet["patchbay-sd15-tiny-controlnet"]
    with root_log_records() as records:
        control = comfy.nodes.ControlNetLoader().load_controlnet(path.name)[0]
    assert type(control) is ControlNet and type(control.control_model) is ControlModel
    assert not [r.getMessage() for r in records if r.levelno >= logging.WARNING]  # "missing controlnet keys"
    hint = torch.linspace(0, 1, 64).repeat(1, 64, 3, 1).permute(0, 1, 3, 2)  # a left-to-right ramp, BHWC
    positive, negative = comfy.nodes.ControlNetApplyAdvanced().apply_controlnet(*conditioning, control, hint,
                                                                                1.0, 0.0, 1.0)
    model = checkpoints["patchbay-sd15-tiny-a"][0]
    latent = sample(comfy.nodes, model, positive, negative, steps=1)["samples"]
    assert torch.isfinite(latent).all()
    assert 0.05 < relative_change(latent, base_one_step) < 1.0, "the ControlNet should steer, not swamp"


@pytest.mark.parametrize(
    "stem",
    ["patchbay-lora-r4", "patchbay-lora-r16", "patchbay-locon-r4", "patchbay-locon-r8",
     "patchbay-loha-r4", "patchbay-loha-r8", "patchbay-lokr-r4", "patchbay-lokr-r8"],
)
def test_lora_loads_every_key_and_changes_output(
    comfy, models, checkpoints, conditioning, base_one_step, stem, caplog
):
    model, clip, _, _ = checkpoints["patchbay-sd15-tiny-a"]
    base_positive, negative = conditioning
    path = models.loras[stem]
    unet_modules, clip_modules = lora_modules(path)
    assert len(unet_modules) >= 84 and len(clip_modules) == 72, stem  # 7 transformers x 12, 12 layers x 6

    with caplog.at_level(logging.WARNING):
        patched_model, patched_clip = comfy.nodes.LoraLoader().load_lora(model, clip, path.name, 1.0, 1.0)
        positive = encode(comfy.nodes, patched_clip)
        latent = sample(comfy.nodes, patched_model, positive, negative, steps=1)["samples"]
    assert not caplog.records, [r.getMessage() for r in caplog.records]  # "lora key not loaded", "ERROR ..."
    assert len(patched_model.patches) == len(unet_modules)
    assert len(patched_clip.patcher.patches) == len(clip_modules)
    assert not model.patches and not clip.patcher.patches, "LoraLoader changed its input"

    latent_change = relative_change(latent, base_one_step)
    cond_change = relative_change(positive[0][0], base_positive[0][0])
    # Visible but not destructive: the LoRAs move the one-step latent by 28-46% and the conditioning
    # by ~12%; checkpoint b instead of a moves that latent by ~110%.
    assert torch.isfinite(latent).all()
    assert 0.1 < latent_change < 0.7, f"{stem} changes the one-step latent by {latent_change:.0%}"
    assert 0.03 < cond_change < 0.4, f"{stem} changes the conditioning by {cond_change:.0%}"


@pytest.mark.once
def test_manifest_heals_corrupt_files_and_catches_nondeterminism(models, tmp_path):
    """A corrupted copy is regenerated byte for byte; a file that cannot match its sum is an error.

    Works on symlinks and copies in tmp_path: the shared cache is only read. Run once: the healing is
    devtools/tiny_models.py's; that every version generates the same bytes is
    test_t1_tiny_models_manifest's.
    """
    import tiny_models

    corrupt, pinned = "loras/patchbay-lokr-r4.safetensors", "loras/patchbay-lokr-r8.safetensors"
    for rel in tiny_models.all_rels():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).symlink_to(models.root / rel)
    (tmp_path / corrupt).unlink()
    shutil.copyfile(models.root / corrupt, tmp_path / corrupt)
    with open(tmp_path / corrupt, "r+b") as handle:
        handle.seek(-16, 2)
        handle.write(bytes(16))
    manifest = tmp_path / "models.sha256"
    wrong = hashlib.sha256(b"not the file").hexdigest()
    lines = tiny_models.MANIFEST.read_text().splitlines(keepends=True)
    manifest.write_text("".join(f"{wrong}  {pinned}\n" if pinned in line else line for line in lines))

    with pytest.raises(tiny_models.ModelDeterminismError, match="no longer deterministic") as error:
        tiny_models.ensure_models(tmp_path, manifest=manifest, store=None)  # regenerated, not linked
    assert pinned in str(error.value) and corrupt not in str(error.value)
    assert "--update-manifest" in str(error.value)
    assert (tmp_path / corrupt).read_bytes() == (models.root / corrupt).read_bytes()
    assert (models.root / pinned).resolve() != (tmp_path / pinned).resolve(), "the shared file was replaced"
