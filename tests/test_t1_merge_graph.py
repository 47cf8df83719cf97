"""T1: merges run by the nodes inside ComfyUI, checked against references (issue 16, items 2, 3, 5, 6,
8 and "Bad input"): core's ModelMergeSimple (sampled latents), the command line (bytes), LoraLoader (an
extracted LoRA within its truncation error), a fresh merge (cached and interrupted runs), and the
graph's own models and files (untouched by a failed merge). Recipes that leave out the text encoder and
VAE (pick_component diffuser) keep the tests fast where those parts add nothing."""

from __future__ import annotations

import os
import re
import threading
import time

import pytest
import torch
from comfy_inprocess import InGraph

pytestmark = pytest.mark.t1

CKPT_A, CKPT_B, CKPT_C = (f"patchbay-sd15-tiny-{v}.safetensors" for v in "abc")
UNET = "model.diffusion_model."


@pytest.fixture(scope="module")
def pack(comfy):
    return comfy.pack


@pytest.fixture(scope="module")
def node(pack):
    return lambda node_id: InGraph(pack.NODE_CLASS_MAPPINGS[node_id]())


@pytest.fixture(scope="module")
def core(sd15):
    n, model_a, clip, latent = sd15.nodes, sd15.model, sd15.clip, sd15.latent
    model_b = sd15.checkpoint(CKPT_B)[0]
    positive, negative = sd15.encode("a knight in armor"), sd15.encode("blurry")

    def sample(model):
        with torch.inference_mode():  # as ComfyUI's executor
            (out,) = n["KSampler"]().sample(model, 7, 4, 7.0, "euler", "normal", positive, negative, latent)
        return out["samples"]

    return type("Core", (), {"a": model_a, "b": model_b, "clip": clip, "sample": staticmethod(sample),
                             "n": n})


def checkpoints(node, *names):
    return [node("PatchbayMergeCheckpoint").make(ckpt_name=name)[0] for name in names]


def diffuser(node, recipe):
    return node("PatchbayMethodPickComponent").build(a=recipe, component="diffuser")[0]


def unet_weights(patcher) -> dict[str, torch.Tensor]:
    return {UNET + k: v for k, v in patcher.model.diffusion_model.state_dict().items()}


def test_in_graph_weighted_sum_samples_the_latent_of_core_model_merge_simple(node, core):
    a, b = checkpoints(node, CKPT_A, CKPT_B)
    (recipe,) = node("PatchbayMethodWeightedSum").build(a=a, b=b, alpha=0.3)
    model, clip, vae = node("PatchbayMerge").merge(recipe, cache_mb=0)["result"]
    assert type(model).__name__ == "ModelPatcher" and clip is not None and vae is not None
    (reference,) = core.n["ModelMergeSimple"]().merge(core.a, core.b, 0.7)  # 0.7 a + 0.3 b
    ours, theirs, plain = core.sample(model), core.sample(reference), core.sample(core.a)
    scale = theirs.abs().max().item()
    assert (ours - theirs).abs().max().item() < 1e-4 * scale  # float noise: fp32 math on both sides
    assert (plain - theirs).abs().max().item() > 0.1 * scale  # the merge matters


def test_a_graph_model_enters_with_its_patches_and_stays_untouched(comfy, node, core, weights_digest):
    """A LoraLoader'd model and a ModelMergeSimple chain as recipe inputs: read key by key as ComfyUI
    applies their patches (nested ones included), never written."""
    lora_model, _ = core.n["LoraLoader"]().load_lora(core.a, core.clip, "patchbay-lora-r4.safetensors", 1.0,
                                                     1.0)
    (chain,) = core.n["ModelMergeSimple"]().merge(lora_model, core.b, 0.5)
    digest = weights_digest(core.a)
    (graph_input,) = node("PatchbayMergeModelInput").make(chain)
    (c,) = checkpoints(node, CKPT_C)
    (recipe,) = node("PatchbayMethodWeightedSum").build(a=graph_input, b=c, alpha=0.25)
    model, clip, vae = node("PatchbayMerge").merge(recipe, cache_mb=0)["result"]
    assert clip is not None and vae is not None  # from c: a graph MODEL gives only its diffusion model
    import comfy.lora

    merged = unet_weights(model)
    c_weights = unet_weights(core.n["CheckpointLoaderSimple"]().load_checkpoint(CKPT_C)[0])
    patches = chain.get_key_patches("diffusion_model.")
    touched = [k for k in patches if len(patches[k]) > 1][:20]
    assert touched
    for key in touched:
        (weight, convert), *rest = patches[key]
        expected_a = comfy.lora.calculate_weight(rest, convert(weight.float().clone()), key)
        expected = expected_a + (c_weights["model." + key].float() - expected_a) * 0.25
        torch.testing.assert_close(merged["model." + key].float(), expected, rtol=1e-5, atol=1e-6, msg=key)
    assert weights_digest(core.a) == digest


