"""What the merge cache knows a model file by: a fingerprint that changes whenever its content does (path,
size and modification time do not suffice). Standard library only.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

SAMPLES = 64
BLOCK = 4096
WHOLE_BELOW = 1 << 20


def file_fingerprint(path: Path | str | None) -> tuple:
    """``("file", path, size, mtime_ns, ctime_ns, inode, content digest)`` of ``path`` (see the module
    docstring); equal fingerprints mean the cache may take the file's content as unchanged.

    ``MergeCache`` (merge/cache.py) reuses a key's result only while every input's fingerprint is the same,
    so a fingerprint must change with the file's content. Path, size and modification time do not: ``cp -p``
    and ``rsync -t`` replace a file with another of the same size and keep its modification time. So the
    fingerprint also holds

    - the inode and the change time (``st_ctime_ns``, POSIX): any write or rename sets it to now and no
      copy tool can set it back; a file replaced by rename is a new inode;
    - a digest of the safetensors header (names, dtypes, shapes, offsets, metadata) and of 64 blocks of
      4 KiB spread evenly over the tensor data, or of the whole file when it is under 1 MiB. That costs 64
      small reads (about a millisecond) and catches a replaced file where the change time says nothing
      (Windows reports the creation time there).

    A file that cannot be read gets only its path: opening it fails anyway. Standard library only.
    """
    try:
        stat = os.stat(path)
        digest = content_digest(Path(path), stat.st_size)
    except (OSError, TypeError, ValueError):
        return ("file", str(path))
    return ("file", str(path), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, digest)


def content_digest(path: Path, size: int) -> str:
    """blake2b of the header and ``SAMPLES`` blocks of the data (the whole file under ``WHOLE_BELOW``)."""
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as handle:
        if size < WHOLE_BELOW:
            digest.update(handle.read())
            return digest.hexdigest()
        header = int.from_bytes(handle.read(8), "little")
        start = 8 + min(header, size - 8)
        handle.seek(8)
        digest.update(handle.read(start - 8))
        span = max(0, size - start - BLOCK)
        for index in range(SAMPLES):
            handle.seek(start + span * index // (SAMPLES - 1))
            digest.update(handle.read(BLOCK))
    return digest.hexdigest()
