"""T2: the merge nodes through a live ComfyUI server (issue 16): a merge in the graph sampled and saved as
an image, a re-run with a new sampler seed that runs no merge node, and a checkpoint streamed by Save
Merge into the output folder with its recipe in the metadata; errors reach the user as one message.
Two bundled workflows' files are checked tensor by tensor: a LoRA baked in per key pattern (into a MODEL
of the graph) and per SDXL block (into a diffusion-model file), against the formula base + w * delta; and
Clear Merge Cache runs before the merge, as the first workflow's note says."""

from __future__ import annotations

import json
import re

import devpaths
import pytest
import torch
from comfy_server import ExecutionError

pytestmark = pytest.mark.t2

CKPT_A, CKPT_B = "patchbay-sd15-tiny-a.safetensors", "patchbay-sd15-tiny-b.safetensors"


def recipe_nodes(alpha: float = 0.3) -> dict:
    return {
        "1": {"class_type": "PatchbayMergeCheckpoint", "inputs": {"ckpt_name": CKPT_A}},
        "2": {"class_type": "PatchbayMergeCheckpoint", "inputs": {"ckpt_name": CKPT_B}},
        "3": {"class_type": "PatchbayMethodWeightedSum",
              "inputs": {"a": ["1", 0], "b": ["2", 0], "alpha": alpha}},
    }


def merge_and_sample(seed: int) -> dict:
    common = {"merge_seed": 0, "cache_mb": 1024, "shape_policy": "overlap", "missing_policy": "first"}
    return {
        **recipe_nodes(),
        "4": {"class_type": "PatchbayMerge", "inputs": {"recipe": ["3", 0], **common}},
        "5": {"class_type": "CLIPTextEncode", "inputs": {"text": "a knight in armor", "clip": ["4", 1]}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "blurry", "clip": ["4", 1]}},
        "7": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "8": {"class_type": "KSampler", "inputs": {"model": ["4", 0], "seed": seed, "steps": 2, "cfg": 7.0,
                                                   "sampler_name": "euler", "scheduler": "normal",
                                                   "positive": ["5", 0], "negative": ["6", 0],
                                                   "latent_image": ["7", 0], "denoise": 1.0}},
        "9": {"class_type": "VAEDecode", "inputs": {"samples": ["8", 0], "vae": ["4", 2]}},
        "10": {"class_type": "SaveImage",
               "inputs": {"images": ["9", 0], "filename_prefix": "patchbay-t2-merge"}},
    }


def save_merge(recipe: str, filename: str) -> dict:
    """A Save Merge node for the recipe of node ``recipe``: fp16, no cache, replacing ``filename``."""
    return {"class_type": "PatchbayMergeSave",
            "inputs": {"recipe": [recipe, 0], "filename": filename, "if_exists": "overwrite", "dtype": "fp16",
                       "merge_seed": 0, "cache_mb": 0, "shape_policy": "overlap", "missing_policy": "first"}}


def cached_nodes(entry: dict) -> set[str]:
    return {node for kind, data in entry["status"]["messages"] if kind == "execution_cached"
            for node in data["nodes"]}


def test_a_merge_in_the_graph_samples_and_a_new_seed_merges_nothing(comfy_server):
    first = comfy_server.wait(comfy_server.queue(merge_and_sample(seed=1)))
    assert comfy_server.output_files(first), "the merged model made no image"
    assert "4" not in cached_nodes(first)
    again = comfy_server.wait(comfy_server.queue(merge_and_sample(seed=2)))
    assert {"1", "2", "3", "4", "5", "6"} <= cached_nodes(again)  # only the sampler and after ran
    assert "8" not in cached_nodes(again)


def test_save_merge_streams_a_checkpoint_with_its_recipe_into_the_output_folder(comfy_server):
    from safetensors import safe_open

    prompt = {
        **recipe_nodes(alpha=0.6),
        "4": save_merge("3", "patchbay-t2/saved"),
        "5": {"class_type": "PatchbayMergeRecipeToText", "inputs": {"recipe": ["3", 0], "form": "sd-mecha"}},
    }
    entry = comfy_server.wait(comfy_server.queue(prompt))
    saved = comfy_server.output_dir / "patchbay-t2" / "saved.safetensors"
    assert entry["outputs"]["4"]["text"][0].startswith("saved.safetensors: 730 keys")
    (text,) = entry["outputs"]["5"]["text"]
    with safe_open(str(saved), "pt") as handle:
        assert handle.metadata()["patchbay.recipe"] == text
        assert len(list(handle.keys())) == 730
    assert not [p for p in saved.parent.iterdir() if p.name.endswith(".partial")]
    assert json.loads(json.dumps(entry["outputs"]["5"]))  # the ui text reaches the frontend as JSON


