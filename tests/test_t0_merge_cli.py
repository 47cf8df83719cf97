"""T0: the merge command line (merge/cli.py) in-process, and its console entry devtools/patchbay_merge.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from progress import communicate_watched
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.t0

ROOT = Path(__file__).resolve().parent.parent
KEYS = {"model.diffusion_model.input_blocks.1.1.proj_in.weight": (6, 5),
        "model.diffusion_model.out.2.weight": (4, 6, 3, 3), "model.diffusion_model.out.2.bias": (4,)}


@pytest.fixture(scope="module")
def cli():
    from patchbay_merge import cli

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
    from patchbay_merge import io

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


def test_extract_by_energy_keeps_the_smallest_rank_that_reaches_it():
    from patchbay_merge import extract

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
        assert "patchbay_merge.cli" in sys.modules and "merge" not in sys.modules
        assert "nodes" not in sys.modules and "patchbay" not in sys.modules
        assert {str(ROOT)!r} not in sys.path
        sys.exit(code)
    """)
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert "weighted_sum" in result.stdout


# ---- no traceback, ever (issue 20) ---------------------------------------------------------------


@pytest.mark.parametrize(("line", "message"), [
    ('merge "slerp" &0 &1 alpha=1e308', "slerp(alpha=1e+308) failed: value cannot be converted"),
    ('merge "rotate" &0 &1 centralization=-1e308', "rotate(alignment=1.0, alpha=0.0, centralization=-1e+308"),
    ('merge "pick_component" &0 component="nope"', "pick_component(component='nope') failed: components"),
    ('merge "geometric_sum" &0 &1 alpha=1e30', "NaN; the recipe made it"),
    ('merge "weighted_sum" &0 &1 alpha=1e999', "1e999 is beyond the float range"),
    ('merge "crossover" &0 &1 alpha=2', "2 is outside [0, 1], the range of alpha"),
    ('merge "weighted_summ" &0 &1', "list them with `patchbay_merge.py methods`"),
    ("merge", "takes a quoted method name"),
    ('param 7', "parameter name 7 must be an identifier"),
])
def test_numerical_and_recipe_failures_are_one_line_naming_key_and_parameter(cli, folder, capsys, line,
                                                                              message):
    recipe = write_recipe(folder, 'model "a.safetensors"', 'model "b.safetensors"', line)
    out = folder / "out.safetensors"
    assert cli.main(["merge", str(recipe), str(out), "--no-progress"]) == cli.EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err, err
    assert err.count("\n") == (3 if "line 4, column" in err else 1)  # a syntax error shows its line
    assert sorted(p.name for p in folder.iterdir()) == ["a.safetensors", "b.safetensors", "c.safetensors",
                                                         "r.mecha"]


def test_nonfinite_warn_prints_the_count_and_first_keys(cli, folder, capsys):
    recipe = write_recipe(folder, 'model "a.safetensors"', 'model "b.safetensors"',
                          'merge "geometric_sum" &0 &1 alpha=1e30')
    out = folder / "out.safetensors"
    assert cli.main(["merge", str(recipe), str(out), "--no-progress", "--nonfinite", "warn"]) == 0
    err = capsys.readouterr().err
    assert "warning: 3 tensors hold inf or NaN and were written anyway (--nonfinite warn): model." in err
    assert "the recipe made it" in err and out.exists()


def test_binary_and_pickle_inputs_are_named(cli, folder, capsys):
    recipe = folder / "r.mecha"
    recipe.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    assert cli.main(["validate", str(recipe)]) == cli.EXIT_USER_ERROR
    assert f"error: {recipe}: not a text file (byte 0 is not UTF-8)" in capsys.readouterr().err
    torch.save({"state_dict": {"w": torch.zeros(2)}}, folder / "old.ckpt")
    write_recipe(folder, 'model "old.ckpt"', 'model "a.safetensors"', 'merge "weighted_sum" &0 &1')
    assert cli.main(["validate", str(recipe)]) == cli.EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert "old.ckpt: is a pickle checkpoint (.ckpt/.pt), not safetensors; only safetensors files" in err


SLOW_MERGE = """
import sys, time
sys.path.insert(0, {devtools!r})
import pack_imports
pack_imports.use_standalone_names()
from patchbay_merge import cli, method_registry as registry

def slow(a: registry.Weight) -> registry.Weight:
    \"\"\"Sleeps on every key so that the test can signal the merge while it runs.\"\"\"
    print("started", flush=True)
    time.sleep(0.5)
    return a

registry.merge_method(slow)
sys.exit(cli.main(["merge", {recipe!r}, {out!r}, "--no-progress"]))
"""


