"""A stack of LoRAs merged into one LoRA (merge/stack_to_lora.py) against the formula: the sum over the stack
of strength * alpha / rank * up @ down, exact at the full concatenated rank; truncated, the error equals the
reported figure and the SVD's tail energy; opposite-sign overlap reported; bad input refused, nothing
written."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.t0


@pytest.fixture(scope="module", autouse=True)
def _library():
    """The library, imported when these tests run: a T1 process collects this file too, and must not load
    merge/ under a second name (devtools/pack_imports.py)."""
    global ls, module_delta
    from patchbay_merge import stack_to_lora as ls
    from patchbay_merge.lora import module_delta

ATTN = "lora_unet_input_blocks_1_1_transformer_blocks_0_attn2_to_k"  # SD1.5: context 768
CONV = "lora_unet_input_blocks_1_0_in_layers_2"
TEXT = "lora_te_text_model_encoder_layers_0_mlp_fc1"
PEFT = {"lora_B.weight": "lora_up.weight", "lora_A.weight": "lora_down.weight"}


def lora(path, modules: dict[str, tuple[int, int, int, int]], seed: int, alpha: float | None = None,
         conv: tuple[str, ...] = (), names: tuple[str, str] = ("lora_up.weight", "lora_down.weight")):
    """A kohya LoRA: module -> (out, in, rank); conv modules get 3x3 downs."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (out, cols, rank) in modules.items():
        kernel = (3, 3) if module in conv else ()
        tensors[f"{module}.{names[0]}"] = torch.randn(out, rank, *((1, 1) if kernel else ()), generator=g)
        tensors[f"{module}.{names[1]}"] = torch.randn(rank, cols, *kernel, generator=g) / math.sqrt(cols)
        if alpha is not None:
            tensors[f"{module}.alpha"] = torch.tensor(alpha)
    save_file(tensors, str(path))
    return path


def expected(entries, module) -> torch.Tensor:
    """sum_i s_i * alpha_i / r_i * up_i @ down_i, flattened."""
    total = 0
    for entry in entries:
        t = load_file(str(entry.path))
        parts = {PEFT.get(k.removeprefix(module + "."), k.removeprefix(module + ".")): v.float()
                 for k, v in t.items() if k.startswith(module + ".")}
        if parts:
            text = module.startswith("lora_te") and entry.clip_strength is not None
            strength = entry.clip_strength if text else entry.strength
            delta = module_delta(parts)
            total = total + strength * delta.reshape(delta.shape[0], -1)
    return total


def merged_delta(path, module) -> torch.Tensor:
    t = load_file(str(path))
    parts = {k.removeprefix(module + "."): v.float() for k, v in t.items() if k.startswith(module + ".")}
    delta = module_delta(parts)
    return delta.reshape(delta.shape[0], -1)


@pytest.fixture
def pair(tmp_path):
    a = lora(tmp_path / "a.safetensors", {ATTN: (64, 768, 4), CONV: (64, 64, 4), TEXT: (96, 48, 4)}, 1,
             alpha=2.0, conv=(CONV,))
    b = lora(tmp_path / "b.safetensors", {ATTN: (64, 768, 8), CONV: (64, 64, 8)}, 2, alpha=8.0, conv=(CONV,))
    return [ls.StackEntry(a, 0.8, clip_strength=0.5), ls.StackEntry(b, -0.6)]


def test_full_rank_is_exact_and_written_as_kohya(pair, tmp_path):
    out = tmp_path / "m.safetensors"
    report = ls.merge_lora_stack(pair, out, ls.StackOptions(rank=12, dtype="fp32"))
    assert report.arch == "sd15"
    for module in (ATTN, CONV, TEXT):
        want = expected(pair, module)
        got = merged_delta(out, module)
        assert torch.allclose(got, want, atol=1e-5 * want.abs().max()), module
        assert report.modules[module].error < 1e-5
    assert report.modules[ATTN].rank == report.modules[ATTN].full_rank == 12
    assert report.modules[TEXT].rank == 4
    t = load_file(str(out))
    assert t[f"{CONV}.lora_up.weight"].shape == (64, 12, 1, 1)
    assert t[f"{CONV}.lora_down.weight"].shape == (12, 64, 3, 3)
    assert t[f"{ATTN}.alpha"].item() == 12


