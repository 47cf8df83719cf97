"""T1: the merge nodes and the command line on the 2026 families (issue 31, item 6).

For each tiny family of devtools/tiny_dits.py that the running ComfyUI builds (Flux.2, SD3.5, Wan 2.1,
Wan 2.2 5B, HunyuanVideo 1.0, 1.5, HunyuanImage 2.1, Cosmos Predict2, LTX-Video, SD2.x; Wan, Cosmos Predict2
and LTX-Video with two blocks, so a block map can tell them apart; SD2.x's blocks are sd-mecha's IN/M/OUT
names), two variants of its diffusion model (other seeds) and a LoRA in one of its trainers' layouts that
the merge library reads (kohya, or PEFT in ComfyUI's ``diffusion_model.`` names: ai-toolkit, LTX-Video-
Trainer) are written once per module into temporary ``diffusion_models`` and ``loras`` folders. Through
the merge nodes in-process:

- weighted_sum (Merge node): the MODEL is the family's class and holds ``a + alpha (b - a)`` per key;
- a block-weighted weighted_sum (Key Patterns over the blocks merge/blocks.py counts from the file; Save
  Merge, then ComfyUI's own loader): each key holds its block's alpha;
- add_difference with the LoRA as a delta (Merge Input: LoRA): LoraLoader's patched weights at the
  same strength;
- Extract LoRA from subtract(b, a) at full rank, applied to a as LoraLoader applies it: b on every
  key a LoRA can carry (a ``.weight`` of 2+ dimensions, Conv3d patch embeddings included), within the
  reported error;
and each result samples (one step, a tiny latent, finite). The command line merges Wan 2.1 to the bytes'
values of the Merge node's model; Wan 2.1 + LTX-Video is refused before anything is written.

Flux.2 and Cosmos Predict2 are built small on ComfyUI 0.33 only (tiny_dits): not collected on 0.3.75.
"""

from __future__ import annotations

import re
from pathlib import Path

import arch_sampling
import pytest
import tiny_dits
import torch
from comfy_inprocess import InGraph
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.t1

FAMILIES = tiny_dits.families()
# tiny_dits family -> merge/architectures.py family id
ARCH_IDS = {"flux2": "flux2", "sd35": "sd3", "wan21": "wan21", "wan22_5b": "wan22_5b",
            "hunyuan10": "hunyuan_video", "hunyuan15": "hunyuan_video15", "ltxv": "ltxv",
            "hunyuan21": "hunyuan_image21", "cosmos2": "cosmos_predict2", "sd2": "sd2"}
LORA_LAYOUTS = ("kohya", "ai-toolkit", "ltx-trainer")  # the layouts merge/lora.py reads
ALPHA, STRENGTH = 0.3, 0.7
_INDEXED = re.compile(r"^((?:[a-z]+_)*blocks)\.(\d+)\.")


class Files:
    """Each family's two model files and LoRA (written once), and model a as ComfyUI loads it."""

    def __init__(self, models: Path, loras: Path) -> None:
        self.models, self.loras = models, loras
        self.families = {name: tiny_dits.deeper(tiny_dits.FAMILIES[name]) for name in FAMILIES}
        self.base: dict[str, object] = {}
        for name, family in self.families.items():
            for variant in "ab":
                save_file(tiny_dits.state_dict(family, f"-{variant}"), str(self.model(name, variant)))
            self.base[name] = load_model(self.model(name, "a"), family)
            fmt = next(f for f in family.loras if f.name in LORA_LAYOUTS)
            save_file(tiny_dits.lora(family, self.base[name], fmt), str(loras / self.lora(name)))

    def model(self, name: str, variant: str) -> Path:
        return self.models / f"pb-{name}-{variant}.safetensors"

    @staticmethod
    def lora(name: str) -> str:
        return f"pb-{name}-lora.safetensors"

    def tensors(self, name: str, variant: str) -> dict[str, torch.Tensor]:
        return {k: v.float() for k, v in load_file(str(self.model(name, variant))).items()}


def load_model(path: Path, family):
    """``path`` through UNETLoader's body (``comfy.sd.load_diffusion_model``), as the family's class."""
    import comfy.sd

    patcher = comfy.sd.load_diffusion_model(str(path))
    assert_class(patcher, family)
    return patcher


def assert_class(patcher, family) -> None:
    import comfy.model_base

    expected = getattr(comfy.model_base, family.model_class)
    assert type(patcher.model) is expected, f"{family.name}: loaded as {type(patcher.model).__name__}"


@pytest.fixture(scope="module")
def files(comfy, tmp_path_factory):
    paths = comfy.folder_paths
    models, loras = tmp_path_factory.mktemp("dit_models"), tmp_path_factory.mktemp("dit_loras")
    extensions = paths.folder_names_and_paths["loras"][1]
    with pytest.MonkeyPatch.context() as patch:  # Extract LoRA writes into the first loras folder
        patch.setitem(paths.folder_names_and_paths, "loras", ([str(loras)], extensions))
        paths.add_model_folder_path("diffusion_models", str(models))
        for folder in ("loras", "diffusion_models"):
            paths.filename_list_cache.pop(folder, None)
        try:
            yield Files(models, loras)
        finally:
            paths.folder_names_and_paths["diffusion_models"][0].remove(str(models))
            for folder in ("loras", "diffusion_models"):
                paths.filename_list_cache.pop(folder, None)


