"""Writing a large output file's data around the page cache (``O_DIRECT``), the disk busy while the merge
computes.

Data flow: ``SafetensorsWriter.append`` (the pipeline's writer thread) copies each tensor's bytes into
page-aligned staging buffers; a full buffer goes to a thread of its own that writes it with ``O_DIRECT`` at
its file offset while the next one fills; ``finish`` writes the last, partly filled buffer rounded up to a
whole block (the writer truncates the file to its real size afterwards). Three buffers of 16 MiB: the
appending thread waits only when the disk is two buffers behind.

Why: a buffered write copies every byte into freshly allocated page-cache pages in the kernel, which on
this kind of (virtual) machine costs more CPU than the merge's math (``copy_folio_from_iter_atomic`` was
30 % of a weighted_sum merge's samples under ``perf``; 1.72 GB written and fsynced took 1.8-4.1 s,
1.5-4.0 s of it system time), and the written pages are dropped from the cache right after anyway. With
``O_DIRECT`` the same bytes took 1.1-1.6 s with 0.1 s of system time (devtools/bench_merge.py measures
the merge). The writer's data section starts at a block boundary (``BLOCK``) for it.

Where a filesystem refuses ``O_DIRECT`` (at open: tmpfs on older kernels, some FUSE and network
filesystems; or at a write), the same bytes go through the ordinary descriptor instead, so the file is
the same either way; ``DirectWriter.direct`` says which happened.
"""

from __future__ import annotations

import errno
import mmap
import os
import queue
import threading

import torch

BLOCK = 4096  # O_DIRECT's alignment of file offsets, lengths and memory (the largest logical block in use)
STAGE_BYTES = 16 * 2**20
STAGES = 3


def available() -> bool:
    """Whether this platform has ``O_DIRECT`` (Linux and most Unixes; not macOS or Windows)."""
    return hasattr(os, "O_DIRECT")


class DirectWriter:
    """Appends bytes to ``path`` from file offset ``start`` (a multiple of ``BLOCK``) with ``O_DIRECT``.

    ``fallback_fd`` is a buffered descriptor of the same file, used where the filesystem refuses a direct
    write. Raises ``OSError`` from the constructor where the file cannot be opened with ``O_DIRECT``
    (the caller then writes buffered). ``append`` and ``finish`` re-raise a failed write in the calling
    thread; ``close`` stops the thread and releases everything (idempotent, also after an error).
    """

    def __init__(self, path: str | os.PathLike, fallback_fd: int, start: int) -> None:
        if start % BLOCK:
            raise ValueError(f"direct writes start at a multiple of {BLOCK} bytes, not at {start}")
        self.fd: int | None = os.open(path, os.O_WRONLY | os.O_DIRECT)
        self.fallback_fd, self.direct = fallback_fd, True
        self.offset, self.fill = start, 0  # file offset of the current buffer; bytes in it
        self.error: BaseException | None = None
        self.dropping = False  # closed before finish (an error or an interrupt): nothing more is written
        self.free: queue.Queue = queue.Queue()
        for _ in range(STAGES):
            self.free.put(mmap.mmap(-1, STAGE_BYTES))  # anonymous mappings are page aligned
        self.todo: queue.Queue = queue.Queue()
        self.current = self.free.get()
        self.thread = threading.Thread(target=self._run, name="patchbay-direct-write", daemon=True)
        self.thread.start()

    def append(self, data: torch.Tensor) -> None:
        """Copy ``data`` (contiguous bytes, a uint8 tensor) behind what was appended before."""
        done, size = 0, data.numel()
        while done < size:
            self._raise()
            part = min(size - done, STAGE_BYTES - self.fill)
            stage = torch.frombuffer(self.current, dtype=torch.uint8, count=part, offset=self.fill)
            stage.copy_(data[done:done + part])  # torch releases the GIL for the copy
            done, self.fill = done + part, self.fill + part
            if self.fill == STAGE_BYTES:
                self.todo.put((self.current, self.offset, STAGE_BYTES))
                self.offset += STAGE_BYTES
                self.current, self.fill = self.free.get(), 0

    def finish(self) -> None:
        """Write what is left (its last block padded with zeros) and wait for every write."""
        if self.fill:
            length = self.fill + (-self.fill % BLOCK)
            self.current[self.fill:length] = bytes(length - self.fill)
            self.todo.put((self.current, self.offset, length))
        self.current = None
        self._stop()
        self._raise()

    def close(self) -> None:
        """Stop the thread (buffers not yet written are dropped: after ``finish`` there are none) and
        close the descriptor."""
        self.dropping = True
        self._stop()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _stop(self) -> None:
        if self.thread.is_alive():
            self.todo.put(None)
            self.thread.join()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        while (item := self.todo.get()) is not None:
            buffer, offset, length = item
            if self.error is None and not self.dropping:
                try:
                    self._write(memoryview(buffer)[:length], offset)
                except BaseException as error:  # noqa: BLE001 - handed to the appending thread
                    self.error = error
            self.free.put(buffer)

    def _write(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            fd = self.fd if self.direct else self.fallback_fd
            try:
                done += os.pwrite(fd, view[done:], offset + done)
            except OSError as error:
                if error.errno != errno.EINVAL or not self.direct:
                    raise
                self.direct = False  # opened, but this write refused (or a short write left it unaligned)
