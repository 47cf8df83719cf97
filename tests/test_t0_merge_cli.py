"""T0: the merge command line (merge/cli.py) in-process, and its console entry devtools/patchbay_merge.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.t0

ROOT = Path(__file__).resolve().parent.parent
KEYS = {"model.diffusion_model.input_blocks.1.1.proj_in.weight": (6, 5),
        "model.diffusion_model.out.2.weight": (4, 6, 3, 3), "model.diffusion_model.out.2.bias": (4,)}


@pytest.fixture(scope="module")
def cli(pack):
    from patchbay.merge import cli

    return cli


@pytest.fixture
def folder(tmp_path):
    for name, seed in (("a", 1), ("b", 2), ("c", 3)):
        gen = torch.Generator().manual_seed(seed)
        tensors = {k: torch.randn(s, generator=gen) for k, s in KEYS.items()}
        save_file(tensors, str(tmp_path / f"{name}.safetensors"))
    return tmp_path


def write_recipe(folder: Path, *lines: str, name: str = "r.mecha") -> Path:
    path = folder / name
    path.write_text("\n".join(["version 0.1.0", *lines]))
    return path


WEIGHTED_SUM = ('model "a.safetensors"', 'model "b.safetensors"', 'merge "weighted_sum" &0 &1 alpha=0.25')


def test_merge_writes_the_recipe_result_and_embeds_the_recipe(cli, folder, capsys):
    recipe = write_recipe(folder, *WEIGHTED_SUM)
    out = folder / "out.safetensors"
    assert cli.main(["merge", str(recipe), str(out), "--dtype", "fp32", "--no-progress"]) == 0
    assert "wrote" in capsys.readouterr().out
    a, b, merged = (load_file(str(folder / n)) for n in ("a.safetensors", "b.safetensors", "out.safetensors"))
    for key in KEYS:
        torch.testing.assert_close(merged[key], torch.lerp(a[key], b[key], 0.25), rtol=0, atol=1e-6)
    from patchbay.merge import io

    assert 'merge "weighted_sum"' in io.SafetensorsFile(out).metadata["patchbay.recipe"]
    assert cli.main(["merge", str(recipe), str(out)]) == cli.EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert "exists" in err and "--overwrite" in err
    assert cli.main(["merge", str(recipe), str(out), "--overwrite", "--no-progress"]) == 0


def test_open_parameters_are_bound_with_param(cli, folder, capsys):
    recipe = write_recipe(folder, 'model "a.safetensors"', 'model "b.safetensors"', 'param "alpha"',
                          'merge "weighted_sum" &0 &1 alpha=&2')
    out = folder / "out.safetensors"
    assert cli.main(["show", str(recipe)]) == 0
    assert "open (bind with --param): alpha" in capsys.readouterr().out
    command = ["merge", str(recipe), str(out), "--param", "alpha=1", "--dtype", "fp32", "--no-progress"]
    assert cli.main(command) == 0
    assert torch.equal(load_file(str(out))["model.diffusion_model.out.2.bias"],
                       load_file(str(folder / "b.safetensors"))["model.diffusion_model.out.2.bias"])


def test_show_and_validate(cli, folder, capsys):
    recipe = write_recipe(folder, *WEIGHTED_SUM)
    assert cli.main(["show", str(recipe)]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("version 0.1.0\n") and "# methods: weighted_sum" in shown
    assert cli.main(["validate", str(recipe)]) == 0
    assert capsys.readouterr().out.startswith("ok: 3 keys, unknown, 2 inputs (a.safetensors, b.safetensors)")


@pytest.mark.parametrize(("lines", "message"), [
    (('model "a.safetensors"', 'merge "weighted_summ" &0 &0'), "did you mean 'weighted_sum'"),
    (('model "a.safetensors"', 'merge "weighted_sum" &0 &7'), "line 3, column"),
    (('model "a.safetensors"', 'model "missing.safetensors"', 'merge "weighted_sum" &0 &1'),
     "missing.safetensors: no such file"),
    (('model "a.safetensors"', 'model "b.safetensors"', 'merge "weighted_sum" &0 &1 beta=2'),
     "no parameter 'beta'"),
])
def test_user_errors_exit_2_with_one_line_and_no_output(cli, folder, capsys, lines, message):
    recipe = write_recipe(folder, *lines)
    for command in (["validate", str(recipe)], ["merge", str(recipe), str(folder / "out.safetensors")]):
        assert cli.main(command) == cli.EXIT_USER_ERROR
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and "Traceback" not in err
    assert not (folder / "out.safetensors").exists()


def test_plan_errors_exit_2(cli, folder, capsys):
    biases = {k: torch.zeros(s) for k, s in KEYS.items() if k.endswith("bias")}
    save_file(biases, str(folder / "small.safetensors"))
    recipe = write_recipe(folder, 'model "a.safetensors"', 'model "small.safetensors"',
                          'merge "weighted_sum" &0 &1')
    out = folder / "out.safetensors"
    assert cli.main(["merge", str(recipe), str(out), "--missing-policy", "error"]) == cli.EXIT_USER_ERROR
    assert "missing from some inputs" in capsys.readouterr().err and not out.exists()


def test_extract_writes_a_lora(cli, folder, capsys):
    recipe = write_recipe(folder, 'model "b.safetensors"', 'model "a.safetensors"', 'merge "subtract" &0 &1')
    out = folder / "lora.safetensors"
    assert cli.main(["extract", str(recipe), str(out), "--rank", "2", "--dtype", "fp32"]) == 0
    assert "2 modules" in capsys.readouterr().out
    lora = load_file(str(out))
    assert lora["lora_unet_out_2.lora_down.weight"].shape == (2, 6, 3, 3)
    assert lora["lora_unet_input_blocks_1_1_proj_in.lora_up.weight"].shape == (6, 2)


def test_extract_by_energy_keeps_the_smallest_rank_that_reaches_it(pack):
    from patchbay.merge import extract

    u, _ = torch.linalg.qr(torch.randn(6, 6, generator=torch.Generator().manual_seed(0)))
    delta = u[:, :3] @ torch.diag(torch.tensor([4.0, 3.0, 0.1])) @ u[:, 3:].T  # energies 16, 9, 0.01
    for energy, rank in ((0.6, 1), (0.639, 1), (0.64, 2), (0.9, 2), (1.0, 3)):
        up, down, got, error = extract.decompose(delta, None, energy)
        assert got == rank and up.shape == (6, rank) and down.shape == (rank, 6), energy
    up, down, _, error = extract.decompose(delta.reshape(6, 6, 1, 1), 2, None)
    assert up.shape == (6, 2, 1, 1) and down.shape == (2, 6, 1, 1)
    assert abs(error - (0.01 / 25.01) ** 0.5) < 1e-4
    assert (up.flatten(1) @ down.flatten(1) - delta).norm() / delta.norm() == pytest.approx(error, abs=1e-4)


def test_methods_lists_every_method_with_its_doc(cli, capsys):
    assert cli.main(["methods"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("weighted_sum ") and "alpha" in line for line in lines)
    assert len(lines) >= 20


def test_console_entry_runs_without_the_pack_root(tmp_path):
    entry = ROOT / "devtools" / "patchbay_merge.py"
    probe = textwrap.dedent(f"""
        import runpy, sys
        sys.argv = ["patchbay_merge.py", "methods"]
        try:
            runpy.run_path({str(entry)!r}, run_name="__main__")
        except SystemExit as exit:
            code = exit.code
        assert "patchbay.merge" in sys.modules and "patchbay.nodes" not in sys.modules
        assert {str(ROOT)!r} not in sys.path
        sys.exit(code)
    """)
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert "weighted_sum" in result.stdout