@pytest.fixture(scope="module")
def node(comfy):
    return lambda node_id: InGraph(comfy.pack.NODE_CLASS_MAPPINGS[node_id]())


def inputs(node, name: str):
    return [node("PatchbayMergeDiffusionModel").make(unet_name=f"pb-{name}-{v}.safetensors")[0] for v in "ab"]


def samples(patcher, family) -> torch.Tensor:
    """One euler step on a tiny latent: finite, of the family's latent shape."""
    positive, negative = (arch_sampling.make_cond(family.name, seed) for seed in (1, 2))
    with torch.inference_mode():
        latent = arch_sampling.sample(patcher, positive, negative, steps=1, latent_shape=family.latent)
    assert latent.shape == (1, *family.latent) and torch.isfinite(latent).all(), family.name
    return latent


def weights(patcher) -> dict[str, torch.Tensor]:
    """The diffusion model's weights with the patcher's patches applied as ComfyUI applies them."""
    import comfy.lora

    out = {}
    for key, weight in patcher.model.diffusion_model.state_dict().items():
        weight = weight.detach().float().clone()
        patches = patcher.patches.get("diffusion_model." + key)
        out[key] = comfy.lora.calculate_weight(patches, weight, key) if patches else weight
    return out


def assert_close(actual: dict, expected: dict, what: str, rtol: float = 1e-5) -> None:
    differ = sorted(actual.keys() ^ expected.keys())
    assert not differ, f"{what}: keys differ: {differ[:4]}"
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=rtol, atol=rtol * value.abs().max().item(),
                                   msg=lambda m, key=key: f"{what}: {key}: {m}")


@pytest.mark.parametrize("name", FAMILIES)
def test_weighted_sum_is_the_familys_model_with_the_blend(files, node, name):
    family = files.families[name]
    a, b = inputs(node, name)
    (recipe,) = node("PatchbayMethodWeightedSum").build(a=a, b=b, alpha=ALPHA)
    model = node("PatchbayMerge").merge(recipe, cache_mb=0)["result"][0]
    assert_class(model, family)
    ta, tb = files.tensors(name, "a"), files.tensors(name, "b")
    assert_close(weights(model), {k: ta[k] + ALPHA * (tb[k] - ta[k]) for k in ta}, f"{name} weighted_sum")
    samples(model, family)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_block_map_over_the_blocks_counted_from_the_file_sets_each_blocks_alpha(merge_library, comfy, files,
                                                                                    node, name):
    blocks = merge_library.blocks
    io = merge_library.io

    family = files.families[name]
    opened = io.SafetensorsFile(files.model(name, "a"))
    arch = opened.arch
    assert arch == ARCH_IDS[name] and opened.unet_only
    ta, tb = files.tensors(name, "a"), files.tensors(name, "b")
    names = blocks.block_names(arch, opened.canonical_keys())
    if family.unet:  # sd-mecha's fixed names (IN00, M00, OUT00, ...): those the file's keys fall in
        indexed = [n for n in names if n in {_unet_block(blocks, arch, key) for key in ta}]
        assert set(indexed) >= {"IN00", "IN01", "M00", "OUT00", "OUT01"}, indexed
    else:
        indexed = sorted({f"{m[1]}.{m[2]}" for m in map(_INDEXED.match, ta) if m})
        assert [n for n in names if n in indexed] == [n for n in names if _INDEXED.match(n + ".")] and \
            set(indexed) <= set(names), f"{name}: block names {names} vs the file's blocks {indexed}"
    assert len(indexed) >= 2, indexed
    alphas = {block: (i + 1) / (len(indexed) + 1) for i, block in enumerate(indexed)}
    text = "\n".join([*(f"{block}={value}" for block, value in alphas.items()), "default=0.05"])
    (patterns,) = node("PatchbayMergeKeyPatterns").make(text, arch)
    a, b = inputs(node, name)
    (recipe,) = node("PatchbayMethodWeightedSum").build(a=a, b=b, alpha=0.5, alpha_map=patterns)
    saved = node("PatchbayMergeSave").save(recipe, f"pb-dit/{name}-blocks", dtype="fp32", cache_mb=0)
    model = load_model(Path(saved["result"][0]), family)

    def alpha(key: str) -> float:
        if family.unet:
            return alphas.get(_unet_block(blocks, arch, key), 0.05)
        match = _INDEXED.match(key)
        return alphas[f"{match[1]}.{match[2]}"] if match else 0.05
    assert_close(weights(model), {k: ta[k] + alpha(k) * (tb[k] - ta[k]) for k in ta}, f"{name} block map")
    samples(model, family)


def _unet_block(blocks, arch: str, key: str) -> str:
    """The sd-mecha block (``blocks``: merge/blocks.py) of a diffusion-model key of a UNet file
    (``input_blocks.1.0...`` -> IN01)."""
    return blocks.block_of(arch, "model.diffusion_model." + key)


