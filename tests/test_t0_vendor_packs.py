"""T0: devtools/vendor_packs.py unpacks pinned vendor archives into a cache, once, and refuses others."""

from __future__ import annotations

import hashlib
import io
import tarfile

import devpaths
import pytest
import vendor_packs
from vendor_packs import VendorArchive, VendorError

pytestmark = pytest.mark.t0


def make_archive(folder, name: str = "Pack-abc1234") -> tuple[str, str]:
    """A .tar.gz holding ``name/__init__.py`` in ``folder``; returns (file name, sha256)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        data = b"NODE_CLASS_MAPPINGS = {}\n"
        info = tarfile.TarInfo(f"{name}/__init__.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    (folder / f"{name}.tar.gz").write_bytes(buffer.getvalue())
    return f"{name}.tar.gz", hashlib.sha256(buffer.getvalue()).hexdigest()


def test_unpacks_once_into_a_folder_keyed_by_the_sum(tmp_path, monkeypatch):
    vendor, cache = tmp_path / "vendor", tmp_path / "cache"
    vendor.mkdir()
    archive, digest = make_archive(vendor)
    monkeypatch.setenv("PATCHBAY_VENDOR", str(vendor))
    pack = VendorArchive(archive, digest, "Pack-abc1234", "Pack")
    folder = vendor_packs.ensure_unpacked(pack, cache)
    assert folder == cache / f"Pack-abc1234-{digest[:16]}" / "Pack-abc1234"
    assert (folder / "__init__.py").read_text() == "NODE_CLASS_MAPPINGS = {}\n"
    (vendor / archive).unlink()  # a second call reuses the cache and reads no archive
    assert vendor_packs.ensure_unpacked(pack, cache) == folder
    assert sorted(p.name for p in cache.iterdir()) == [folder.parent.name], "a staging folder was left"


def test_an_archive_that_is_not_the_pinned_one_is_refused(tmp_path, monkeypatch):
    vendor, cache = tmp_path / "vendor", tmp_path / "cache"
    vendor.mkdir()
    archive, digest = make_archive(vendor)
    monkeypatch.setenv("PATCHBAY_VENDOR", str(vendor))
    wrong = VendorArchive(archive, "0" * 64, "Pack-abc1234", "Pack")
    with pytest.raises(VendorError, match=rf"sha256 {digest}, not the pinned 0+"):
        vendor_packs.ensure_unpacked(wrong, cache)
    assert not cache.exists() or not any(cache.iterdir())
    missing = VendorArchive("Absent.tar.gz", digest, "Absent", "Absent")
    with pytest.raises(VendorError, match="Absent.tar.gz is missing: set PATCHBAY_VENDOR"):
        vendor_packs.ensure_unpacked(missing, cache)


def test_each_tested_comfyui_has_both_packs_pinned_as_the_vendor_folder_lists_them():
    sums = {}
    listing = devpaths.vendor_dir() / "SHA256SUMS"
    for line in listing.read_text().splitlines():
        digest, name = line.split()
        sums[name] = digest
    for version in ("0.3.75", "0.33.0"):
        packs = vendor_packs.packs_for(version)
        assert {p.name for p in packs} == {"ComfyUI-AnimateDiff-Evolved", "ComfyUI-Advanced-ControlNet"}
        for pack in packs:
            assert sums[pack.archive] == pack.sha256, f"{pack.archive} on ComfyUI {version}"
    assert sums[vendor_packs.COMFYUI_GGUF.archive] == vendor_packs.COMFYUI_GGUF.sha256
    with pytest.raises(VendorError, match="no vendor packs are pinned for ComfyUI 0.2.0"):
        vendor_packs.packs_for("0.2.0")
