"""T1: a LoRA stack merged into one LoRA (merge/stack_to_lora.py through the Merge LoRA Stack node) patches
what LoraLoader patches with every LoRA of the stack applied, on the tiny SD1.5 model (LoRA, LoCon, LoHa
and LoKr in one stack): equal within float noise at the full concatenated rank, and within the reported
truncation error, module by module, at a lower rank. Weights are compared as ComfyUI patches them
(``comfy.lora.calculate_weight``); nothing is sampled."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.t1

# (LoRA, model strength, clip strength): every format, opposite signs. The node's run leaves LoKr out:
# its full w1 factor makes its joined rank up to 96 on the text encoder: 177 MB at full rank in fp32,
# written to the shared loras folder, against 38 MB without it (deleted after the test).
STACK = (("patchbay-lora-r4", 0.8, 0.5), ("patchbay-locon-r4", -0.6, -0.6), ("patchbay-loha-r4", 0.5, 0.5),
         ("patchbay-lokr-r4", 0.3, 0.3))
FULL_RANK = 24  # every module's joined rank without LoKr is at most 4 + 4 + 16 (LoHa: 4 x 4)


@pytest.fixture(scope="module")
def stacked(comfy, models):
    """(model, clip, {stack: the deltas LoraLoader adds with every LoRA of it applied, by patched key}) for
    the whole STACK and for it without LoKr."""
    model, clip, _ = comfy.nodes.CheckpointLoaderSimple().load_checkpoint("patchbay-sd15-tiny-a.safetensors")
    patched_model, patched_clip, deltas = model, clip, {}
    for n, (stem, strength_model, strength_clip) in enumerate(STACK, start=1):
        patched_model, patched_clip = comfy.nodes.LoraLoader().load_lora(
            patched_model, patched_clip, models.loras[stem].name, strength_model, strength_clip)
        if n >= len(STACK) - 1:
            deltas[n] = added(model, clip, patched_model, patched_clip)
    return model, clip, deltas


def added(model, clip, patched_model, patched_clip) -> dict[str, torch.Tensor]:
    """What the patches of ``patched_*`` add to every third weight they patch (LoRA-patched UNet and
    text-encoder keys alike: about 60 of 190), as ComfyUI computes it in fp32."""
    import comfy.lora

    out = {}
    for plain, patched in ((model, patched_model), (clip.patcher, patched_clip.patcher)):
        weights = plain.model.state_dict()
        for key in sorted(patched.patches)[::3]:
            patches = patched.patches[key]
            weight = weights[key].float()
            out[key] = comfy.lora.calculate_weight(patches, weight.clone(), key) - weight
    return out


def test_full_rank_node_output_patches_what_the_whole_stack_patches(comfy, models, stacked):
    model, clip, deltas = stacked
    want = deltas[len(STACK) - 1]
    node = comfy.pack.NODE_CLASS_MAPPINGS["PatchbayMergeLoraStack"]()
    text = "\n".join(f"{models.loras[stem].name}: {m}, {c}" for stem, m, c in STACK[:-1])
    with torch.inference_mode():
        result = node.merge(text, "patchbay-tests-lora-stack", "overwrite", "rank", FULL_RANK, 0.9, "fp32",
                            model=model, clip=clip)
    merged_model, merged_clip, name, report = result["result"]
    path = Path(comfy.folder_paths.get_full_path_or_raise("loras", name))
    try:
        assert name == "patchbay-tests-lora-stack.safetensors"
        assert name in comfy.nodes.LoraLoader.INPUT_TYPES()["required"]["lora_name"][0]  # listed at once
    finally:
        path.unlink()
    assert "modules (sd15)" in report and "opposite directions" in report
    got = added(model, clip, merged_model, merged_clip)
    assert set(got) == set(want)
    for key, delta in want.items():
        torch.testing.assert_close(got[key], delta, rtol=0, atol=2e-5 * delta.abs().max().item(), msg=key)


def test_truncated_stack_is_within_the_reported_error_module_by_module(merge_library, comfy, models, stacked,
                                                                        tmp_path):
    import comfy.lora
    import comfy.sd

    ls = merge_library.stack_to_lora

    model, clip, deltas = stacked
    want = deltas[len(STACK)]
    entries = [ls.StackEntry(models.loras[stem], m, c) for stem, m, c in STACK]
    out = tmp_path / "stack-r6.safetensors"
    report = ls.merge_lora_stack(entries, out, ls.StackOptions(rank=6, dtype="fp32"))
    merged_model, merged_clip = comfy.sd.load_lora_for_models(model, clip, load_file(str(out)), 1.0, 1.0)
    got = added(model, clip, merged_model, merged_clip)
    key_map = {**comfy.lora.model_lora_keys_unet(model.model, {}),
               **comfy.lora.model_lora_keys_clip(clip.cond_stage_model, {})}
    assert set(got) == set(want)
    modules = {key_map[module]: module_report for module, module_report in report.modules.items()}
    assert any(".conv" in key or "in_layers" in key for key in got) and any("clip" in key for key in got)
    for key, module_report in ((key, modules[key]) for key in got):
        module = module_report.name
        error = ((got[key] - want[key]).norm() / want[key].norm()).item()
        assert module_report.rank == 6 and module_report.error > 0.01, module
        assert error == pytest.approx(module_report.error, rel=1e-3, abs=1e-5), module


def test_node_refuses_bad_lines_misspelt_names_and_paths_out_of_the_loras_folder(comfy, models):
    """The node's text: a misspelt name gets the nearest names, a path out of the folder is refused
    (comfy_merge/files.py), a line that is no ``name: strength`` names its number; nothing is written."""
    node = comfy.pack.NODE_CLASS_MAPPINGS["PatchbayMergeLoraStack"]()
    folder = models.loras["patchbay-lora-r4"].parent
    before = sorted(folder.iterdir())

    def run(text: str) -> None:
        node.merge(text, "patchbay-tests-bad", "error", "rank", 4, 0.9, "fp16")

    with pytest.raises(ValueError, match="patchbay-lora-r4.safetensors"):
        run("patchbay-lora-r5.safetensors: 0.5")
    with pytest.raises(ValueError, match="'..' is not allowed"):
        run("../checkpoints/patchbay-sd15-tiny-a.safetensors: 1")
    with pytest.raises(ValueError, match="LoRA line 2 'patchbay-lora-r4.safetensors: strong'"):
        run("patchbay-lora-r4.safetensors: 1\npatchbay-lora-r4.safetensors: strong")
    with pytest.raises(ValueError, match="is a sdxl LoRA but LoRA 1"):
        run("patchbay-lora-r4.safetensors: 1\npatchbay-sdxl-locon-r8.safetensors: 1")
    assert sorted(folder.iterdir()) == before


def test_sdxl_stack_patches_what_loraloader_patches(merge_library, comfy, models, tmp_path):
    """SDXL (LDM kohya names, LoCon convolutions, UNet only): the LoCon at 0.7 and again at -0.3 merged at
    its own rank 8 adds what LoraLoaderModelOnly adds with both, and the two are reported opposed."""
    import arch_sampling
    from comfy import sd as comfy_sd

    ls = merge_library.stack_to_lora

    base = arch_sampling.shared_model("sdxl")
    name = models.loras["patchbay-sdxl-locon-r8"].name
    loader = comfy.nodes.LoraLoaderModelOnly()
    both = loader.load_lora_model_only(loader.load_lora_model_only(base, name, 0.7)[0], name, -0.3)[0]
    out = tmp_path / "sdxl-stack.safetensors"
    entries = [ls.StackEntry(models.loras["patchbay-sdxl-locon-r8"], 0.7),
               ls.StackEntry(models.loras["patchbay-sdxl-locon-r8"], -0.3)]
    report = ls.merge_lora_stack(entries, out, ls.StackOptions(rank=8, dtype="fp32"))
    merged, _ = comfy_sd.load_lora_for_models(base, None, load_file(str(out)), 1.0, 0.0)
    assert report.arch == "sdxl" and all(m.opposed == ((1, 2, -1.0),) for m in report.modules.values())
    want = added_model(base, both)
    got = added_model(base, merged)
    assert set(got) == set(want) and any(w.dim() == 4 for w in want.values())
    for key, delta in want.items():
        torch.testing.assert_close(got[key], delta, rtol=0, atol=2e-5 * delta.abs().max().item(), msg=key)


def added_model(model, patched) -> dict[str, torch.Tensor]:
    import comfy.lora

    weights = model.model.state_dict()
    return {key: comfy.lora.calculate_weight(patched.patches[key], weights[key].float().clone(), key)
            - weights[key].float() for key in sorted(patched.patches)[::3]}