@pytest.mark.parametrize("name", FAMILIES)
def test_add_difference_with_the_familys_lora_equals_loraloader(comfy, files, node, name):
    family = files.families[name]
    a, _ = inputs(node, name)
    (delta,) = node("PatchbayMergeLora").make(lora_name=files.lora(name))
    (recipe,) = node("PatchbayMethodAddDifference").build(a=a, b=delta, alpha=STRENGTH)
    model = node("PatchbayMerge").merge(recipe, cache_mb=0)["result"][0]
    assert_class(model, family)
    with arch_sampling.logged() as unmatched:  # "lora key not loaded: ..."
        loader = comfy.nodes.LoraLoaderModelOnly()
        (patched,) = loader.load_lora_model_only(files.base[name], files.lora(name), STRENGTH)
    lora = load_file(str(files.loras / files.lora(name)))
    assert not unmatched and len(patched.patches) == sum(".lora_B." in k or ".lora_up." in k for k in lora)
    expected = weights(patched)
    changed = [k for k, v in expected.items() if not torch.equal(v, files.tensors(name, "a")[k])]
    assert len(changed) == len(patched.patches), f"{name}: the LoRA changes {len(changed)} weights"
    assert_close(weights(model), expected, f"{name} add_difference vs LoraLoader")
    samples(model, family)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_lora_extracted_at_full_rank_turns_a_into_b(comfy, files, node, name):
    family = files.families[name]
    a, b = inputs(node, name)
    (delta,) = node("PatchbayMethodSubtract").build(a=b, b=a)
    with arch_sampling.logged() as unmatched:
        shown = node("PatchbayMergeExtractLora").extract(delta, f"pb-{name}-extracted", rank=4096,
                                                         dtype="fp32", model=files.base[name])
    model, _, lora_name = shown["result"]
    assert not unmatched, [r.getMessage() for r in unmatched]
    assert lora_name == f"pb-{name}-extracted.safetensors" and (files.loras / lora_name).is_file()
    error = float(re.search(r"mean relative error (\S+)", shown["ui"]["text"][0])[1])
    assert error < 1e-5, shown["ui"]["text"]
    ta, tb = files.tensors(name, "a"), files.tensors(name, "b")
    carried = {k for k, v in ta.items() if k.endswith(".weight") and v.dim() >= 2}
    patched = {k.removeprefix("diffusion_model.") for k in model.patches}
    assert patched == carried, f"{name}: not extracted: {sorted(carried - patched)}"
    # what no LoRA carries (ComfyUI maps only 2+-dimensional .weight keys): modulation and position
    # tables, which the tiny variants do not share; biases and norms are equal in a and b
    assert_close(weights(model), {k: tb[k] if k in carried else ta[k] for k in ta}, f"{name} extracted", 1e-4)
    samples(model, family)


def test_the_command_line_merges_wan21_as_the_merge_node_does(merge_library, comfy, files, node, tmp_path):
    cli = merge_library.cli

    name, family = "wan21", files.families["wan21"]
    recipe = tmp_path / "wan.mecha"
    recipe.write_text("\n".join(["version 0.1.0", f'model "{files.model(name, "a")}"',
                                 f'model "{files.model(name, "b")}"',
                                 f'merge "weighted_sum" &0 &1 alpha={ALPHA}']))
    out = tmp_path / "wan-merged.safetensors"
    assert cli.main(["merge", str(recipe), str(out), "--dtype", "fp32", "--no-progress"]) == 0
    from_cli = load_model(out, family)
    a, b = inputs(node, name)
    (built,) = node("PatchbayMethodWeightedSum").build(a=a, b=b, alpha=ALPHA)
    in_graph = node("PatchbayMerge").merge(built, cache_mb=0)["result"][0]
    assert_close(weights(from_cli), weights(in_graph), "command line vs Merge node", 1e-6)
    torch.testing.assert_close(samples(from_cli, family), samples(in_graph, family), rtol=1e-5, atol=1e-5)


def test_wan21_and_ltxv_models_are_refused_before_anything_is_written(comfy, files, node):
    wan, ltxv = (inputs(node, name)[0] for name in ("wan21", "ltxv"))
    (recipe,) = node("PatchbayMethodWeightedSum").build(a=wan, b=ltxv, alpha=0.5)
    out = Path(comfy.folder_paths.get_output_directory()) / "pb-dit"
    before = sorted(out.glob("*")) if out.is_dir() else []
    with pytest.raises(ValueError, match=r"pb-ltxv-a.safetensors: is a ltxv model but pb-wan21-a.safetensors "
                                         r"is wan21.*architecture_policy"):
        node("PatchbayMergeSave").save(recipe, "pb-dit/wan-ltxv", dtype="fp32", cache_mb=0)
    with pytest.raises(ValueError, match="is a ltxv model but"):
        node("PatchbayMerge").merge(recipe, cache_mb=0)
    assert (sorted(out.glob("*")) if out.is_dir() else []) == before
