"""Tiny SD1.5 checkpoints and LoRA files that a real ComfyUI loads, made deterministically in seconds.

No weights can be downloaded where the tests run, so tests and demos use these instead:

- ``checkpoints/patchbay-sd15-tiny-{a,b,c}.safetensors``: the SD1.5 architecture in the original LDM
  key layout (what ComfyUI's CheckpointSave writes), detected as ``SD15``. The UNet keeps
  model_channels 320 and context_dim 768 (detection needs them) but has two levels of one res block
  and one transformer block each; a, b and c differ only in their UNet. The CLIP-L text encoder and
  the VAE are full size and shared.
- ``loras/``: kohya-named LoRA, LoCon, LoHa and LoKr files, two ranks each.
- ``diffusion_models/`` and more ``loras/``: tiny SDXL and Flux models and their LoRAs, made by
  devtools/tiny_arch.py (which imports this module) and covered by the same manifest.
- ``diffusion_models/*.gguf``: the SD1.5 UNet of ``a`` and the Flux model quantized to Q8_0 and Q4_K,
  as ComfyUI-GGUF's tools lay them out (devtools/tiny_gguf.py; made from the files above).
- ``diffusion_models/*-fp8{mixed,scaled}.safetensors``: the same UNet in ComfyUI's own fp8 formats
  (devtools/tiny_quant.py).
- ``controlnet/``: a tiny SD1.5 ControlNet for these checkpoints, made by devtools/tiny_controlnet.py.
- ``vae/``, more ``diffusion_models/`` and ``loras/``: Wan 2.2 14B's two experts, two Wan LoRAs and a
  Wan 2.1 VAE for the two-stage workflow, made by devtools/tiny_wan.py.

Key names and shapes come from ComfyUI's own classes built on the ``meta`` device, and LoRA module
names from ``comfy.lora``'s key maps. Weights are uniform with a fan-in-scaled std (norms 1,
biases 0); at strength 1 a LoRA moves every weight it patches by LORA_REL of that scale. Every
tensor comes from its own PCG64 stream, seeded by the file's seed and the key name, through exact
float arithmetic only, so files are byte-identical on every machine. ``models.sha256`` next to
this file pins their sums; ``ensure_models`` reuses files that match it, links those it lacks from
the store shared by this machine's clones (``devpaths.models_store()``: files named by their sha256,
so only pinned content is ever linked), regenerates the rest and fails loudly when regeneration no
longer matches.

Generation imports ComfyUI (in CPU mode), so ``ensure_models`` runs it in a child process and the
caller's ComfyUI state stays untouched. CLI: ``python devtools/tiny_models.py [--out DIR]
[--update-manifest]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import devpaths
import numpy as np
import torch
from tiny_weights import MODULE_BUILDERS, LoraSpec, Tensors, uniform

MANIFEST = Path(__file__).with_name("models.sha256")
DETERMINISM_EXIT_CODE = 3
CHECKPOINT_VARIANTS = ("a", "b", "c")

# Initialisation: weights uniform with std GAIN / sqrt(fan_in); LoRA deltas are LORA_REL times that.
GAIN = 1.0
EMBEDDING_STD = 1.0
LORA_REL = 0.06

# The UNet as ComfyUI's detection (comfy/model_detection.py) reports it for our files; SD15 adds
# num_heads 8 to it. Everything except the first row is smaller than the real SD1.5.
TINY_UNET = {
    "use_checkpoint": False, "image_size": 32, "use_spatial_transformer": True, "legacy": False,
    "adm_in_channels": None, "in_channels": 4, "out_channels": 4, "model_channels": 320,
    "num_res_blocks": [1, 1], "transformer_depth": [1, 1], "transformer_depth_output": [1, 1, 1, 1],
    "channel_mult": [1, 2], "transformer_depth_middle": 1, "use_linear_in_transformer": False,
    "context_dim": 768, "use_temporal_resblock": False, "use_temporal_attention": False,
}
SD_VAE = {
    "double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
    "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0,
}
# kohya targets: linears (and 1x1 proj convs) of the UNet's transformers, all the text encoder's
# attention/MLP linears; LoCon, LoHa and LoKr add the res blocks and the down/up-sampling convs.
ATTENTION_SUFFIXES = ("_to_q", "_to_k", "_to_v", "_to_out_0", "_ff_net_0_proj", "_ff_net_2", "_proj_in",
                      "_proj_out")
CONV_SUFFIXES = ("_conv1", "_conv2", "_conv_shortcut", "_time_emb_proj", "samplers_0_conv")
SAFETENSORS_DTYPES = {torch.float16: "F16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3"}
_NO_NUMPY = (torch.float8_e4m3fn,)  # written as their bytes


STORE = Path("<devpaths.models_store()>")  # ensure_models' default store, resolved when it is called


class ModelDeterminismError(RuntimeError):
    """A freshly generated file does not match its sum in the manifest."""


LORAS = (
    LoraSpec("patchbay-lora-r4", "lora", 4), LoraSpec("patchbay-lora-r16", "lora", 16),
    LoraSpec("patchbay-locon-r4", "locon", 4), LoraSpec("patchbay-locon-r8", "locon", 8),
    LoraSpec("patchbay-loha-r4", "loha", 4), LoraSpec("patchbay-loha-r8", "loha", 8),
    LoraSpec("patchbay-lokr-r4", "lokr", 4), LoraSpec("patchbay-lokr-r8", "lokr", 8, decompose_both=True),
)
# what most tests sample: checkpoint a and its plain kohya LoRA (tests/conftest.py ``sd15``)
SD15_CHECKPOINT = f"patchbay-sd15-tiny-{CHECKPOINT_VARIANTS[0]}.safetensors"
SD15_LORA = f"{LORAS[0].name}.safetensors"


@dataclass(frozen=True)
class TinyModels:
    """The generated files, by stem: ``checkpoints["patchbay-sd15-tiny-a"]``, ``loras["patchbay-lora-r4"]``,
    ``diffusion_models["patchbay-flux-tiny"]``, ``controlnet["patchbay-sd15-tiny-controlnet"]``.

    ``root`` holds ``checkpoints/``, ``loras/``, ``diffusion_models/`` and ``controlnet/``; ComfyUI's
    loaders take ``path.name``.
    """

    root: Path
    checkpoints: dict[str, Path]
    loras: dict[str, Path]
    diffusion_models: dict[str, Path] = field(default_factory=dict)
    controlnet: dict[str, Path] = field(default_factory=dict)
    vae: dict[str, Path] = field(default_factory=dict)


def checkpoint_rel(variant: str) -> str:
    return f"checkpoints/patchbay-sd15-tiny-{variant}.safetensors"


def lora_rel(spec: LoraSpec) -> str:
    return f"loras/{spec.name}.safetensors"


def all_rels() -> list[str]:
    import tiny_arch  # imported late: these build on this module
    import tiny_controlnet
    import tiny_gguf
    import tiny_quant
    import tiny_wan

    sd15 = [checkpoint_rel(v) for v in CHECKPOINT_VARIANTS] + [lora_rel(s) for s in LORAS]
    # GGUF and quantized last: made from the others
    made_from = tiny_gguf.all_rels() + tiny_quant.all_rels()
    return sd15 + tiny_arch.all_rels() + tiny_controlnet.all_rels() + tiny_wan.all_rels() + made_from


def ensure_models(out_dir: Path, manifest: Path = MANIFEST, store: Path | None = STORE) -> TinyModels:
    """Return the tiny models in ``out_dir``, generating missing or stale files first.

    Files whose sha256 matches ``manifest`` are reused. The others are hard-linked from ``store``
    (default ``devpaths.models_store()``, shared by the clones on this machine; None: no store) where it
    holds their pinned content, else regenerated in a child process (ComfyUI is imported there, never
    here) and must then match; if one does not, ``ModelDeterminismError`` names it and says what to do.
    Files the store lacks (generated here, or by a clone from before the store) are linked into it.
    """
    out_dir = Path(out_dir)
    store = devpaths.models_store() if store is STORE else store
    sums = read_manifest(manifest)
    missing = stale = stale_files(out_dir, sums, all_rels())
    if stale and store is not None:
        stale = link_from_store(store, out_dir, sums, missing)
        if len(stale) < len(missing):
            print(f"linked {len(missing) - len(stale)} tiny models from {store}", file=sys.stderr)
    if stale:
        _run_generator(out_dir, manifest, stale)
        if mismatched := stale_files(out_dir, sums, stale):
            raise ModelDeterminismError(_determinism_message(mismatched, manifest))
    if store is not None:
        keep_in_store(store, out_dir, sums, [rel for rel in all_rels()
                                             if not (store / _store_name(rel, sums[rel])).is_file()])
    by_folder: dict[str, dict[str, Path]] = {}
    for rel in all_rels():
        folder, name = rel.split("/")
        by_folder.setdefault(folder, {})[Path(name).stem] = out_dir / rel
    return TinyModels(root=out_dir, **by_folder)


def read_manifest(manifest: Path) -> dict[str, str]:
    """``{relative path: sha256}`` from a sha256sum-format file that covers every generated file."""
    if not manifest.is_file():
        raise FileNotFoundError(f"{manifest} is missing: write it with '{__file__} --update-manifest'.")
    sums = {}
    for line in manifest.read_text().splitlines():
        if line.strip():
            digest, rel = line.split(maxsplit=1)
            sums[rel.lstrip("*")] = digest
    if missing := sorted(set(all_rels()) - set(sums)):
        raise ModelDeterminismError(f"{manifest} lacks {missing}: run {__file__} --update-manifest.")
    return sums


DIGESTS = ".sha256-by-stat.json"  # in the models folder: {rel: [size, mtime_ns, ctime_ns, inode, sha256]}


def stale_files(out_dir: Path, sums: dict[str, str], rels: Iterable[str]) -> list[str]:
    """Those of ``rels`` (paths below ``out_dir``) that are missing or whose sha256 is not in ``sums``.

    A file's digest is remembered with its size, inode and modification and change times (the change
    time moves on every write and cannot be set back), so a file nobody wrote since it was last hashed
    is not read again: every pytest session and server checks the ~5 GB of models, ~5 s of hashing.
    """
    known = _read_digests(out_dir)
    stale, seen = [], {}
    for rel in rels:
        path = out_dir / rel
        if not path.is_file():
            stale.append(rel)
            continue
        stat = path.stat()
        key = [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]
        entry = known.get(rel)
        digest = entry[4] if entry and entry[:4] == key else sha256(path)
        seen[rel] = [*key, digest]
        if digest != sums[rel]:
            stale.append(rel)
    if any(known.get(rel) != entry for rel, entry in seen.items()):
        _write_digests(out_dir, {**known, **seen})
    return stale


def _store_name(rel: str, digest: str) -> str:
    return digest + Path(rel).suffix


def link_from_store(store: Path, out_dir: Path, sums: dict[str, str], rels: Iterable[str]) -> list[str]:
    """Hard-link each of ``rels`` whose pinned content ``store`` holds into ``out_dir``; return the others.

    A store file is used only if it still hashes to its name (the same stat-keyed digests as
    ``stale_files``: a file written in place since it was hashed is hashed again, and dropped from the
    store if it no longer matches). The link replaces the old file atomically, and the digests of both
    folders are refreshed with the linked inode's new change time, so neither is read again (other
    clones linked to the same file hash it once more: a new link changes its change time). Where a link
    is impossible (another file system) the file is copied.
    """
    rels = list(rels)
    names = {rel: _store_name(rel, sums[rel]) for rel in rels}
    if not store.is_dir():
        return rels
    held = {name: name.split(".")[0] for name in set(names.values()) if (store / name).is_file()}
    for name in stale_files(store, held, list(held)):
        (store / name).unlink(missing_ok=True)  # changed in place since it was stored
        del held[name]
    linked = [rel for rel in rels if names[rel] in held]
    for rel in linked:
        _link(store / names[rel], out_dir / rel)
    _remember(store, {names[rel]: sums[rel] for rel in linked})
    _remember(out_dir, {rel: sums[rel] for rel in linked})
    return [rel for rel in rels if rel not in linked]


def keep_in_store(store: Path, out_dir: Path, sums: dict[str, str], rels: Iterable[str]) -> None:
    """Hard-link ``rels`` of ``out_dir``, checked against ``sums``, into ``store``, by content."""
    store.mkdir(parents=True, exist_ok=True)
    rels = list(rels)
    for rel in rels:
        _link(out_dir / rel, store / _store_name(rel, sums[rel]))
    _remember(store, {_store_name(rel, sums[rel]): sums[rel] for rel in rels})
    _remember(out_dir, {rel: sums[rel] for rel in rels})


def _link(source: Path, target: Path) -> None:
    """``target`` becomes ``source``'s inode (a copy across file systems), replaced atomically."""
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.link")
    temporary.unlink(missing_ok=True)
    try:
        os.link(source, temporary)
    except OSError:
        shutil.copyfile(source, temporary)
    os.replace(temporary, target)