def test_truncation_error_is_the_reported_figure_and_the_svd_tail(pair, tmp_path):
    out = tmp_path / "m.safetensors"
    report = ls.merge_lora_stack(pair, out, ls.StackOptions(rank=5, dtype="fp32"))
    for module in (ATTN, CONV):
        want = expected(pair, module)
        got = merged_delta(out, module)
        error = float((want - got).norm() / want.norm())
        s = torch.linalg.svdvals(want)
        tail = float((s[5:].square().sum() / s.square().sum()).sqrt())
        assert report.modules[module].rank == 5
        assert error == pytest.approx(report.modules[module].error, rel=1e-4)
        assert tail == pytest.approx(report.modules[module].error, rel=1e-4)


def test_energy_keeps_the_smallest_rank_reaching_it(pair, tmp_path):
    report = ls.merge_lora_stack(pair, tmp_path / "m.safetensors", ls.StackOptions(rank=None, energy=0.9,
                                                                                   dtype="fp32"))
    for module, m in report.modules.items():
        s = torch.linalg.svdvals(expected(pair, module)).square()
        kept = torch.cumsum(s, 0) / s.sum()
        assert kept[m.rank - 1] >= 0.9 - 1e-6 and (m.rank == 1 or kept[m.rank - 2] < 0.9)


def test_opposite_signs_are_reported(tmp_path):
    a = lora(tmp_path / "a.safetensors", {ATTN: (32, 768, 4)}, 1)
    b = lora(tmp_path / "b.safetensors", {ATTN: (32, 768, 4), CONV: (32, 32, 2)}, 1)  # same factors as a
    c = lora(tmp_path / "c.safetensors", {ATTN: (32, 768, 4)}, 3)
    entries = [ls.StackEntry(a, 1.0), ls.StackEntry(b, -0.5), ls.StackEntry(c, 1.0)]
    report = ls.merge_lora_stack(entries, tmp_path / "m.safetensors", ls.StackOptions(rank=4))
    opposed = {(i, j): c for i, j, c in report.modules[ATTN].opposed}
    assert opposed[(1, 2)] == pytest.approx(-1.0, abs=1e-5)  # b is -a/2 on this module
    assert all(c < 0 for c in opposed.values()) and report.modules[CONV].opposed == ()
    assert any("opposite directions" in line for line in report.lines())
    assert any("LoRA 1 vs LoRA 2, cosine -1.000" in line for line in report.lines())


def test_block_weights_and_peft_names(tmp_path):
    out_block = "lora_unet_output_blocks_3_1_proj_in"
    a = lora(tmp_path / "a.safetensors", {ATTN: (32, 768, 4), out_block: (32, 32, 4)}, 1)
    peft = lora(tmp_path / "p.safetensors", {ATTN: (32, 768, 2)}, 5, names=("lora_B.weight", "lora_A.weight"))
    entries = [ls.StackEntry(a, 1.0, blocks={"OUT*": 0.0, "IN01": 0.5}), ls.StackEntry(peft, 1.0)]
    out = tmp_path / "m.safetensors"
    report = ls.merge_lora_stack(entries, out, ls.StackOptions(rank=6, dtype="fp32"))
    assert out_block in report.zero and out_block not in report.modules
    want = 0.5 * expected(entries[:1], ATTN) + expected(entries[1:], ATTN)
    assert torch.allclose(merged_delta(out, ATTN), want, atol=1e-5 * want.abs().max())


def test_loha_and_lokr_join_the_sum_exactly(tmp_path):
    g = torch.Generator().manual_seed(7)
    shapes = {"hada_w1_a": (32, 2), "hada_w1_b": (2, 768), "hada_w2_a": (32, 2), "hada_w2_b": (2, 768)}
    loha = {f"{ATTN}.{part}": torch.randn(*shape, generator=g) for part, shape in shapes.items()}
    loha[f"{ATTN}.alpha"] = torch.tensor(1.0)
    lokr = {f"{ATTN}.lokr_w1": torch.randn(4, 8, generator=g),
            f"{ATTN}.lokr_w2": torch.randn(8, 96, generator=g)}
    save_file(loha, str(tmp_path / "h.safetensors"))
    save_file(lokr, str(tmp_path / "k.safetensors"))
    a = lora(tmp_path / "a.safetensors", {ATTN: (32, 768, 4)}, 1)
    entries = [ls.StackEntry(a, 1.0), ls.StackEntry(tmp_path / "h.safetensors", 0.7),
               ls.StackEntry(tmp_path / "k.safetensors", -0.3)]
    out = tmp_path / "m.safetensors"
    report = ls.merge_lora_stack(entries, out, ls.StackOptions(rank=32, dtype="fp32"))
    want = expected(entries, ATTN)
    assert torch.allclose(merged_delta(out, ATTN), want, atol=1e-4 * want.abs().max())
    assert report.modules[ATTN].rank == 32 and report.modules[ATTN].error < 1e-5


