"""Other packs' source trees from the shared vendor folder, unpacked into a cache for the test server.

Patchbay promises to chain with AnimateDiff-Evolved and Advanced-ControlNet, so the T2/T3 server
loads the real packs next to Patchbay (devtools/comfy_server.py ``extra_packs``). CI cannot download
them; the vendor folder keeps pinned snapshots (its README says which commit runs on which ComfyUI).

Data flow::

    $PATCHBAY_VENDOR (default ../shared/vendor)/<archive>.tar.gz   read-only, sha256 pinned here
      -> $PATCHBAY_CACHE (default ~/.cache/patchbay)/vendor/<archive stem>-<sha256[:16]>/<pack folder>
         unpacked once (a temporary folder renamed into place), reused while the sum matches; never
         inside the clone
      -> comfy_server links it into its custom_nodes folder as <pack name> (the name users clone to);
         devtools/gguf_sampling.py loads COMFYUI_GGUF in-process for the t1 GGUF tests

Neither AnimateDiff-Evolved nor Advanced-ControlNet needs a Python package that ComfyUI's own
requirements do not already bring; ComfyUI-GGUF needs ``gguf`` (pinned in the lock files).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import devpaths

__all__ = ["COMFYUI_GGUF", "VendorArchive", "VendorError", "ensure_packs", "ensure_unpacked", "packs_for"]


class VendorError(RuntimeError):
    """A vendor archive is missing, differs from its pinned sum, or does not hold the expected folder."""


@dataclass(frozen=True)
class VendorArchive:
    """One archive of the vendor folder: its file name, pinned sha256, top folder and pack name."""

    archive: str
    sha256: str
    folder: str  # the archive's top-level folder
    name: str  # the custom_nodes folder name it is loaded under (the repository's name)


ANIMATEDIFF = VendorArchive(
    "ComfyUI-AnimateDiff-Evolved.tar.gz",
    "192441997e485bb90ec7536059be5a7430bab4f21ecd9e13c3b32b26333d1818",
    "ComfyUI-AnimateDiff-Evolved", "ComfyUI-AnimateDiff-Evolved")
CONTROLNET_0_3_75 = VendorArchive(
    "ComfyUI-Advanced-ControlNet-2bde95a.tar.gz",
    "8e4c8060e96211111ef001068264562f422c8f6f0cf4b21204dafd1135089eb4",
    "ComfyUI-Advanced-ControlNet-2bde95a", "ComfyUI-Advanced-ControlNet")
CONTROLNET_0_33 = VendorArchive(
    "ComfyUI-Advanced-ControlNet-9e60d8a.tar.gz",
    "d972c10e45300318a14b092303f66004ccfa5cb95f3497048385af3298de5632",
    "ComfyUI-Advanced-ControlNet-9e60d8a", "ComfyUI-Advanced-ControlNet")
COMFYUI_GGUF = VendorArchive(
    "ComfyUI-GGUF.tar.gz",
    "abe0f2c87fdfe2b96afba639687a19036639cd6abfa0ba2ff79a939a5fd1c14e",  # commit 795e451
    "ComfyUI-GGUF", "ComfyUI-GGUF")
# Advanced-ControlNet after 2bde95a needs a newer ComfyUI than 0.3.75 (the vendor README).
PACKS = {"0.3.75": (ANIMATEDIFF, CONTROLNET_0_3_75), "0.33.0": (ANIMATEDIFF, CONTROLNET_0_33)}


def packs_for(comfyui_version: str) -> tuple[VendorArchive, ...]:
    """The vendor packs loaded next to Patchbay on this ComfyUI version."""
    if comfyui_version not in PACKS:
        raise VendorError(f"no vendor packs are pinned for ComfyUI {comfyui_version}; the tested versions "
                          f"are {', '.join(PACKS)} (devtools/vendor_packs.py PACKS)")
    return PACKS[comfyui_version]


def ensure_packs(comfyui_version: str) -> dict[str, Path]:
    """``{pack name: unpacked folder}`` for this ComfyUI version, unpacking what is not cached yet."""
    return {pack.name: ensure_unpacked(pack) for pack in packs_for(comfyui_version)}


def ensure_unpacked(pack: VendorArchive, cache: Path | None = None) -> Path:
    """The folder ``pack`` unpacks to, under ``cache`` (default: ``vendor/`` in the cache outside the
    clone)."""
    stem = pack.archive.removesuffix(".tar.gz")
    target = (cache or devpaths.env_cache_dir() / "vendor") / f"{stem}-{pack.sha256[:16]}"
    if (target / pack.folder).is_dir():
        return target / pack.folder
    archive = devpaths.vendor_dir() / pack.archive
    if not archive.is_file():
        raise VendorError(f"{archive} is missing: set PATCHBAY_VENDOR to the folder that holds "
                          f"{pack.archive} (the shared vendor folder).")
    if (found := _sha256(archive)) != pack.sha256:
        raise VendorError(f"{archive} has sha256 {found}, not the pinned {pack.sha256}: it is not the "
                          "snapshot the tests were written for (devtools/vendor_packs.py).")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(staging, filter="data")
        if not (staging / pack.folder).is_dir():
            raise VendorError(f"{archive} holds no top-level folder {pack.folder}")
        os.replace(staging, target)  # another process may have won the race: then keep its copy
    except OSError:
        if not (target / pack.folder).is_dir():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target / pack.folder


def _sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()