def test_a_bad_recipe_text_stops_the_prompt_with_the_nearest_method_name(comfy_server):
    text = f'version 0.1.0\nmodel "{CKPT_A}"\nmodel "{CKPT_B}"\nmerge "weighted_summ" &0 &1'
    prompt = {
        "1": {"class_type": "PatchbayMergeRecipeText",
              "inputs": {"text": text, "recipe_file": "(textbox)", "params": ""}},
        "2": {"class_type": "PatchbayMergeRecipeToText", "inputs": {"recipe": ["1", 0], "form": "compact"}},
    }
    with pytest.raises(ExecutionError, match=r"PatchbayMergeRecipeText.*did you mean 'weighted_sum'"):
        comfy_server.wait(comfy_server.queue(prompt))


def bundled_prompt(name: str, object_info: dict, frontend_version: str) -> dict:
    from workflow_api import workflow_to_prompt
    from workflow_catalog import bundled_path

    workflow = json.loads(bundled_path(name).read_text())
    return workflow_to_prompt(workflow, object_info, frontend=frontend_version)


def node_of(prompt: dict, class_type: str) -> str:
    (nid,) = [nid for nid, node in prompt.items() if node["class_type"] == class_type]
    return nid


def sdxl_block(key: str) -> str:
    """The block of an SDXL UNet key in LDM layout: input_blocks.N -> INnn, middle_block -> M00,
    output_blocks.N -> OUTnn, the final norm and conv (out) with the last block, OUT08; the time and
    label embeddings -> BASE."""
    parts = key.split(".")
    prefix = {"input_blocks": "IN", "output_blocks": "OUT"}.get(parts[0])
    if prefix:
        return f"{prefix}{int(parts[1]):02d}"
    return {"middle_block": "M00", "out": "OUT08"}.get(parts[0], "BASE")


def kohya_delta(lora: dict, key: str, shape) -> torch.Tensor | None:
    """What LoraLoader adds to UNet weight ``key`` at strength 1 (kohya LoCon): alpha/rank * up @ down."""
    module = "lora_unet_" + key.removesuffix(".weight").replace(".", "_")
    if not key.endswith(".weight") or f"{module}.lora_up.weight" not in lora:
        return None
    up, down = lora[f"{module}.lora_up.weight"].float(), lora[f"{module}.lora_down.weight"].float()
    scale = lora[f"{module}.alpha"].float() / down.shape[0]
    return (scale * (up.flatten(1) @ down.flatten(1))).reshape(shape)


def test_the_sdxl_workflow_bakes_the_lora_into_each_block_by_its_block_weight(comfy_server, object_info,
                                                                             frontend_version):
    """merge_sdxl_lora_block_weights: the saved UNet is base + w(block) * (LoRA delta) key by key, w from
    the Block Weights node (0 leaves a key's bytes as they were), in fp16."""
    from safetensors.torch import load_file

    prompt = bundled_prompt("merge_sdxl_lora_block_weights", object_info, frontend_version)
    save, blocks = node_of(prompt, "PatchbayMergeSave"), node_of(prompt, "PatchbayMergeBlockWeightsSDXL")
    prompt[save]["inputs"].update(filename="patchbay-t2/sdxl-blocks", if_exists="overwrite")
    weights = prompt[blocks]["inputs"]
    comfy_server.wait(comfy_server.queue(prompt))
    models = devpaths.models_dir()
    saved = load_file(str(comfy_server.output_dir / "patchbay-t2" / "sdxl-blocks.safetensors"))
    saved = {key.removeprefix("model.diffusion_model."): value for key, value in saved.items()}  # ckpt layout
    base = load_file(str(models / "diffusion_models" / "patchbay-sdxl-tiny.safetensors"))
    lora = load_file(str(models / "loras" / "patchbay-sdxl-locon-r8.safetensors"))
    assert sorted(saved) == sorted(base)
    patched: dict[float, int] = {}  # keys the LoRA patches, per block weight
    for key, weight in base.items():
        w, delta = weights[sdxl_block(key)], kohya_delta(lora, key, weight.shape)
        if delta is not None:
            patched[w] = patched.get(w, 0) + 1
        if delta is None or w == 0:
            assert torch.equal(saved[key], weight), key
            continue
        want = (weight.float() + w * delta).half()
        torch.testing.assert_close(saved[key], want, rtol=2**-10, atol=2**-14, msg=key)
        assert not torch.equal(saved[key], weight), f"{key} did not change"
    assert sorted(patched) == [0.0, 0.5, 1.0], f"LoRA keys per block weight: {patched}"