@pytest.mark.heavy
def test_an_unchanged_graph_model_is_served_from_the_merge_cache_and_a_patched_one_is_not(node, core, pack):
    """Issue 32 item 4: a graph MODEL is a recipe leaf holding the model (no registry): the leaf made again
    for the same model, or a clone of it (same weights, same patches), equals the first and merges from
    the cache; the model with a LoRA applied is another input, computed anew."""
    cache = pack.comfy_merge.runtime.CACHE
    cache.clear()
    (c,) = checkpoints(node, CKPT_C)

    def merge(model):
        (graph_input,) = node("PatchbayMergeModelInput").make(model)
        (recipe,) = node("PatchbayMethodWeightedSum").build(a=graph_input, b=c, alpha=0.25)
        before = cache.stats()
        merged, _, _ = node("PatchbayMerge").merge(diffuser(node, recipe), cache_mb=1024)["result"]
        after = cache.stats()
        return graph_input, unet_weights(merged), after.hits - before.hits, after.misses - before.misses

    leaf, first, _, computed = merge(core.a)
    assert computed > 0
    for same in (core.a, core.a.clone()):
        again, weights, hits, recomputed = merge(same)
        assert again == leaf and hash(again) == hash(leaf) and (hits, recomputed) == (computed, 0)
        assert all(torch.equal(weights[k], first[k]) for k in first)
    lora_model, _ = core.n["LoraLoader"]().load_lora(core.a, core.clip, "patchbay-lora-r4.safetensors", 1.0,
                                                     1.0)
    other, _, hits, recomputed = merge(lora_model)
    assert other != leaf and other.path != leaf.path and (hits, recomputed) == (0, computed)
    cache.clear()


def test_save_writes_the_bytes_the_command_line_writes_for_the_same_recipe(merge_library, node, models,
                                                                         tmp_path):
    cli = merge_library.cli

    a, b = checkpoints(node, CKPT_A, CKPT_B)
    (blocks,) = node("PatchbayMergeKeyPatterns").make("IN01=0.2, OUT*=0.9, default=0.5", "sd15")
    (lora,) = node("PatchbayMergeLora").make(lora_name="patchbay-locon-r4.safetensors")
    (mixed,) = node("PatchbayMethodWeightedSum").build(a=a, b=b, alpha=0.5, alpha_map=blocks)
    (recipe,) = node("PatchbayMethodAddDifference").build(a=diffuser(node, mixed), b=lora, alpha=0.5)
    out = node("PatchbayMergeSave").save(recipe, "patchbay-tests/save-vs-cli", "overwrite", "fp16",
                                         cache_mb=0)
    (path,) = out["result"]
    assert path.endswith("patchbay-tests/save-vs-cli.safetensors")
    assert out["ui"]["text"][0].startswith("save-vs-cli.safetensors: 286 keys")
    (text,) = node("PatchbayMergeRecipeToText").show(recipe, "sd-mecha")["result"]
    (tmp_path / "recipe.mecha").write_text(text)
    status = cli.main(["merge", str(tmp_path / "recipe.mecha"), str(tmp_path / "cli.safetensors"),
                       "--models-dir", str(models.checkpoints["patchbay-sd15-tiny-a"].parent.parent),
                       "--no-progress"])
    assert status == 0
    saved = open(path, "rb").read()  # noqa: SIM115 - read once
    assert saved == (tmp_path / "cli.safetensors").read_bytes()
    header = merge_library.io.SafetensorsFile(path)
    assert header.metadata["patchbay.recipe"].startswith("version 0.1.0") and header.unet_only is False
    assert all(key.startswith(UNET) for key in header.tensors)