def _remember(folder: Path, digests: dict[str, str]) -> None:
    """Record ``digests`` (``{relative path: sha256}``, known to be right) under the files' current stat."""
    if not digests:
        return
    known = _read_digests(folder)
    for rel, digest in digests.items():
        stat = (folder / rel).stat()
        known[rel] = [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, digest]
    _write_digests(folder, known)


def _read_digests(out_dir: Path) -> dict[str, list]:
    try:
        known = json.loads((out_dir / DIGESTS).read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _write_digests(out_dir: Path, digests: dict[str, list]) -> None:
    """Written to a temporary file and renamed: sessions side by side never read half a file."""
    if not out_dir.is_dir():
        return
    with tempfile.NamedTemporaryFile("w", dir=out_dir, prefix=DIGESTS, suffix=".tmp", delete=False) as handle:
        json.dump(digests, handle)
    os.replace(handle.name, out_dir / DIGESTS)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def _determinism_message(rels: Iterable[str], manifest: Path) -> str:
    return (
        f"freshly generated {', '.join(rels)} do not match {manifest}: tiny model generation is no "
        "longer deterministic (fix devtools/tiny_models.py), or it was changed on purpose and the "
        "manifest must be refreshed with 'python devtools/tiny_models.py --update-manifest'."
    )


def _run_generator(out_dir: Path, manifest: Path, rels: list[str]) -> None:
    command = [sys.executable, __file__, "--out", str(out_dir), "--manifest", str(manifest), "--only", *rels]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode == DETERMINISM_EXIT_CODE:
        prefix = "tiny_models: "
        message = next(line for line in reversed(result.stderr.splitlines()) if line.startswith(prefix))
        raise ModelDeterminismError(message.removeprefix(prefix))
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr[-4000:]}")
    sys.stderr.write(result.stdout)