def refused(entries, out, match, **options):
    with pytest.raises((ValueError, OSError), match=match):
        ls.merge_lora_stack(entries, out, ls.StackOptions(**options))
    return out


def test_bad_input_is_refused_and_nothing_is_written(pair, tmp_path):
    out = tmp_path / "m.safetensors"
    out.write_bytes(b"keep")
    sdxl = lora(tmp_path / "x.safetensors", {ATTN: (32, 2048, 4)}, 1)
    other = lora(tmp_path / "o.safetensors", {CONV: (32, 64, 4)}, 1, conv=(CONV,))
    refused([pair[0], ls.StackEntry(sdxl)], out, r"LoRA 2 \(x.safetensors\) is a sdxl LoRA but LoRA 1 "
            r"\(a.safetensors\) is sd15", overwrite=True)
    refused([pair[0], ls.StackEntry(other)], out, r"module lora_unet_input_blocks_1_0_in_layers_2 as a 32 "
            r"x 576 weight, LoRA 1 \(a.safetensors\) as 64 x 576", overwrite=True)
    refused(pair, out, r"rank 49 is larger than module lora_te_text_model_encoder_layers_0_mlp_fc1 can hold "
            r"\(its weight is 96 x 48, so at most rank 48", rank=49, overwrite=True)
    refused([ls.StackEntry(tmp_path / "aa.safetensors")], out, r"no such file \(did you mean 'a.safetensors'",
            overwrite=True)
    refused([pair[0]], out, "exists; choose another name")
    refused([ls.StackEntry(pair[0].path, math.inf)], out, "not a finite number", overwrite=True)
    refused([ls.StackEntry(pair[0].path, blocks={"IN1": 0})], out, "did you mean 'IN01'", overwrite=True)
    refused([ls.StackEntry(pair[0].path, 1e12)], out, r"inf or NaN in fp16 .*write fp32 or bf16",
            overwrite=True)
    broken = load_file(str(pair[1].path))
    broken[f"{ATTN}.lora_up.weight"][0, 0] = math.nan
    save_file(broken, str(tmp_path / "nan.safetensors"))
    refused([ls.StackEntry(tmp_path / "nan.safetensors")], out, f"nan.safetensors: module {ATTN} has inf or "
            "NaN in its lora_up.weight", overwrite=True)
    dora = {**load_file(str(pair[1].path)), f"{ATTN}.dora_scale": torch.ones(64, 1)}
    save_file(dora, str(tmp_path / "dora.safetensors"))
    refused([ls.StackEntry(tmp_path / "dora.safetensors")], out, f"module {ATTN} is DoRA", overwrite=True)
    refused([ls.StackEntry(pair[0].path, 0.0)], out, "every module of the stack adds zero", overwrite=True)
    with pytest.raises(ValueError, match="give a rank >= 1"):
        ls.StackOptions(rank=0)
    assert out.read_bytes() == b"keep"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no partial file


@pytest.mark.parametrize("parts", [
    {"hada_w1_a": (24, 3), "hada_w1_b": (3, 90), "hada_w2_a": (24, 2), "hada_w2_b": (2, 90), "alpha": ()},
    {"lokr_w1": (4, 6), "lokr_w2_a": (5, 2), "lokr_w2_b": (2, 15), "alpha": ()},
    {"lokr_w1_a": (4, 2), "lokr_w1_b": (2, 3), "lokr_w2": (6, 5, 3, 3)},  # a convolution's Kronecker factor
    {"lora_up.weight": (8, 3, 1, 1), "lora_down.weight": (3, 4, 3, 3), "alpha": ()},
])
def test_module_factors_multiply_to_the_module_delta(parts):
    from patchbay_merge.lora import module_factors

    g = torch.Generator().manual_seed(3)
    t = {part: torch.randn(*shape, generator=g) if shape else torch.tensor(1.5)
         for part, shape in parts.items()}
    up, down = module_factors(t)
    delta = module_delta(t)
    assert torch.allclose(up @ down, delta.reshape(delta.shape[0], -1), atol=1e-5)


