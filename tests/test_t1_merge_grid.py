"""T1: Merge Grid (issue 35 item 1) inside ComfyUI: every cell equals Merge + KSampler + VAEDecode of
that variant run alone, a block-map axis takes the keys it does not change from the merge cache, and
bad axes are refused before anything merges. Recipes keep only the diffusion model (pick_component),
with the tiny checkpoint's CLIP and VAE connected, so each variant merges 107 M parameters, not 300 M."""

from __future__ import annotations

import importlib
import re

import pytest
import torch
from comfy_inprocess import InGraph

pytestmark = pytest.mark.t1

CKPT_A, CKPT_B = (f"patchbay-sd15-tiny-{v}.safetensors" for v in "ab")
SAMPLING = {"positive": "a knight in armor", "negative": "blurry", "seed": 7, "steps": 2, "cfg": 7.0,
            "sampler_name": "euler", "scheduler": "normal"}


@pytest.fixture(scope="module")
def env(comfy):
    pack = comfy.pack

    def node(node_id):
        return InGraph(pack.NODE_CLASS_MAPPINGS[node_id]())

    n = comfy.nodes.NODE_CLASS_MAPPINGS
    _, clip, vae = n["CheckpointLoaderSimple"]().load_checkpoint(CKPT_A)
    (latent,) = n["EmptyLatentImage"]().generate(64, 64, 1)
    a, b = (node("PatchbayMergeCheckpoint").make(ckpt_name=name)[0] for name in (CKPT_A, CKPT_B))
    grid_module = importlib.import_module(pack.__name__ + ".nodes.merge_grid")
    return type("Env", (), {"node": staticmethod(node), "n": n, "clip": clip, "vae": vae, "latent": latent,
                            "a": a, "b": b, "grid": grid_module})


def diffuser(env, recipe):
    return env.node("PatchbayMethodPickComponent").build(a=recipe, component="diffuser")[0]


def weighted_sum(env, alpha):
    return diffuser(env, env.node("PatchbayMethodWeightedSum").build(a=env.a, b=env.b, alpha=alpha)[0])


def run_grid(env, recipe, x_param, x_values, y_param="", y_values="", **kwargs):
    return env.node("PatchbayMergeGrid").run(recipe, x_param, x_values, y_param, y_values,
                                             latent_image=env.latent, clip=env.clip, vae=env.vae,
                                             **SAMPLING, **kwargs)


def alone(env, recipe, cache_mb=0):
    """One variant as a user would run it without the grid: Merge, CLIPTextEncode, KSampler, VAEDecode."""
    model, _, _ = env.node("PatchbayMerge").merge(recipe, cache_mb=cache_mb)["result"]
    with torch.inference_mode():
        encode = env.n["CLIPTextEncode"]().encode
        pos, neg = (encode(env.clip, SAMPLING[k])[0] for k in ("positive", "negative"))
        (latent,) = env.n["KSampler"]().sample(model, SAMPLING["seed"], SAMPLING["steps"], SAMPLING["cfg"],
                                               SAMPLING["sampler_name"], SAMPLING["scheduler"], pos, neg,
                                               env.latent)
        (image,) = env.n["VAEDecode"]().decode(env.vae, latent)
    return image[0]


def cell(env, grid_image, row, column, size=64):
    top = row * (size + env.grid.LABEL_PX) + env.grid.LABEL_PX
    return grid_image[0, top:top + size, column * size:(column + 1) * size]


def as_pixels(image):
    return (image.clamp(0, 1) * 255).round()