# --- generation: runs in the child process, which imports ComfyUI ----------------------------------


def init_module(module: torch.nn.Module, prefix: str, seed: str) -> dict[str, torch.Tensor]:
    """Deterministic weights for every parameter of a meta-device ``module``, keyed ``prefix + name``."""
    out = {}
    for module_name, sub in module.named_modules():
        for name, param in sub.named_parameters(recurse=False):
            key = prefix + (f"{module_name}.{name}" if module_name else name)
            out[key] = _init_param(sub, name, tuple(param.shape), f"{seed}/{key}")
    return out


def _init_param(module: torch.nn.Module, name: str, shape: tuple[int, ...], seed: str) -> torch.Tensor:
    """Norm weights and (RMSNorm) scales 1, biases 0, embeddings EMBEDDING_STD, others GAIN / sqrt(fan_in)."""
    if name == "scale" or (isinstance(module, torch.nn.RMSNorm) and name == "weight"):  # Flux's RMSNorm
        return torch.ones(shape, dtype=torch.float16)
    if isinstance(module, (torch.nn.LayerNorm, torch.nn.GroupNorm)) and name == "weight":
        return torch.ones(shape, dtype=torch.float16)
    if isinstance(module, (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.Linear, torch.nn.Conv2d,
                           torch.nn.Conv3d)):
        if name == "bias":
            return torch.zeros(shape, dtype=torch.float16)
        return uniform(seed, shape, GAIN / math.sqrt(math.prod(shape[1:])))
    if isinstance(module, torch.nn.Embedding):
        return uniform(seed, shape, EMBEDDING_STD)
    if name == "modulation":  # Wan's per-block shift/scale/gate table, added to the time embedding
        return uniform(seed, shape, GAIN / math.sqrt(shape[-1]))
    kind = f"{type(module).__name__}.{name}"
    raise TypeError(f"no initialisation rule for {seed} ({kind}); add one to _init_param.")


