"""T0: LoKr extraction (merge/extract.py with ``kronecker_ratio``, ``patchbay_merge.py extract --lokr``):
each module's factors are sd-mecha 1.1.8's ``extract_lycoris_lokr`` factors, the file reads back (as
ComfyUI's LoraLoader computes a LoKr) as the nearest Kronecker product of the delta, and the reported
error is that approximation's."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.t0

KEYS = {"model.diffusion_model.input_blocks.1.1.proj_in.weight": (12, 8),
        "model.diffusion_model.out.2.weight": (4, 6, 3, 3), "model.diffusion_model.out.2.bias": (4,)}


def t(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", [(12, 8), (4, 6, 3, 3), (16, 16, 1, 1)])
@pytest.mark.parametrize("ratio", [0.2, 0.5, 0.9])
def test_factors_are_sd_mechas_lokr_extraction(shape, ratio):
    sd_mecha = pytest.importorskip("sd_mecha")
    from patchbay_merge.methods.kronecker import kronecker_factors
    from sd_mecha.extensions import merge_methods as sdm_methods

    delta = t(*shape, seed=sum(shape))
    theirs = sdm_methods.resolve("extract_lokr_'sd1-kohya_kohya_lora'").__wrapped__()(
        delta, kronecker_ratio=ratio, key_relation=SimpleNamespace(outputs=("w1", "w2")))
    w1, w2 = kronecker_factors(delta, ratio)
    assert sd_mecha is not None and w1.shape == theirs["w1"].shape and w2.shape == theirs["w2"].shape
    assert torch.allclose(w1, theirs["w1"], atol=1e-5, rtol=1e-5)
    assert torch.allclose(w2, theirs["w2"], atol=1e-5, rtol=1e-5)


@pytest.fixture
def folder(tmp_path):
    for name, seed in (("a", 1), ("b", 2)):
        tensors = {k: t(*s, seed=seed + len(s)) for k, s in KEYS.items()}
        save_file(tensors, str(tmp_path / f"{name}.safetensors"))
    (tmp_path / "d.mecha").write_text('version 0.1.0\nmodel "b.safetensors"\nmodel "a.safetensors"\n'
                                      'merge "subtract" &0 &1')
    return tmp_path


def test_the_lokr_file_carries_the_nearest_kronecker_product_of_each_delta(folder):
    from patchbay_merge import extract, lora
    from patchbay_merge import recipe as R
    from patchbay_merge.context import KeyContext
    from patchbay_merge.method_registry import get

    a, b = (R.model(str(folder / f"{n}.safetensors")) for n in "ab")
    out = folder / "lokr.safetensors"
    options = extract.ExtractOptions(dtype="fp32", kronecker_ratio=0.4)
    report = extract.extract_lora(R.subtract(b, a), out, options)
    written, models = load_file(str(out)), [load_file(str(folder / f"{n}.safetensors")) for n in "ab"]
    with safe_open(str(out), "pt") as file:
        assert json.loads(file.metadata()["ss_network_args"]) == {"algo": "lokr"}
    errors = []
    for key in (k for k in KEYS if k.endswith("weight")):
        name = extract.kohya_name(key)
        delta = models[1][key] - models[0][key]
        parts = {part: written[f"{name}.{part}"] for part in ("lokr_w1", "lokr_w2")}
        assert set(k for k in written if k.startswith(name + ".")) == {f"{name}.lokr_w1", f"{name}.lokr_w2"}
        carried = lora.module_delta(parts).reshape(delta.shape)  # what the LoraLoader adds at strength 1
        nearest = get("truncate_kronecker").fn(delta, kronecker_ratio=0.4, use_approximate_basis=False,
                                               ctx=KeyContext(key=key))
        assert torch.allclose(carried, nearest, atol=1e-5)
        errors.append(float((delta - carried).norm() / delta.norm()))
    assert report.modules == 2 and set(report.ranks.values()) == {1}
    assert report.mean_error == pytest.approx(sum(errors) / 2, rel=1e-4) and 0 < report.mean_error < 1


def test_the_command_line_writes_a_lokr_and_refuses_a_ratio_outside_0_1(folder, capsys):
    from patchbay_merge import cli, extract

    out = folder / "lokr.safetensors"
    assert cli.main(["extract", str(folder / "d.mecha"), str(out), "--lokr", "0.5"]) == 0
    assert "2 modules" in capsys.readouterr().out
    assert any(k.endswith(".lokr_w2") for k in load_file(str(out)))
    with pytest.raises(ValueError, match=r"kronecker_ratio=1.5: give a fraction in \[0, 1\]"):
        extract.ExtractOptions(kronecker_ratio=1.5)
    assert cli.main(["extract", str(folder / "d.mecha"), str(folder / "x.safetensors"), "--lokr", "-1"]) == 2
    assert not (folder / "x.safetensors").exists()
