"""T0: a recipe as the difference a recipe hook adds (merge/delta.py), without ComfyUI: ``recipe - base``
for a whole-model recipe, a difference as it is, the wrong combinations refused naming the fix, and
``RecipeDeltas`` giving each key's delta on request, equal to the formula."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.t0

SHAPES = {"model.diffusion_model.input_blocks.0.0.weight": (8, 4, 3, 3),
          "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight": (8, 768),
          "model.diffusion_model.out.2.weight": (30, 7)}


def make_model(path: Path, seed: int) -> str:
    gen = torch.Generator().manual_seed(seed)
    save_file({k: torch.randn(s, generator=gen).half() for k, s in SHAPES.items()}, str(path))
    return str(path)


def test_a_whole_model_recipe_minus_its_base_gives_each_keys_delta_on_request(tmp_path):
    from patchbay_merge import recipe as R
    from patchbay_merge.delta import RecipeDeltas, delta_recipe
    from patchbay_merge.plan import MergeOptions

    a, b = make_model(tmp_path / "a.safetensors", 1), make_model(tmp_path / "b.safetensors", 2)
    base = R.model(a)
    delta = delta_recipe(R.weighted_sum(base, R.model(b), alpha=0.3), base)
    assert R.output_space(delta) == "delta"
    deltas = RecipeDeltas(delta, MergeOptions(dtype="fp32"))
    try:
        assert deltas.shapes == SHAPES and deltas.arch == "sd15"
        ta, tb = load_file(a), load_file(b)
        for key in SHAPES:
            expected = 0.3 * (tb[key].float() - ta[key].float())
            torch.testing.assert_close(deltas.delta(key), expected, rtol=1e-5, atol=1e-6)
    finally:
        deltas.close()


def test_a_difference_is_its_own_delta_and_wrong_combinations_name_the_fix(tmp_path):
    from patchbay_merge import recipe as R
    from patchbay_merge.delta import delta_recipe

    a = R.model(make_model(tmp_path / "a.safetensors", 1))
    b = R.model(make_model(tmp_path / "b.safetensors", 2))
    difference = R.subtract(b, a)
    assert delta_recipe(difference) is difference
    with pytest.raises(R.RecipeError, match=r"no base: .* connect base .* subtract\(merged, base\)"):
        delta_recipe(R.weighted_sum(a, b))
    with pytest.raises(R.RecipeError, match="already a difference .* leave base unconnected"):
        delta_recipe(difference, a)
    with pytest.raises(R.RecipeError, match="base .* must be a model"):
        delta_recipe(R.weighted_sum(a, b), difference)
    with pytest.raises(R.RecipeError, match="param-space values"):
        delta_recipe(R.train_difference_mask(a, b, a))