def import_comfy_on_cpu() -> None:
    """Put ComfyUI on sys.path in CPU mode: the generator only builds meta-device models, never a GPU."""
    comfy_dir = str(devpaths.comfyui_dir())
    if comfy_dir not in sys.path:
        sys.path.insert(0, comfy_dir)
    from comfy.cli_args import args

    args.cpu = True


class ComfyArch:
    """ComfyUI's SD1.5 classes on the meta device, and the key layouts generation derives from them."""

    def __init__(self) -> None:
        import_comfy_on_cpu()
        import comfy.lora
        import comfy.model_detection
        import comfy.sd1_clip
        import comfy.supported_models
        from comfy.ldm.models.autoencoder import AutoencoderKL

        self.config = comfy.supported_models.SD15(TINY_UNET)
        with torch.device("meta"):
            self.model = self.config.get_model({}, device="meta")
            self.clip = comfy.sd1_clip.SD1ClipModel(device="meta")
            self.vae = AutoencoderKL(ddconfig=SD_VAE, embed_dim=4)
        self.layout = {  # what ComfyUI's CheckpointSave would write for this model
            **self.config.process_unet_state_dict_for_saving(self.model.diffusion_model.state_dict()),
            **self.config.process_clip_state_dict_for_saving(self.clip.state_dict()),
            **self.config.process_vae_state_dict_for_saving(self.vae.state_dict()),
        }
        detected = comfy.model_detection.model_config_from_unet(self.layout, "model.diffusion_model.")
        if type(detected) is not comfy.supported_models.SD15:
            raise RuntimeError(f"ComfyUI detects TINY_UNET as {type(detected).__name__}, not SD15: fix it.")
        self.lora_targets = self._kohya_targets(comfy.lora)
        self._shared: Tensors | None = None

    def _kohya_targets(self, lora: types.ModuleType) -> dict[str, tuple[int, ...]]:
        """kohya module name -> weight shape, from comfy.lora's key maps (diffusers-style UNet names).

        The UNet map holds LDM-style and diffusers-style ``lora_unet_`` names, and diffusers names
        for blocks this UNet lacks (label_emb, a last-level downsampler); kohya writes the
        diffusers-style names of weights that exist.
        """
        weights = {**self.model.state_dict(), **self.clip.state_dict()}
        unet = lora.model_lora_keys_unet(self.model, {})
        clip = lora.model_lora_keys_clip(self.clip, {})
        start, end = len("diffusion_model."), -len(".weight")
        ldm_style = {"lora_unet_" + key[start:end].replace(".", "_") for key in unet.values()}
        names = {n: k for n, k in unet.items() if n.startswith("lora_unet_") and n not in ldm_style}
        names.update((n, k) for n, k in clip.items() if n.startswith("lora_te_"))
        names = {n: k for n, k in names.items() if k in weights}
        if len(set(names.values())) != len(names):
            raise RuntimeError("comfy.lora maps one weight to two kohya names; choose one in _kohya_targets.")
        return {name: tuple(weights[key].shape) for name, key in sorted(names.items())}

    def checkpoint(self, variant: str) -> Tensors:
        unet = init_module(self.model.diffusion_model, "", f"patchbay-sd15-tiny-{variant}/unet")
        tensors = {**self.config.process_unet_state_dict_for_saving(unet), **self.shared_weights()}
        if diff := sorted(tensors.keys() ^ self.layout.keys()):
            raise RuntimeError(f"generated checkpoint keys differ from ComfyUI's layout: {diff}")
        return tensors

    def shared_weights(self) -> Tensors:
        """CLIP-L and VAE weights, the same in every checkpoint (made once per process)."""
        if self._shared is None:
            text_model = self.clip.clip_l.transformer.text_model
            clip = init_module(text_model, "clip_l.transformer.text_model.", "patchbay-sd15-tiny/clip")
            vae = init_module(self.vae, "", "patchbay-sd15-tiny/vae")
            self._shared = {
                **self.config.process_clip_state_dict_for_saving(clip),
                **self.config.process_vae_state_dict_for_saving(vae),
            }
        return self._shared

    def lora(self, spec: LoraSpec) -> Tensors:
        suffixes = ATTENTION_SUFFIXES + (CONV_SUFFIXES if spec.algo != "lora" else ())
        out = {}
        for name, shape in self.lora_targets.items():
            if name.startswith("lora_te_") or name.endswith(suffixes):
                target = LORA_REL * GAIN / math.sqrt(math.prod(shape[1:]))
                out.update(MODULE_BUILDERS[spec.algo](name, shape, spec, target, f"{spec.name}/{name}"))
                out[f"{name}.alpha"] = torch.tensor(spec.alpha, dtype=torch.float16)
        return out

    def build(self, rel: str) -> tuple[Tensors, dict[str, str]]:
        """Tensors and safetensors metadata of the file at ``rel``."""
        for variant in CHECKPOINT_VARIANTS:
            if rel == checkpoint_rel(variant):
                return self.checkpoint(variant), model_metadata(Path(rel).stem, "stable-diffusion-v1")
        spec = next(s for s in LORAS if lora_rel(s) == rel)
        metadata = model_metadata(spec.name, "stable-diffusion-v1/lora")
        return self.lora(spec), {**metadata, **kohya_metadata(spec)}


