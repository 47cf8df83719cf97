"""T0: devtools/env.sh refuses clearly when Python 3.11 or the local torch wheels are missing."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.t0

ENV_SH = Path(__file__).resolve().parent.parent / "devtools" / "env.sh"


def run_env(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    base = {**os.environ, "PATCHBAY_CACHE": str(tmp_path / "cache")}
    return subprocess.run(["bash", str(ENV_SH)], env={**base, **env}, capture_output=True, text=True,
                          timeout=60)


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
