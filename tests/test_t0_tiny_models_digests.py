"""T0: the tiny models' digest cache (devtools/tiny_models.stale_files): a file nobody wrote since it was
hashed is not read again, and any write (same size, same bytes even, or its time set back) makes it
hashed again, so a corrupted model is still found; and the store shared by clones (link_from_store,
keep_in_store): a clone links the pinned files it holds instead of generating them, never one changed
since it was stored."""

from __future__ import annotations

import hashlib
import os

import pytest
import tiny_models

pytestmark = pytest.mark.t0


def test_unchanged_files_are_not_hashed_again_and_any_write_is_seen(tmp_path, monkeypatch):
    hashed = []
    real = tiny_models.sha256
    monkeypatch.setattr(tiny_models, "sha256", lambda path: hashed.append(path.name) or real(path))
    rels = ["loras/a.safetensors", "loras/b.safetensors", "checkpoints/c.safetensors"]
    for index, rel in enumerate(rels):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(bytes([index]) * 1000)
    sums = {rel: hashlib.sha256((tmp_path / rel).read_bytes()).hexdigest() for rel in rels}

    assert tiny_models.stale_files(tmp_path, sums, rels) == [] and len(hashed) == 3
    assert tiny_models.stale_files(tmp_path, sums, rels) == [] and len(hashed) == 3, "hashed again"

    victim = tmp_path / rels[0]
    before = victim.stat()
    with open(victim, "r+b") as handle:  # corrupt in place: same size, modification time set back
        handle.write(b"\xff" * 16)
    os.utime(victim, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert tiny_models.stale_files(tmp_path, sums, rels) == [rels[0]]
    assert hashed[3:] == ["a.safetensors"]

    (tmp_path / rels[1]).unlink()
    assert tiny_models.stale_files(tmp_path, sums, rels) == [rels[0], rels[1]]


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"loras/a.safetensors": [0, 0, 0, 0, "x"]}'])
def test_a_broken_or_foreign_digest_file_only_costs_a_hash(tmp_path, content):
    rel = "loras/a.safetensors"
    (tmp_path / "loras").mkdir()
    (tmp_path / rel).write_bytes(b"weights")
    (tmp_path / tiny_models.DIGESTS).write_text(content)
    sums = {rel: hashlib.sha256(b"weights").hexdigest()}
    assert tiny_models.stale_files(tmp_path, sums, [rel]) == []
    assert tiny_models.stale_files(tmp_path, {rel: "0" * 64}, [rel]) == [rel]


def test_a_clone_links_pinned_files_from_the_store_and_never_a_changed_one(tmp_path, monkeypatch):
    hashed = []
    real = tiny_models.sha256
    monkeypatch.setattr(tiny_models, "sha256", lambda path: hashed.append(path.name) or real(path))
    store, first, second = tmp_path / "store", tmp_path / "first", tmp_path / "second"
    rels = ["loras/a.safetensors", "checkpoints/c.safetensors"]
    for index, rel in enumerate(rels):  # what the first clone generated
        (first / rel).parent.mkdir(parents=True, exist_ok=True)
        (first / rel).write_bytes(bytes([index + 1]) * 1000)
    sums = {rel: hashlib.sha256((first / rel).read_bytes()).hexdigest() for rel in rels}
    assert tiny_models.link_from_store(store, first, sums, rels) == rels, "an empty store holds nothing"
    tiny_models.keep_in_store(store, first, sums, rels)
    stored_names = sorted(p.name for p in store.glob("*.safetensors"))
    assert stored_names == sorted(f"{sums[r]}.safetensors" for r in rels)

    assert tiny_models.link_from_store(store, second, sums, rels) == []
    for rel in rels:
        assert (second / rel).read_bytes() == (first / rel).read_bytes()
        assert (second / rel).stat().st_ino == (store / f"{sums[rel]}.safetensors").stat().st_ino
    hashed.clear()
    assert tiny_models.stale_files(second, sums, rels) == [] and hashed == [], "a linked file is hashed again"
    assert tiny_models.stale_files(first, sums, rels) == []  # hashed once: a new link changed its ctime

    stored = store / f"{sums[rels[0]]}.safetensors"
    (second / rels[0]).unlink()
    with open(stored, "r+b") as handle:  # written in place in another clone: the store's copy changed
        handle.write(b"\xff" * 8)
    assert tiny_models.link_from_store(store, second, sums, rels) == [rels[0]]
    assert not stored.exists() and not (second / rels[0]).exists(), "a changed file was linked or kept"
    assert (second / rels[1]).read_bytes() == bytes([2]) * 1000