def model_metadata(
    title: str, architecture: str, generator: str = "devtools/tiny_models.py"
) -> dict[str, str]:
    """modelspec keys and the generator's path (relative: the bytes must not depend on the clone)."""
    return {
        "modelspec.sai_model_spec": "1.0.0", "modelspec.architecture": architecture,
        "modelspec.title": title, "patchbay.generator": generator,
    }


def kohya_metadata(spec: LoraSpec) -> dict[str, str]:
    """The ``ss_*`` keys kohya's sd-scripts (networks.lora) and LyCORIS (lycoris.kohya) write."""
    args = {"conv_dim": str(spec.rank), "conv_alpha": str(spec.alpha)} if spec.algo != "lora" else {}
    if spec.algo in ("loha", "lokr"):
        args["algo"] = spec.algo
    if spec.algo == "lokr":
        args.update(factor="-1", decompose_both=str(spec.decompose_both))
    return {
        "ss_network_module": "lycoris.kohya" if "algo" in args else "networks.lora",
        "ss_network_dim": str(spec.rank), "ss_network_alpha": str(spec.alpha),
        **({"ss_network_args": json.dumps(args, sort_keys=True)} if args else {}),
        "ss_base_model_version": "sd_v1", "ss_output_name": spec.name,
    }


def write_safetensors(path: Path, tensors: Tensors, metadata: dict[str, str]) -> str:
    """Write a .safetensors file with sorted keys and return its sha256.

    Byte-stable (safetensors' own writer orders metadata at random) and written to a temporary
    name renamed into place, so no reader ever sees half a file.
    """
    header: dict = {"__metadata__": dict(sorted(metadata.items()))}
    arrays, offset = [], 0
    for key in sorted(tensors):
        tensor = tensors[key].contiguous()
        array = (tensor.view(torch.uint8) if tensor.dtype in _NO_NUMPY else tensor).numpy()
        array = array.astype(array.dtype.newbyteorder("<"), copy=False)
        end = offset + array.nbytes
        header[key] = {"dtype": SAFETENSORS_DTYPES[tensors[key].dtype], "shape": list(array.shape),
                       "data_offsets": [offset, end]}
        arrays.append(array)
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    digest = hashlib.sha256()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as handle:
        chunks = (len(text).to_bytes(8, "little") + text, *(a.reshape(-1).view(np.uint8) for a in arrays))
        try:
            for chunk in chunks:
                handle.write(chunk)
                digest.update(chunk)
        except BaseException:
            os.unlink(handle.name)
            raise
    os.chmod(handle.name, 0o644)  # NamedTemporaryFile makes it private
    os.replace(handle.name, path)
    return digest.hexdigest()


