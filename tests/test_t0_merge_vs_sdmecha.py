"""T0: whole merges, file to file, through sd-mecha 1.1.8 and through Patchbay give the same tensors.

The models are small but real to sd-mecha: SD1.5's 686 UNet keys with their real names (sd-mecha
picks its ``sd1-ldm`` config by key names) at shapes cut to at most 3 per dimension, so a merge
takes milliseconds. fp32 outputs agree within 1e-5, fp16 outputs within one fp16 rounding step.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from bench_merge import SilentProgress  # devtools/ is on sys.path (tests/conftest.py)
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.t0

SDMECHA_AVAILABLE = importlib.util.find_spec("sd_mecha") is not None


@pytest.fixture(scope="module")
def sd_mecha():
    if not SDMECHA_AVAILABLE:
        pytest.skip("sd-mecha 1.1.8 is not installed (devtools/requirements-*.lock pin it)")
    import sd_mecha

    return sd_mecha


@pytest.fixture(scope="module")
def models(sd_mecha, tmp_path_factory) -> list[Path]:
    import yaml

    config = Path(sd_mecha.__path__[0]) / "extensions/builtin/model_configs/sd1-ldm.yaml"
    unet = yaml.safe_load(config.read_text())["components"]["diffuser"]
    folder = tmp_path_factory.mktemp("sd15-small")
    paths = []
    for index in range(3):
        gen = torch.Generator().manual_seed(index)
        tensors = {key: (torch.randn([min(d, 3) for d in meta["shape"]], generator=gen) * 0.1).half()
                   for key, meta in sorted(unet.items())}
        paths.append(folder / f"m{index}.safetensors")
        save_file(tensors, str(paths[-1]))
    return paths


CASES = {
    "weighted_sum": (lambda m, a, b, c: m.weighted_sum(a, b, alpha=0.3),
                     lambda R, a, b, c: R.weighted_sum(a, b, alpha=0.3)),
    "add_difference": (lambda m, a, b, c: m.add_difference(a, b, c, alpha=0.7),
                       lambda R, a, b, c: R.add_difference(a, R.subtract(b, c), alpha=0.7)),
    "n_average": (lambda m, a, b, c: m.n_average(a, b, c), lambda R, a, b, c: R.n_average(a, b, c)),
    "slerp": (lambda m, a, b, c: m.slerp(a, b, alpha=0.4), lambda R, a, b, c: R.slerp(a, b, alpha=0.4)),
    "train_difference": (lambda m, a, b, c: _linear(m).add_difference(
                             a, m.subtract(b, c), alpha=m.train_difference_mask(a, b, c, alpha=0.7)),
                         lambda R, a, b, c: R.add_difference(
                             a, R.subtract(b, c), alpha=R.train_difference_mask(a, b, c, alpha=0.7))),
    "nested": (lambda m, a, b, c: m.weighted_sum(m.add_difference(a, b, c, alpha=0.5), c, alpha=0.25),
               lambda R, a, b, c: R.weighted_sum(R.add_difference(a, R.subtract(b, c), alpha=0.5), c,
                                                 alpha=0.25)),
}


def _linear(sd_mecha):
    """sd-mecha's add_difference method itself (its wrapper ``sd_mecha.add_difference`` refuses a
    param-space alpha); this is the form sd-mecha writes train difference in."""
    from sd_mecha.extensions.builtin.merge_methods import linear

    return linear


# sd-mecha takes seconds per merge even on small models: each recipe once, one of them in fp16
PAIRS = [("weighted_sum", "fp16"), ("add_difference", "fp32"), ("n_average", "fp32"), ("slerp", "fp32"),
         ("train_difference", "fp32"), ("nested", "fp32")]


@pytest.mark.parametrize(("name", "dtype"), PAIRS)
def test_same_output_as_sdmecha(sd_mecha, models, tmp_path, name, dtype):
    from patchbay_merge import execute
    from patchbay_merge import recipe as R

    torch_dtype = {"fp32": torch.float32, "fp16": torch.float16}[dtype]
    theirs_recipe, ours_recipe = CASES[name]
    theirs_path, ours_path = tmp_path / "sdmecha.safetensors", tmp_path / "patchbay.safetensors"
    sd_mecha.merge(theirs_recipe(sd_mecha, *(sd_mecha.model(str(p)) for p in models)), output=theirs_path,
                   merge_dtype=torch.float32, output_dtype=torch_dtype, threads=1, tqdm=SilentProgress)
    execute.merge(ours_recipe(R, *(R.model(str(p)) for p in models)), ours_path,
                  execute.MergeOptions(dtype=dtype, progress=False, fsync=False, chunk_elements=7))
    theirs, ours = load_file(str(theirs_path)), load_file(str(ours_path))
    assert theirs.keys() == ours.keys() and len(ours) == 686
    for key, expected in theirs.items():
        assert ours[key].dtype == expected.dtype == torch_dtype
        if dtype == "fp32":
            torch.testing.assert_close(ours[key], expected, rtol=0, atol=1e-5, msg=key)
        else:  # at most one fp16 rounding step apart
            step = torch.finfo(torch.float16).eps * expected.float().abs().clamp(min=2**-14)
            assert ((ours[key].float() - expected.float()).abs() <= step).all(), key


def test_sdmecha_merges_our_written_recipe_text_to_our_output(sd_mecha, tmp_path):
    """The .mecha text Patchbay writes (``show``, the output's metadata) is read by sd-mecha as meant:
    a block-weighted train difference merged by sd-mecha from that text equals Patchbay's merge."""
    import yaml
    from patchbay_merge import execute, io, mecha_text
    from patchbay_merge import recipe as R

    config = Path(sd_mecha.__path__[0]) / "extensions/builtin/model_configs/sd1-ldm.yaml"
    unet = yaml.safe_load(config.read_text())["components"]["diffuser"]
    paths = []
    for index in range(3):  # cross-attention keys keep their 768 context width: detected as SD1.5
        gen = torch.Generator().manual_seed(index)
        tensors = {key: torch.randn([min(d, 3) if ".attn2.to_" not in key or i == 0 else d
                                     for i, d in enumerate(meta["shape"])], generator=gen) * 0.1
                   for key, meta in sorted(unet.items())}
        paths.append(tmp_path / f"m{index}.safetensors")
        save_file(tensors, str(paths[-1]))
    a, b, c = (R.model(str(p)) for p in paths)
    blocks = {"IN00": 0.2, "IN05": 0.9, "M00": 0.7, "OUT11": 0.1, "default": 0.5}
    recipe = R.weighted_sum(a, R.add_difference(a, R.subtract(b, c), alpha=R.train_difference_mask(a, b, c)),
                            alpha=blocks)
    ours = tmp_path / "patchbay.safetensors"
    execute.merge(recipe, ours, execute.MergeOptions(dtype="fp32", progress=False, fsync=False))
    text = io.SafetensorsFile(ours).metadata["patchbay.recipe"]
    assert text == mecha_text.dumps(recipe, arch="sd15") and "sd1-supermerger_blocks" in text
    theirs = tmp_path / "sdmecha.safetensors"
    sd_mecha.merge(sd_mecha.deserialize(text), output=theirs, merge_dtype=torch.float32,
                   output_dtype=torch.float32, threads=1, tqdm=SilentProgress)
    theirs_sd, ours_sd = load_file(str(theirs)), load_file(str(ours))
    assert theirs_sd.keys() == ours_sd.keys() and len(ours_sd) == 686
    for key, expected in theirs_sd.items():
        torch.testing.assert_close(ours_sd[key], expected, rtol=0, atol=1e-6, msg=key)