def test_save_refuses_to_overwrite_unless_asked_and_numbers_new_names(node, comfy, tmp_path):
    (a,) = checkpoints(node, CKPT_A)
    recipe = diffuser(node, a)
    folder = os.path.join(comfy.folder_paths.get_output_directory(), "patchbay-tests")
    temp = comfy.folder_paths.get_temp_directory()
    comfy.folder_paths.set_temp_directory(str(tmp_path / "removed-at-startup"))  # ComfyUI deletes it
    try:
        first = node("PatchbayMergeSave").save(recipe, "patchbay-tests/numbered", "overwrite", "fp16",
                                               cache_mb=0)
    finally:
        comfy.folder_paths.set_temp_directory(temp)
    before = os.stat(first["result"][0]).st_mtime_ns
    with pytest.raises(ValueError, match="numbered.safetensors exists; pick another file name"):
        node("PatchbayMergeSave").save(recipe, "patchbay-tests/numbered", "error", "fp16", cache_mb=0)
    second = node("PatchbayMergeSave").save(recipe, "patchbay-tests/numbered", "number", "fp16", cache_mb=0)
    assert second["result"][0].endswith("numbered_00001.safetensors")
    assert os.stat(first["result"][0]).st_mtime_ns == before
    assert not [f for f in os.listdir(folder) if f.endswith(".partial")]


def test_an_extracted_lora_through_loraloader_reproduces_the_merge_within_the_truncation_error(
        comfy, node, core, pack):
    a, b = checkpoints(node, CKPT_A, CKPT_B)
    # b - a on one block only (zero elsewhere: no module), so the SVDs stay few
    (two_blocks,) = node("PatchbayMergeKeyPatterns").make("IN01=1, default=0", "sd15")
    (partial,) = node("PatchbayMethodWeightedSum").build(a=a, b=b, alpha=0.0, alpha_map=two_blocks)
    (delta,) = node("PatchbayMethodSubtract").build(a=partial, b=a)
    rank = 8
    model, clip, name = node("PatchbayMergeExtractLora").extract(
        delta, "patchbay-tests-extracted", "overwrite", "rank", rank, 0.9, 0, "fp32",
        model=core.a, clip=core.clip)["result"]
    assert name == "patchbay-tests-extracted.safetensors"
    assert name in comfy.folder_paths.get_filename_list("loras")  # listed without a restart
    assert name in comfy.nodes.LoraLoader.INPUT_TYPES()["required"]["lora_name"][0]
    loaded, _ = core.n["LoraLoader"]().load_lora(core.a, core.clip, name, 1.0, 1.0)
    assert set(loaded.patches) == set(model.patches) and loaded.patches
    import comfy.lora

    a_weights, b_weights = unet_weights(core.a), unet_weights(core.b)
    checked = 0
    assert all(".input_blocks.1." in k for k in loaded.patches)
    for key, patches in loaded.patches.items():
        full = "model." + key
        added = comfy.lora.calculate_weight(patches, a_weights[full].float().clone(), key)
        added -= a_weights[full].float()
        target = b_weights[full].float() - a_weights[full].float()  # what the merge adds to a
        singular = torch.linalg.svdvals(target.reshape(target.shape[0], -1))
        truncation = (singular[rank:].square().sum().sqrt() / singular.square().sum().sqrt()).item()
        error = ((added - target).norm() / target.norm()).item()
        assert abs(error - truncation) < 1e-3, key
        checked += 1
    assert checked >= 5


def test_a_rerun_with_one_block_changed_recomputes_only_that_blocks_keys(node, pack):
    cache = pack.comfy_merge.runtime.CACHE
    cache.clear()
    a, b = checkpoints(node, CKPT_A, CKPT_B)
    widgets = [w for w, _ in pack.nodes.merge_inputs.PatchbayMergeBlockWeightsSD15.widgets()]

    def merge(in01: float):
        values = {w: (in01 if w == "IN01" else 0.5) for w in widgets}
        (blocks,) = node("PatchbayMergeBlockWeightsSD15").make(**values)
        (recipe,) = node("PatchbayMethodWeightedSum").build(a=a, b=b, alpha=0.5, alpha_map=blocks)
        before = cache.stats()
        model, _, _ = node("PatchbayMerge").merge(diffuser(node, recipe), cache_mb=1024)["result"]
        after = cache.stats()
        return unet_weights(model), after.hits - before.hits, after.misses - before.misses

    first, _, planned = merge(0.2)  # every float key of the recipe computed (and the dropped ones noted)
    assert planned > len(first)  # the text encoder and VAE keys, left out by pick_component
    same, hits, computed = merge(0.2)
    assert (hits, computed) == (planned, 0)
    changed, hits, computed = merge(0.9)
    in01 = [k for k in first if ".input_blocks.1." in k]
    assert in01 and (hits, computed) == (planned - len(in01), len(in01))
    assert all(torch.equal(changed[k], first[k]) for k in first if k not in in01)
    assert any(not torch.equal(changed[k], first[k]) for k in in01)
    assert all(torch.equal(same[k], first[k]) for k in first)
    node("PatchbayMergeCacheClear").clear()
    assert cache.stats().entries == 0


