"""Where the development pieces live: the repo, ComfyUI, the generated models and the outputs.

Scripts in devtools/ import each other by plain module name (run them as ``python devtools/x.py``;
tests put devtools/ on sys.path). The repo root itself never goes on sys.path: its ``nodes``
package would shadow ComfyUI's ``nodes`` module.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACK_NAME = "ComfyUI-Patchbay"
WORKFLOWS_DIR = ROOT / "workflows"


def comfyui_dir() -> Path:
    """The ComfyUI folder made by devtools/env.sh, from $PATCHBAY_COMFYUI."""
    value = os.environ.get("PATCHBAY_COMFYUI")
    if not value:
        raise RuntimeError(
            "PATCHBAY_COMFYUI is not set: run through 'make test' / 'make demo', or set it to the "
            "'comfyui' folder that devtools/env.sh prints (e.g. $(devtools/env.sh)/comfyui)."
        )
    path = Path(value)
    if not (path / "main.py").is_file():
        raise RuntimeError(f"PATCHBAY_COMFYUI={value} holds no ComfyUI main.py; re-run devtools/env.sh.")
    return path


def comfyui_version() -> str:
    """The version of the ComfyUI in ``comfyui_dir()`` (its ``comfyui_version.py``, read, not imported)."""
    source = comfyui_dir() / "comfyui_version.py"
    found = re.search(r'__version__\s*=\s*"([^"]+)"', source.read_text()) if source.is_file() else None
    if found is None:
        raise RuntimeError(f"{source} gives no __version__: {comfyui_dir()} is not a ComfyUI that "
                           "devtools/env.sh made; re-run devtools/env.sh.")
    return found.group(1)


def cache_dir() -> Path:
    """Git-ignored cache inside the clone for generated files."""
    return Path(os.environ.get("PATCHBAY_REPO_CACHE", ROOT / ".cache"))


def env_cache_dir() -> Path:
    """The cache outside the clone (devtools/env.sh's environments, unpacked vendor packs)."""
    return Path(os.environ.get("PATCHBAY_CACHE", Path.home() / ".cache" / "patchbay"))


def models_store() -> Path:
    """Tiny models by content (files named by their sha256), shared by every clone on this machine:
    devtools/tiny_models.py links a clone's models from it instead of generating them again."""
    return env_cache_dir() / "models"


def vendor_dir() -> Path:
    """Third-party source archives (the shared vendor folder; $PATCHBAY_VENDOR moves it, as for env.sh)."""
    return Path(os.environ.get("PATCHBAY_VENDOR", ROOT.parent / "shared" / "vendor"))


def models_dir() -> Path:
    """Generated tiny models: ``checkpoints/`` and ``loras/`` below it."""
    return cache_dir() / "models"


def output_dir() -> Path:
    """Images, screenshots and reports that demos and tests write for people to look at."""
    return ROOT / "output"


def make_custom_nodes_dir(parent: Path) -> Path:
    """A ``custom_nodes`` folder in ``parent`` holding only a link named ComfyUI-Patchbay to this repo.

    ComfyUI loads every subfolder of a custom_nodes folder under the subfolder's name, so the pack
    is imported exactly as it is when a user clones it into ComfyUI/custom_nodes/ComfyUI-Patchbay.
    """
    folder = parent / "custom_nodes"
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / PACK_NAME
    if link.is_symlink() and link.resolve() != ROOT.resolve():  # left by a clone that has moved
        link.unlink()
    if not link.is_symlink():
        link.symlink_to(ROOT, target_is_directory=True)
    return folder