def test_the_key_patterns_workflow_bakes_the_lora_where_its_patterns_say(comfy_server, object_info,
                                                                        frontend_version):
    """merge_lora_delta_key_patterns with its Merge node as Save Merge, next to the same recipe with
    alpha 1 everywhere (base + D, D the LoRA's delta): the workflow's file is base + D on ``*.attn2.*``
    keys, base + D / 2 on ``*.ff.*`` keys, base elsewhere, for the UNet of a MODEL from the graph."""
    from safetensors.torch import load_file

    prompt = bundled_prompt("merge_lora_delta_key_patterns", object_info, frontend_version)
    method = node_of(prompt, "PatchbayMethodAddDifference")
    patterns = node_of(prompt, "PatchbayMergeKeyPatterns")
    assert prompt[patterns]["inputs"]["patterns"].split() == ["*.attn2.*=1.0", "*.ff.*=0.5", "default=0"]
    keep = {node_of(prompt, kind) for kind in ("CheckpointLoaderSimple", "PatchbayMergeModelInput",
                                               "PatchbayMergeLora")} | {method, patterns}
    prompt = {nid: node for nid, node in prompt.items() if nid in keep}
    prompt["p1"] = {**prompt[patterns], "inputs": {"patterns": "default=1", "check_blocks": "sd15"}}
    prompt["m1"] = {**prompt[method], "inputs": {**prompt[method]["inputs"], "alpha_map": ["p1", 0]}}
    prompt["s0"] = save_merge(method, "patchbay-t2/patterns")
    prompt["s1"] = save_merge("m1", "patchbay-t2/all")
    comfy_server.wait(comfy_server.queue(prompt))
    saved, full = (load_file(str(comfy_server.output_dir / "patchbay-t2" / f"{name}.safetensors"))
                   for name in ("patterns", "all"))
    base = load_file(str(devpaths.models_dir() / "checkpoints" / CKPT_A))
    assert sorted(saved) == sorted(full) and all(key.startswith("model.diffusion_model.") for key in saved)
    moved = {".attn2.": 0, ".ff.": 0}  # keys the LoRA changed, per pattern
    for key, tensor in saved.items():
        part = next((p for p in moved if p in key), None)
        if part is None:
            assert torch.equal(tensor, base[key]), f"{key} is outside the patterns and changed"
            continue
        if part == ".attn2.":
            assert torch.equal(tensor, full[key]), key
        else:
            half = (base[key].float() + (full[key].float() - base[key].float()) / 2).half()
            torch.testing.assert_close(tensor, half, rtol=2**-10, atol=2**-13, msg=key)
        moved[part] += not torch.equal(tensor, base[key])
    assert all(moved.values()), f"keys the LoRA moved, per pattern: {moved}"


def test_clear_merge_cache_in_the_key_patterns_workflow_runs_before_its_merge(comfy_server, object_info,
                                                                              frontend_version):
    """What its note says: Clear Merge Cache has no inputs, so ComfyUI runs it first in the queue (on an
    emptied cache it frees nothing) and the merge's results stay in memory until the next queue."""
    def cleared(entry: dict, nid: str) -> int:
        (text,) = entry["outputs"][nid]["text"]
        return int(re.match(r"merge cache cleared: (\d+) entries", text).group(1))

    alone = {"c": {"class_type": "PatchbayMergeCacheClear", "inputs": {}}}
    comfy_server.wait(comfy_server.queue(alone))
    prompt = bundled_prompt("merge_lora_delta_key_patterns", object_info, frontend_version)
    merge, clear = node_of(prompt, "PatchbayMerge"), node_of(prompt, "PatchbayMergeCacheClear")
    prompt[merge]["inputs"]["merge_seed"] = 1234  # a new input: the Merge node runs again in this session
    entry = comfy_server.wait(comfy_server.queue(prompt))
    assert comfy_server.output_files(entry) and cleared(entry, clear) == 0
    assert cleared(comfy_server.wait(comfy_server.queue(alone)), "c") > 0