def test_sigterm_removes_the_partial_file_and_the_next_run_removes_stale_ones(cli, folder):
    import signal

    recipe = write_recipe(folder, 'model "a.safetensors"', 'merge "slow" &0')
    out = folder / "out.safetensors"
    probe = SLOW_MERGE.format(devtools=str(ROOT / "devtools"), recipe=str(recipe), out=str(out))
    process = subprocess.Popen([sys.executable, "-c", probe], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    assert process.stdout.readline() == "started\n"
    assert [p.name for p in folder.glob(".out.safetensors.*.partial")]  # the merge is writing
    process.send_signal(signal.SIGTERM)
    _, err = communicate_watched(process)
    assert process.returncode == 143 and err == "terminated: nothing was written\n"
    assert not out.exists() and not list(folder.glob(".*"))
    # partials of killed merges (no clean-up is possible after SIGKILL) go on the next run of that output
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()
    stale = [folder / f".out.safetensors.{exited.pid}-abc_1234.partial",
             folder / ".out.safetensors.x1y2z3w4.partial"]  # written before pids were part of the name
    running = folder / f".out.safetensors.{os.getppid()}-zzzz9999.partial"  # a running merge's file stays
    other = folder / f".out.safetensors.v2.{exited.pid}-abcd1234.partial"  # another output's file
    for path in (*stale, running, other):
        path.write_bytes(b"partial")
    write_recipe(folder, *WEIGHTED_SUM)
    assert cli.main(["merge", str(recipe), str(out), "--no-progress"]) == 0
    assert not any(path.exists() for path in stale) and running.exists() and other.exists()


SD15_KEYS = {"model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight": (4, 768),
             "model.diffusion_model.input_blocks.4.0.in_layers.2.weight": (3, 3),
             "model.diffusion_model.middle_block.1.proj_in.weight": (3, 3),
             "model.diffusion_model.out.2.weight": (3, 3)}


@pytest.mark.parametrize(("entries", "message"), [
    ("IN01=0.2 IN04=0.3 M00=0.4", "weighted_sum.alpha: the map has no entry for OUT11 (e.g. "
                                  "'model.diffusion_model.out.2.weight') and no 'default'; add those blocks"),
    ("IN0=0.2 default=0.5", "weighted_sum.alpha: map entry 'IN0' is no block of sd15 (BASE, IN00, IN01, "
                            "IN02, ...), no key and no glob; did you mean 'IN00' or 'IN10' or 'IN09'?"),
    ("IN01=0.2 model.diffusion_model.out.3.weight=1 default=0",
     "map entry 'model.diffusion_model.out.3.weight' is no block of sd15"),
    ("IN01=0.2 IN04=0.3 M00=0.4 OUT11=1", None),
    ("IN01=0.2 *.out.*=0.3 default=0.4", None),
])
def test_validate_resolves_every_block_map_against_the_models(cli, tmp_path, capsys, entries, message):
    for name, seed in (("a", 1), ("b", 2)):
        gen = torch.Generator().manual_seed(seed)
        tensors = {k: torch.randn(s, generator=gen) for k, s in SD15_KEYS.items()}
        save_file(tensors, str(tmp_path / f"{name}.st"))
    recipe = write_recipe(tmp_path, 'model "a.st"', 'model "b.st"', f"dict {entries}",
                          'merge "weighted_sum" &0 &1 alpha=&2')
    out = tmp_path / "out.safetensors"
    commands = (["validate", str(recipe)], ["merge", str(recipe), str(out), "--no-progress"],
                ["extract", str(recipe), str(out), "--rank", "1"])
    for command in commands if message else commands[:2]:  # (a weighted sum is no delta to extract)
        status = cli.main(command)
        err = capsys.readouterr().err
        if message is None:
            assert status == 0 and not err
        else:
            assert status == cli.EXIT_USER_ERROR and message in err and err.count("\n") == 1, err
            assert not out.exists()


def test_block_names_need_a_known_architecture(cli, folder, capsys):
    recipe = write_recipe(folder, 'model "a.safetensors"', 'model "b.safetensors"', "dict IN00=0.2 default=1",
                          'merge "weighted_sum" &0 &1 alpha=&2')
    assert cli.main(["validate", str(recipe)]) == cli.EXIT_USER_ERROR
    assert "map entry 'IN00' is no key and no glob, and block names need a known architecture (these " \
           "models are unknown: no family of merge/architectures.py matches them): use key globs" \
           in capsys.readouterr().err


def test_show_and_the_embedded_recipe_use_the_block_config_of_the_models(cli, tmp_path, capsys):
    for name, seed in (("a", 1), ("b", 2)):
        gen = torch.Generator().manual_seed(seed)
        tensors = {k: torch.randn(s, generator=gen) for k, s in SD15_KEYS.items()}
        save_file(tensors, str(tmp_path / f"{name}.st"))
    recipe = write_recipe(tmp_path, 'model "a.st"', 'model "b.st"', "dict IN01=0.2 default=0.5",
                          'merge "weighted_sum" &0 &1 alpha=&2')
    assert cli.main(["show", str(recipe)]) == 0
    shown = capsys.readouterr().out.split("\n# inputs")[0]
    assert 'model "a.st" merge_space="weight"' in shown
    assert "dict BASE=0.5 IN00=0.5 IN01=0.2 IN02=0.5" in shown
    assert shown.endswith('literal &2 model_config="sd1-supermerger_blocks" merge_space=null\n'
                          'merge "convert_sd1_blocks_to_ldm" &3\nmerge "weighted_sum" &0 &1 alpha=&4')
    assert cli.main(["show", str(recipe), "--compact"]) == 0
    assert capsys.readouterr().out.startswith('version 0.1.0\nmodel "a.st"\nmodel "b.st"\n'
                                              'dict IN01=0.2 default=0.5\n')
    out = tmp_path / "out.safetensors"
    assert cli.main(["merge", str(recipe), str(out), "--no-progress"]) == 0
    from patchbay_merge import io

    assert io.SafetensorsFile(out).metadata["patchbay.recipe"] == shown