def test_every_cell_is_the_variant_merged_and_sampled_alone(env, monkeypatch):
    """Each cell equals its variant run alone; the second variant's weights stream into the first's
    MODEL (ComfyUI's loader builds one model for the grid, so it never holds two)."""
    import comfy.sd

    built = []
    loader = comfy.sd.load_diffusion_model_state_dict
    monkeypatch.setattr(comfy.sd, "load_diffusion_model_state_dict",
                        lambda *args, **kwargs: built.append(1) or loader(*args, **kwargs))
    recipe = weighted_sum(env, 0.5)
    out = run_grid(env, recipe, "alpha", "0.3, 1", cache_mb=0)
    monkeypatch.undo()
    assert len(built) == 1, f"the grid built {len(built)} models for 2 variants"
    grid_image, texts = out["result"]
    assert tuple(grid_image.shape) == (1, 64 + env.grid.LABEL_PX, 2 * 64, 3)
    cells = [cell(env, grid_image, 0, i) for i in range(2)]
    for alpha, got in zip((0.3, 1.0), cells, strict=True):
        expected = as_pixels(alone(env, weighted_sum(env, alpha)))
        assert torch.equal(as_pixels(got), expected), f"alpha={alpha}: the cell differs from Merge + KSampler"
    assert not torch.equal(cells[0], cells[1]), "alpha changes nothing: the test cannot see the axis"
    assert [line.split(":")[0] for line in out["ui"]["text"]] == ["alpha=0.3", "alpha=1"]
    assert len(re.findall(r"^# alpha=", texts, re.MULTILINE)) == 2 and '"weighted_sum"' in texts
    band = grid_image[0, : env.grid.LABEL_PX, :64]
    assert (band < 0.5).any(), "no label drawn above the first cell"


@pytest.mark.once
def test_a_block_map_axis_recomputes_only_the_keys_it_changes(env, monkeypatch):
    """Three maps: the second changes the OUT blocks, the third puts them back and changes the IN blocks.
    Each variant merges only the keys whose values changed (the others stay in the model); the third
    takes its OUT keys from the merge cache, and those are the only results the grid copies into the
    cache (comfy_merge/runtime.cache_wants: a result no later variant reads is not kept), dropped after the
    third read them. The images equal the same grid without a cache. Run once: the cache's bookkeeping
    is the pack's; each variant sampled through this version's KSampler is the first test's, run on
    every version."""

    cache = importlib.import_module(env.grid.__name__.rsplit(".", 2)[0] + ".comfy_merge.runtime").CACHE
    puts, reads = [], []
    put_copy, get = cache.put_copy, cache.get
    monkeypatch.setattr(cache, "put_copy",
                        lambda key, tensor, **kw: puts.append(key) or put_copy(key, tensor, **kw))

    def reading(key):  # the cache's get, noting what it found
        found = get(key)
        if found is not None:
            reads.append(key)
        return found

    monkeypatch.setattr(cache, "get", reading)
    recipe = weighted_sum(env, 0.5)
    maps = "default=0.2\nOUT*=0.9, default=0.2\nIN*=0.9, default=0.2"
    env.node("PatchbayMergeCacheClear").clear()
    out = run_grid(env, recipe, "alpha", maps, cache_mb=4096)
    monkeypatch.undo()
    lines = out["ui"]["text"]
    merged = int(re.search(r"merged (\d+) keys", lines[1]).group(1))
    out_keys = merged - int(re.search(r"\((\d+) unchanged", lines[1]).group(1))  # what the 2nd merged
    assert " 0 from the merge cache" in lines[0] and 0 < out_keys < merged, lines
    assert len(puts) == len(set(puts)) == out_keys, "results no variant reads were copied into the cache"
    assert set(puts) <= set(reads), "a result copied into the cache was never read back"
    assert all(cache.get(ident) is None for ident in puts), "a result outlived its last reader in the cache"
    without_cache = run_grid(env, recipe, "alpha", maps, cache_mb=0)
    assert torch.equal(out["result"][0], without_cache["result"][0])
    env.node("PatchbayMergeCacheClear").clear()


@pytest.mark.once
def test_a_y_axis_makes_rows(env):
    """x and y set parameters of two methods; one x value and two y values: a column of two rows
    (columns are the first test's), labelled x then y, each cell its variant alone. Run once: the grid's
    layout is the pack's; sampling each cell on this version is the first test's, run on every version."""
    a, b = env.a, env.b
    inner = env.node("PatchbayMethodWeightedSum").build(a=a, b=b, alpha=0.5)[0]
    recipe = diffuser(env, env.node("PatchbayMethodAddDifference").build(
        a=inner, b=env.node("PatchbayMethodSubtract").build(a=b, b=a)[0], alpha=0.5)[0])
    out = run_grid(env, recipe, "weighted_sum.alpha", "0", "add_difference.alpha", "0\n1", cache_mb=0)
    labels = [line.split(":")[0] for line in out["ui"]["text"]]
    assert labels == ["weighted_sum.alpha=0, add_difference.alpha=0",
                      "weighted_sum.alpha=0, add_difference.alpha=1"]
    grid_image = out["result"][0]
    assert tuple(grid_image.shape) == (1, 2 * (64 + env.grid.LABEL_PX), 64, 3)
    # weighted_sum(a, b, 0) + 0 * (b - a) = a, and + 1 * (b - a) = b: Merge of a and of b alone
    for row, alpha in ((0, 0.0), (1, 1.0)):
        expected = as_pixels(alone(env, weighted_sum(env, alpha)))
        assert torch.equal(as_pixels(cell(env, grid_image, row, 0)), expected), f"row {row}"


