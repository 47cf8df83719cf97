"""T0: ``patchbay-merge``, the merge command line as an installed console entry (issue 16, item 11).

The repo is installed (``pip install --no-deps --no-build-isolation --target``, from a copy: a build
writes into its source) into a folder of its own; the entry point must resolve through the package
metadata, run, and write the same file as ``devtools/patchbay_merge.py`` for the same recipe.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

pytestmark = pytest.mark.t0

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    source, target = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("site")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "merge", source / "merge", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(target), str(source)], check=True, capture_output=True)
    return target


def run(installed: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(installed)}
    return subprocess.run([str(installed / "bin" / "patchbay-merge"), *args], env=env, capture_output=True,
                          text=True, check=False)


def test_the_entry_point_resolves_to_the_installed_cli(installed):
    (dist,) = metadata.distributions(path=[str(installed)])
    (entry,) = [ep for ep in dist.entry_points if ep.group == "console_scripts"]
    assert (entry.name, entry.value) == ("patchbay-merge", "patchbay_merge.cli:main")
    probe = ("from importlib import metadata; (ep,) = [e for e in metadata.entry_points("
             "group='console_scripts') if e.name == 'patchbay-merge']; main = ep.load(); "
             "print(main.__module__, main.__code__.co_filename)")
    loaded = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": str(installed)},
                            capture_output=True, text=True, check=True, cwd=installed)  # a clean interpreter
    module, filename = loaded.stdout.split()
    assert module == "patchbay_merge.cli" and filename == str(installed / "patchbay_merge" / "cli.py")
    packages = sorted(p.name for p in installed.iterdir() if (p / "__init__.py").exists())
    assert packages == ["patchbay_merge"]  # only the merge library: no nodes, hooks, patcher or tests
    assert (installed / "patchbay_merge" / "methods" / "linear.py").is_file()


def test_the_installed_command_runs_and_writes_what_the_devtools_script_writes(installed, tmp_path):
    listed = run(installed, "methods")
    assert listed.returncode == 0 and "weighted_sum" in listed.stdout and "ties_sum" in listed.stdout
    gen = torch.Generator().manual_seed(0)
    for name in ("a", "b"):
        save_file({"model.diffusion_model.out.2.weight": torch.randn(8, 6, generator=gen).half()},
                  str(tmp_path / f"{name}.safetensors"))
    recipe = tmp_path / "r.mecha"
    recipe.write_text('version 0.1.0\nmodel "a.safetensors"\nmodel "b.safetensors"\n'
                      'merge "weighted_sum" &0 &1 alpha=0.3')
    made = run(installed, "merge", str(recipe), str(tmp_path / "entry.safetensors"), "--no-progress")
    assert made.returncode == 0, made.stderr
    script = subprocess.run([sys.executable, str(ROOT / "devtools" / "patchbay_merge.py"), "merge",
                             str(recipe), str(tmp_path / "script.safetensors"), "--no-progress"],
                            capture_output=True, text=True, check=False)
    assert script.returncode == 0, script.stderr
    assert (tmp_path / "entry.safetensors").read_bytes() == (tmp_path / "script.safetensors").read_bytes()
    bad = run(installed, "merge", str(recipe), str(tmp_path / "entry.safetensors"), "--no-progress")
    assert bad.returncode == 2 and bad.stderr.startswith("error:") and "exists" in bad.stderr