def test_an_interrupt_stops_a_save_within_a_second_leaving_no_file_and_the_cache_consistent(
        comfy, node, pack):
    from comfy import model_management as mm
    from comfy import utils as comfy_utils

    cache = pack.comfy_merge.runtime.CACHE
    cache.clear()
    a, b = checkpoints(node, CKPT_A, CKPT_B)
    (recipe,) = node("PatchbayMethodWeightedSum").build(a=a, b=b, alpha=0.4)
    recipe = diffuser(node, recipe)
    folder = os.path.join(comfy.folder_paths.get_output_directory(), "patchbay-tests")
    os.makedirs(folder, exist_ok=True)
    before = sorted(os.listdir(folder))
    asked = []

    def hook(value, total, preview, node_id=None):
        if value > total // 3 and not asked:
            asked.append(time.monotonic())
            threading.Thread(target=mm.interrupt_current_processing, args=(True,)).start()

    comfy_utils.set_progress_bar_global_hook(hook)
    try:
        with pytest.raises(mm.InterruptProcessingException):
            node("PatchbayMergeSave").save(recipe, "patchbay-tests/interrupted", "overwrite", "fp16",
                                           cache_mb=1024)
        stopped = time.monotonic()
    finally:
        comfy_utils.set_progress_bar_global_hook(None)
        mm.interrupt_current_processing(False)
    assert asked and stopped - asked[0] < 1.0
    assert sorted(os.listdir(folder)) == before  # no partial file, no output
    assert cache.stats().entries > 0
    resumed = node("PatchbayMergeSave").save(recipe, "patchbay-tests/interrupted", "overwrite", "fp16",
                                             cache_mb=1024)["result"][0]
    fresh = node("PatchbayMergeSave").save(recipe, "patchbay-tests/interrupted-fresh", "overwrite", "fp16",
                                           cache_mb=0)["result"][0]
    assert open(resumed, "rb").read() == open(fresh, "rb").read()  # noqa: SIM115