@pytest.mark.parametrize(("x_param", "x_values", "y_param", "y_values", "needle"), [
    ("alpah", "0.5", "", "", r"axis 'alpah' names no free parameter.*did you mean 'alpha'"),
    ("alpha", "0.5, half", "", "", r"x_values: 'half' is not a number"),
    ("alpha", "0.5", "", "0.2", r"y_values are given but y_param is empty"),
    ("alpha", "0.5", "alpha", "0.2", r"x and y both set 'alpha'"),
    ("alpha", "0.5", "weighted_sum.alpha", "0.1", r"x and y both set weighted_sum\.alpha"),
    ("alpha", "", "", "", r"axis 'alpha' has no values"),
    ("", "0.5", "alpha", "0.2", r"x_param is empty"),
])
def test_bad_axes_are_refused_before_anything_merges(env, x_param, x_values, y_param, y_values, needle):
    cache = importlib.import_module(env.grid.__name__.rsplit(".", 2)[0] + ".comfy_merge.runtime").CACHE
    before = cache.stats()
    with pytest.raises(ValueError, match=needle):
        run_grid(env, weighted_sum(env, 0.5), x_param, x_values, y_param, y_values)
    after = cache.stats()
    assert (after.hits, after.misses, after.entries) == (before.hits, before.misses, before.entries)


def test_more_than_64_variants_need_allow_large_grid(env):
    values = ", ".join(f"{i / 100:g}" for i in range(9))
    recipe = weighted_sum(env, 0.5)
    inner = env.node("PatchbayMethodAddDifference").build(
        a=recipe, b=env.node("PatchbayMethodSubtract").build(a=env.b, b=env.a)[0], alpha=0.5)[0]
    with pytest.raises(ValueError, match=r"the grid has 81 variants \(over 64\).*allow_large_grid"):
        run_grid(env, inner, "weighted_sum.alpha", values, "add_difference.alpha", values)


def test_rows_are_merged_in_snake_order_and_each_image_lands_in_its_cell(env, monkeypatch):
    """Every other row backwards, so each variant follows one with its x value (keys kept in the model);
    the grid, its lines and its text keep row-by-row order. Each cell's "image" here is the number of
    the call that made it, so the test sees where every variant's image went (no merging)."""
    assert env.grid.snake_order(6, 3) == [0, 1, 2, 5, 4, 3]
    assert env.grid.snake_order(5, 2) == [0, 1, 3, 2, 4]
    assert env.grid.snake_order(3, 1) == [0, 1, 2] and env.grid.snake_order(3, 3) == [0, 1, 2]
    calls = []

    def sample(variant, *args):
        calls.append(env.grid.recipe_to_text(variant))
        return torch.full((64, 64, 3), len(calls) * 50 / 255), f"call {len(calls)}", False

    monkeypatch.setattr(env.grid.PatchbayMergeGrid, "_sample", staticmethod(sample))
    inner = env.node("PatchbayMethodWeightedSum").build(a=env.a, b=env.b, alpha=0.5)[0]
    recipe = diffuser(env, env.node("PatchbayMethodAddDifference").build(
        a=inner, b=env.node("PatchbayMethodSubtract").build(a=env.b, b=env.a)[0], alpha=0.5)[0])
    out = run_grid(env, recipe, "weighted_sum.alpha", "0.2, 0.8", "add_difference.alpha", "0\n1")
    grid_image, texts = out["result"]
    blocks = [block.split("\n", 1)[1] for block in texts.split("\n\n# ")]
    assert [line.split(": ")[1] for line in out["ui"]["text"]] == ["call 1", "call 2", "call 4", "call 3"]
    for position, text in enumerate(blocks):
        number = calls.index(text) + 1
        assert number == [1, 2, 4, 3][position]
        got = cell(env, grid_image, position // 2, position % 2)
        assert torch.equal(as_pixels(got), torch.full_like(got, number * 50)), f"cell {position}"
