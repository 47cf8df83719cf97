"""T0: devtools/env.sh refuses clearly when Python 3.11, the local torch wheels, the ComfyUI version or
the vendored ComfyUI 0.33 archive is wrong or missing."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from progress import run_watched

pytestmark = pytest.mark.t0

ENV_SH = Path(__file__).resolve().parent.parent / "devtools" / "env.sh"


def run_env(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    base = {**os.environ, "PATCHBAY_CACHE": str(tmp_path / "cache")}
    return run_watched(["bash", str(ENV_SH), *args], env={**base, **env}, capture_output=True, text=True)


def test_missing_python_says_what_to_do(tmp_path):
    result = run_env(tmp_path, PATCHBAY_PYTHON="python3.11-not-here")
    assert result.returncode == 1
    assert "Python 3.11 ('python3.11-not-here') not found" in result.stderr
    assert "PATCHBAY_PYTHON" in result.stderr


def test_wrong_python_version_is_refused(tmp_path):
    fake = tmp_path / "python-fake"
    fake.write_text("#!/bin/sh\n[ \"$1\" = -V ] && echo 'Python 3.9.1'; exit 1\n")
    fake.chmod(0o755)
    result = run_env(tmp_path, PATCHBAY_PYTHON=str(fake))
    assert result.returncode == 1
    assert "is not Python 3.11 (it is Python 3.9.1)" in result.stderr


def test_missing_torch_wheel_says_where_it_looked(tmp_path):
    empty = tmp_path / "wheels"
    empty.mkdir()
    result = run_env(tmp_path, PATCHBAY_WHEEL_DIRS=str(empty))
    assert result.returncode == 1
    assert f"no local torch-2.14.1 wheel for CPython 3.11 x86_64 in: {empty}" in result.stderr
    assert "PATCHBAY_WHEEL_DIRS" in result.stderr
    assert not list((tmp_path / "cache").glob("env-*/venv")), "a refused build must leave no half environment"


def test_unknown_comfyui_version_names_the_tested_ones(tmp_path):
    result = run_env(tmp_path, "--comfyui", "0.40")
    assert result.returncode == 1
    assert "unknown ComfyUI version '0.40': the tested ones are 0.3.75 and 0.33" in result.stderr


def test_missing_vendor_archive_says_where_it_looked(tmp_path):
    vendor = tmp_path / "vendor"
    vendor.mkdir()
    result = run_env(tmp_path, "--comfyui", "0.33", PATCHBAY_VENDOR=str(vendor))
    assert result.returncode == 1
    assert f"unpacked from {vendor}/comfyui-0.33.0.tar.gz, which is missing" in result.stderr
    assert "PATCHBAY_VENDOR" in result.stderr
    assert not list((tmp_path / "cache").glob("env-*/venv")), "a refused build must leave no half environment"


def test_vendor_archive_with_another_sha256_is_refused(tmp_path):
    vendor = tmp_path / "vendor"
    vendor.mkdir()
    (vendor / "comfyui-0.33.0.tar.gz").write_bytes(b"not the snapshot")
    result = run_env(tmp_path, "--comfyui=0.33.0", PATCHBAY_VENDOR=str(vendor))
    assert result.returncode == 1
    assert "does not have the pinned sha256" in result.stderr