def generate(
    out_dir: Path, manifest: Path, update_manifest: bool = False, only: list[str] | None = None
) -> None:
    """Generate ``only`` these files, else the missing or stale ones, and check their sums.

    With ``update_manifest``, generate every file and write the sums to ``manifest`` instead.
    """
    start = time.perf_counter()
    sums = {} if update_manifest else read_manifest(manifest)
    if update_manifest or only is None:
        todo = all_rels() if update_manifest else stale_files(out_dir, sums, all_rels())
    else:
        todo = only
    builders: dict[str, object] = {}
    fresh, reused = {}, 0
    for rel in all_rels():
        if rel in todo:
            fresh[rel] = _write(out_dir, rel, _builder(rel, builders))
        elif not (out_dir / rel).is_file():  # --only into a folder without the others
            continue
        else:
            reused += 1
        size = (out_dir / rel).stat().st_size / 2**20
        print(f"{'generated' if rel in todo else 'reused   '} {rel} ({size:.1f} MiB)")
    if update_manifest:
        temporary = manifest.with_name(manifest.name + ".tmp")
        temporary.write_text("".join(f"{fresh[rel]}  {rel}\n" for rel in sorted(fresh)))
        os.replace(temporary, manifest)
        print(f"wrote {manifest}")
    elif bad := [rel for rel in todo if fresh[rel] != sums[rel]]:
        raise ModelDeterminismError(_determinism_message(bad, manifest))
    seconds = time.perf_counter() - start
    print(f"{len(todo)} generated, {reused} reused in {out_dir} ({seconds:.1f} s)")


