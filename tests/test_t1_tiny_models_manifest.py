"""T1: the files built from ComfyUI's own classes regenerate, on the ComfyUI under test, to the sums in
devtools/models.sha256: one manifest serves every tested version (0.33 renames Flux's RMSNorm weights
and adds FluxParams fields and diffusers names that 0.3.75 does not have; the ControlNet is built
from each version's own comfy.cldm; the Wan 2.2 experts, their LoRAs and the Wan 2.1 VAE from each
version's own Wan classes)."""

from __future__ import annotations

import sys

import devpaths
import pytest
import tiny_arch
import tiny_controlnet
import tiny_wan
from progress import run_watched

pytestmark = pytest.mark.t1


def test_arch_files_regenerate_to_the_one_manifest(tmp_path):
    rels = tiny_arch.all_rels() + tiny_controlnet.all_rels() + tiny_wan.all_rels()
    command = [sys.executable, str(devpaths.ROOT / "devtools" / "tiny_models.py"), "--out", str(tmp_path),
               "--only", *rels]
    result = run_watched(command, capture_output=True, text=True)
    version = devpaths.comfyui_version()
    assert result.returncode == 0, f"on ComfyUI {version}:\n{result.stdout}\n{result.stderr}"
    assert f"{len(rels)} generated" in result.stdout
    assert all((tmp_path / rel).is_file() for rel in rels)