def test_command_line(pair, tmp_path, capsys):
    from patchbay_merge import cli

    out = tmp_path / "m.safetensors"
    a, b = pair[0].path, pair[1].path
    assert cli.main(["lora-stack", str(out), f"{a}:0.8:0.5", f"{b}:-0.6", "--rank", "12", "--dtype", "fp32",
                     "--blocks", '2={"IN01": 0.5}']) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "3 modules (sd15)" in printed
    want = expected(pair[:1], ATTN) - 0.6 * 0.5 * expected([ls.StackEntry(b)], ATTN)
    assert torch.allclose(merged_delta(out, ATTN), want, atol=1e-5 * want.abs().max())
    assert cli.main(["lora-stack", str(out), str(a), "--blocks", "3={}"]) == 2
    assert "--blocks '3={}': write N=MAP with N the LoRA's position, 1 to 1" in capsys.readouterr().err
    assert cli.main(["lora-stack", str(out), str(a), "--rank", "999", "--overwrite"]) == 2
    assert "rank 999 is larger than module" in capsys.readouterr().err


def test_families_of_the_tiny_loras_and_a_cross_family_stack_refused(models, tmp_path):
    """Family from the module names (kohya diffusers and LDM names, BFL) and the weights' shapes; an SD1.5
    and an SDXL LoRA in one stack are refused before anything is read or written."""
    from patchbay_merge import io as mio

    def family(stem: str) -> str:
        return ls._open(ls.StackEntry(models.loras[stem]), 1).arch

    assert {stem: family(stem) for stem in ("patchbay-lora-r4", "patchbay-locon-r8", "patchbay-loha-r4",
                                            "patchbay-lokr-r8", "patchbay-sdxl-locon-r8",
                                            "patchbay-flux-kohya-r8", "patchbay-flux-diffusers-r8")} == {
        "patchbay-lora-r4": "sd15", "patchbay-locon-r8": "sd15", "patchbay-loha-r4": "sd15",
        "patchbay-lokr-r8": "sd15", "patchbay-sdxl-locon-r8": "sdxl", "patchbay-flux-kohya-r8": "flux",
        "patchbay-flux-diffusers-r8": "unknown"}  # diffusers DiT names: no probe of the table
    refused([ls.StackEntry(models.loras["patchbay-flux-bfl-r8"])], tmp_path / "m.safetensors",
            "tensor double_blocks.0.img_attn.norm.key_norm.scale is a weight the LoRA sets")
    entries = [ls.StackEntry(models.loras["patchbay-lora-r4"]),
               ls.StackEntry(models.loras["patchbay-sdxl-locon-r8"])]
    refused(entries, tmp_path / "m.safetensors", "is a sdxl LoRA but LoRA 1 .* is sd15")
    assert not list(tmp_path.iterdir())
    assert mio.SafetensorsFile(models.loras["patchbay-lora-r4"]).arch == "lora-kohya"  # io's view: a LoRA


def test_sdxl_block_weights_place_ldm_names_in_their_blocks(models, tmp_path):
    """SDXL's LDM-named LoCon: OUT blocks at 0 leave out exactly the output_blocks modules."""
    lora_file = models.loras["patchbay-sdxl-locon-r8"]
    entry = ls.StackEntry(lora_file, 0.7, blocks={"OUT*": 0.0})
    report = ls.merge_lora_stack([entry], tmp_path / "m.safetensors", ls.StackOptions(rank=8))
    assert report.arch == "sdxl" and report.zero and all("output_blocks" in m for m in report.zero)
    assert not any("output_blocks" in m for m in report.modules)
    assert all(m.error < 1e-5 for m in report.modules.values())  # one rank-8 LoRA at rank 8: exact
