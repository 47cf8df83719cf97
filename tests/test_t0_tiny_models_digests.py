"""T0: the tiny models' digest cache (devtools/tiny_models.stale_files): a file nobody wrote since it was
hashed is not read again, and any write (same size, same bytes even, or its time set back) makes it
hashed again, so a corrupted model is still found."""

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