def _write(out_dir: Path, rel: str, builder) -> str:
    """Generate ``out_dir / rel`` with ``builder`` and return its sha256."""
    if hasattr(builder, "write"):  # GGUF and quantized files: made from files written before them
        return builder.write(out_dir, rel)
    return write_safetensors(out_dir / rel, *builder.build(rel))


def _builder(rel: str, made: dict[str, object]):
    """ComfyArch for the SD1.5 files, tiny_arch.ArchModels for SDXL and Flux, tiny_controlnet's for the
    ControlNet, tiny_wan.WanModels for the Wan 2.2 files, tiny_gguf.GgufModels for the GGUF files,
    tiny_quant.QuantModels for ComfyUI's quantized ones; each made once, when needed."""
    import tiny_arch
    import tiny_controlnet
    import tiny_gguf
    import tiny_quant
    import tiny_wan

    kinds = {"gguf": (tiny_gguf.all_rels(), tiny_gguf.GgufModels),
             "quant": (tiny_quant.all_rels(), tiny_quant.QuantModels),
             "arch": (tiny_arch.all_rels(), tiny_arch.ArchModels),
             "controlnet": (tiny_controlnet.all_rels(), tiny_controlnet.ControlNetModels),
             "wan": (tiny_wan.all_rels(), tiny_wan.WanModels)}
    kind = next((name for name, (rels, _) in kinds.items() if rel in rels), "sd15")
    if kind not in made:
        made[kind] = kinds[kind][1]() if kind in kinds else ComfyArch()
    return made[kind]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=devpaths.models_dir(), help="default: %(default)s")
    parser.add_argument("--manifest", type=Path, default=MANIFEST, help="default: %(default)s")
    parser.add_argument("--update-manifest", action="store_true",
                        help="regenerate every file and write the sums (after a deliberate change)")
    parser.add_argument("--only", nargs="+", choices=all_rels(), metavar="REL",
                        help="regenerate just these files and hash no others (what ensure_models runs)")
    options = parser.parse_args(argv)
    if options.only and options.update_manifest:
        parser.error("--update-manifest regenerates every file: drop --only")
    try:
        if options.only or options.update_manifest:
            generate(options.out, options.manifest, options.update_manifest, options.only)
        else:  # what make test runs: the store's files where it has them, the rest generated
            models = ensure_models(options.out, options.manifest)
            print(f"tiny models ready in {models.root}")
    except ModelDeterminismError as error:
        print(f"tiny_models: {error}", file=sys.stderr)
        return DETERMINISM_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
