"""T2: the merge nodes through a live ComfyUI server (issue 16): a merge in the graph sampled and saved as
an image, a re-run with a new sampler seed that runs no merge node, and a checkpoint streamed by Save
Merge into the output folder with its recipe in the metadata; errors reach the user as one message."""

from __future__ import annotations

import json

import pytest
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


def cached_nodes(entry: dict) -> set[str]:
    return {node for kind, data in entry["status"]["messages"] if kind == "execution_cached"
            for node in data["nodes"]}


def test_a_merge_in_the_graph_samples_and_a_new_seed_merges_nothing(comfy_server):
    first = comfy_server.wait(comfy_server.queue(merge_and_sample(seed=1)), timeout=1500)
    assert comfy_server.output_files(first), "the merged model made no image"
    assert "4" not in cached_nodes(first)
    again = comfy_server.wait(comfy_server.queue(merge_and_sample(seed=2)), timeout=1500)
    assert {"1", "2", "3", "4", "5", "6"} <= cached_nodes(again)  # only the sampler and after ran
    assert "8" not in cached_nodes(again)


def test_save_merge_streams_a_checkpoint_with_its_recipe_into_the_output_folder(comfy_server):
    from safetensors import safe_open

    prompt = {
        **recipe_nodes(alpha=0.6),
        "4": {"class_type": "PatchbayMergeSave",
              "inputs": {"recipe": ["3", 0], "filename": "patchbay-t2/saved", "if_exists": "overwrite",
                         "dtype": "fp16", "merge_seed": 0, "cache_mb": 0, "shape_policy": "overlap",
                         "missing_policy": "first"}},
        "5": {"class_type": "PatchbayMergeRecipeToText", "inputs": {"recipe": ["3", 0], "form": "sd-mecha"}},
    }
    entry = comfy_server.wait(comfy_server.queue(prompt), timeout=1500)
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
        comfy_server.wait(comfy_server.queue(prompt), timeout=120)