@pytest.fixture
def broken_folder(comfy, tmp_path, models):
    """A checkpoints folder with a truncated copy of tiny a."""
    folder = tmp_path / "broken"
    folder.mkdir()
    data = models.checkpoints["patchbay-sd15-tiny-a"].read_bytes()
    (folder / "truncated.safetensors").write_bytes(data[: len(data) // 2])
    comfy.folder_paths.add_model_folder_path("checkpoints", str(folder))
    comfy.folder_paths.filename_list_cache.pop("checkpoints", None)
    yield folder
    comfy.folder_paths.folder_names_and_paths["checkpoints"][0].remove(str(folder))
    comfy.folder_paths.filename_list_cache.pop("checkpoints", None)


def test_bad_inputs_stop_the_node_naming_the_value_and_the_fix_and_change_nothing(
        comfy, node, core, weights_digest, broken_folder):
    R = comfy.pack.merge.recipe
    a, b = checkpoints(node, CKPT_A, CKPT_B)
    (graph_input,) = node("PatchbayMergeModelInput").make(core.a)
    sdxl = node("PatchbayMergeDiffusionModel").make(unet_name="patchbay-sdxl-tiny.safetensors")[0]
    flux_lora = node("PatchbayMergeLora").make(lora_name="patchbay-flux-kohya-r8.safetensors")[0]
    cases = [
        (R.weighted_sum(graph_input, sdxl), r"patchbay-sdxl-tiny.safetensors: is a sdxl model but .* is sd15"
                                            r".*cannot be merged"),
        (R.add_difference(graph_input, flux_lora), r"patchbay-flux-kohya-r8.safetensors: matches no key of .*"
                                                   r"Use a LoRA made for this base model"),
        (R.weighted_sum(R.model("checkpoints/truncated.safetensors"), b), r"truncated.safetensors: truncated"
                                                                          r".*fetch the file again"),
        (R.weighted_sum(R.model("checkpoints/patchbay-sd15-tiny-x.safetensors"), b),
         r"no checkpoint named 'patchbay-sd15-tiny-x.safetensors'; did you mean"),
        (R.weighted_sum(a, R.free_input("other")), r"unbound FreeInput; bind it first"),
    ]
    digest = weights_digest(core.a)
    output = comfy.folder_paths.get_output_directory()
    written = sorted(os.walk(output))
    for recipe, message in cases:
        for run in (lambda r: node("PatchbayMerge").merge(r, cache_mb=0),
                    lambda r: node("PatchbayMergeSave").save(r, "patchbay-tests/bad", "number", "fp16",
                                                             cache_mb=0)):
            with pytest.raises(ValueError, match=message):
                run(recipe)
    assert sorted(os.walk(output)) == written and weights_digest(core.a) == digest


def _as_sd_mecha_model_stock_left_1x1_convs(a):
    """a, with +-3.4e38 where sd-mecha 1.1.8's model_stock puts it: in a 1x1 conv (issue 30)."""
    if a.dim() != 4 or a.shape[2:] != (1, 1):
        return a
    return torch.where(a > 0, torch.finfo(a.dtype).max, a)


def _poison(a):
    """Puts a NaN into every tensor."""
    out = a.clone()
    out.view(-1)[0] = float("nan")
    return out


def test_a_blown_up_merge_warns_in_the_node_and_the_log_and_nan_stops_with_a_fix_in_the_graph(
        comfy, node, pack, models, caplog, monkeypatch):
    """Issue 30 item 1: a merge whose values are finite but far beyond its inputs' (sd-mecha's model_stock
    on 1x1 convs) loads and samples NaN. The Merge node says so in the node (ui text and core's progress
    text) and the log; inf or NaN stops Merge and Save Merge with a fix in the graph, not a CLI flag."""
    import server

    registry, R = pack.merge.method_registry, pack.merge.recipe
    shown = []
    monkeypatch.setattr(server.PromptServer, "instance", type("Server", (), {
        "send_progress_text": lambda self, text, node_id: shown.append((text, node_id))})(), raising=False)
    header = pack.merge.io.SafetensorsFile(models.checkpoints["patchbay-sd15-tiny-a"]).tensors
    convs_1x1 = [k for k, info in header.items()
                 if k.startswith(UNET) and len(info.shape) == 4 and info.shape[2:] == (1, 1)]
    (a,) = checkpoints(node, CKPT_A)
    with registry.scope():
        for fn, name in ((_as_sd_mecha_model_stock_left_1x1_convs, "blow_up"), (_poison, "poison")):
            fn.__annotations__ = {"a": registry.Weight, "return": registry.Weight}
            registry.merge_method(fn, name=name)
        with caplog.at_level("WARNING", logger="patchbay.merge"):
            out = node("PatchbayMerge").merge(diffuser(node, R.call("blow_up", a)), cache_mb=0,
                                              unique_id="12")
        for run in (lambda r: node("PatchbayMerge").merge(r, cache_mb=0),
                    lambda r: node("PatchbayMergeSave").save(r, "patchbay-tests/nan", "number", "fp16",
                                                             cache_mb=0)):
            with pytest.raises(ValueError, match=r": the merged values hold inf or NaN, so the merge "
                                                 r"stopped .*the recipe made it .*Change the method or its "
                                                 r"parameters \(a <parameter>_map input") as info:
                run(diffuser(node, R.call("poison", a)))
            assert "--nonfinite" not in str(info.value)
    lines = out["ui"]["text"]
    assert len(convs_1x1) >= 10
    found = re.match(r"warning: (\d+) tensors hold values far beyond every input's range: (\S+) and \d+ more "
                     r"reaches 3.4e\+38 where its inputs reach", lines[1])
    assert found and int(found[1]) == len(convs_1x1) and found[2] in convs_1x1  # all 19 of the tiny SD1.5
    assert shown == [("\n".join(lines), "12")]
    assert [r for r in caplog.records if "far beyond every input's range" in r.getMessage()]
    assert not os.path.exists(os.path.join(comfy.folder_paths.get_output_directory(), "patchbay-tests",
                                           "nan.safetensors"))
