"""The newest ComfyUI frontend, served by a test server in place of the one its ComfyUI pins.

Why: each tested ComfyUI pins an older frontend (0.3.75: 1.32.9, 0.33: 1.49.6), but users update
the frontend sooner than ComfyUI, and the newest one draws nodes in two designs (classic canvas and
Nodes 2.0, DOM elements that are taller), so the T3 layout checks run on it in both designs
(tests/test_t3_frontend.py). ComfyUI serves it with ``main.py --front-end-root <static folder>``.

Data flow::

    PyPI comfyui-frontend-package==NEWEST (pip download, no deps), sha256 pinned here
      -> $PATCHBAY_CACHE (default ~/.cache/patchbay)/frontend-<version>-<sha256[:16]>/static
         unpacked once (a temporary folder renamed into place), reused while the pin holds; never
         inside the clone
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import devpaths

__all__ = ["NEWEST", "NEWEST_SHA256", "NewestFrontendError", "ensure_static"]

NEWEST = "1.58.1"
NEWEST_SHA256 = "37912597537a731a8f421179618a736c24184c5bdbfa327f38b2fb7c291852d9"  # the py3-none-any wheel
PACKAGE = "comfyui-frontend-package"


class NewestFrontendError(RuntimeError):
    """The pinned frontend wheel could not be fetched, or is not the one pinned."""


def ensure_static(version: str = NEWEST, sha256: str = NEWEST_SHA256) -> Path:
    """The frontend's static folder (for ``--front-end-root``), fetched and unpacked if not cached."""
    target = devpaths.env_cache_dir() / f"frontend-{version}-{sha256[:16]}"
    static = target / "static"
    if (static / "index.html").is_file():
        return static
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".frontend-") as scratch:
        wheel = _download(version, Path(scratch))
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if digest != sha256:
            raise NewestFrontendError(f"{wheel.name} has sha256 {digest}, not the pinned {sha256} "
                                      f"(devtools/newest_frontend.py NEWEST_SHA256)")
        unpacked = Path(scratch) / "unpacked"
        with zipfile.ZipFile(wheel) as archive:
            members = [m for m in archive.namelist() if m.startswith("comfyui_frontend_package/static/")]
            archive.extractall(unpacked, members)
        shutil.rmtree(target, ignore_errors=True)
        (unpacked / "comfyui_frontend_package").rename(target)
    return static


def _download(version: str, folder: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q", "--no-deps",
               "--only-binary", ":all:", "-d", str(folder), f"{PACKAGE}=={version}"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    wheels = sorted(folder.glob("comfyui_frontend_package-*.whl"))
    if done.returncode != 0 or not wheels:
        raise NewestFrontendError(f"pip could not download {PACKAGE}=={version} (the T3 layout tests "
                                  f"serve it): {done.stderr.strip()[-500:]}")
    return wheels[0]


if __name__ == "__main__":
    print(ensure_static())
