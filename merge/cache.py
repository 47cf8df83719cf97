"""Results of recipe sub-graphs per key, kept across merges in one process within a byte budget, so a
merge skips the work an earlier merge did (the Merge node re-run, Merge Grid's variants).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Container, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class CacheStats:
    """Counts since the cache was made (hits and misses of ``get``) and what it holds now."""

    entries: int = 0
    bytes: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0


@dataclass
class _Entry:
    value: Any
    nbytes: int
    run: int


@dataclass
class MergeCache:
    """Per-key results across merges, passed as ``MergeRuntime.cache``; ``budget_mb`` 0 caches nothing.

    - ``get(key_id)`` / ``put(key_id, tensor)`` (``put_copy``: a copy, made only if it fits): a key's
      result (a whole output tensor, or the fp32 result of a non-elementwise call inside the recipe),
      identified by ``CompiledRecipe.key_id`` (merge/executable.py): the method, its inputs' ids,
      its parameters
      resolved for that key, the source fingerprints. Equal ids mean equal values, so an entry is reused
      whatever recipe it came from.
    - ``method_store(owner)``: the per-key dicts methods keep in ``KeyContext.cache`` (rotate keeps its
      decomposition there), for one call site identified by its inputs but not its parameters.

    Budget: entries are counted in bytes (tensors inside method dicts are measured by ``settle``, which
    the executor calls after each key). When an insert does not fit, entries from earlier runs go first,
    least recently used first; entries of the current run (``new_run``) are never evicted to make room
    for others, so a merge larger than the budget keeps its first keys instead of evicting each entry
    before it is read again. A caller that knows which results its next merges read (Merge Grid) passes
    them as ``put_copy(..., keep=ids)``: those are not evicted either, so a full cache stops taking new
    entries instead of trading one that will be read for one that may not; ``discard(ids)`` drops them
    once read for the last time. ``clear()`` empties it; ``set_budget(0)`` turns it off.
    """

    budget_mb: float = 4096.0
    _entries: OrderedDict = field(default_factory=OrderedDict, init=False, repr=False)
    _pending: set = field(default_factory=set, init=False, repr=False)
    _run: int = field(default=0, init=False)
    _lock: threading.RLock = field(default_factory=threading.RLock, init=False, repr=False)
    _stats: CacheStats = field(default_factory=CacheStats, init=False)

    @property
    def budget_bytes(self) -> int:
        return int(max(0.0, self.budget_mb) * 2**20)

    def set_budget(self, budget_mb: float) -> None:
        """A new budget; entries over it are evicted now (least recently used first)."""
        with self._lock:
            self.budget_mb = budget_mb
            self._evict(0, keep_current=False)

    def new_run(self) -> None:
        """Start a merge: entries made from now on are this run's (see ``MergeCache``)."""
        with self._lock:
            self._run += 1

    def get(self, key: Hashable) -> torch.Tensor | None:
        """The tensor stored under ``key`` (marked as used by this run), or None."""
        with self._lock:
            entry = self._entries.get(("result", key))
            if entry is None:
                self._stats.misses += 1
                return None
            self._entries.move_to_end(("result", key))
            entry.run = self._run
            self._stats.hits += 1
            return entry.value

    def put(self, key: Hashable, tensor: torch.Tensor) -> bool:
        """Keep ``tensor`` (not copied: the caller hands it over) if it fits; returns whether it was kept."""
        return self._put(key, tensor, copy=False)

    def put_copy(self, key: Hashable, tensor: torch.Tensor, keep: Container | None = None) -> bool:
        """``put`` of a copy of ``tensor``, made only when it will be kept: a merge larger than the budget
        (an SD1.5 UNet in fp32 is 3.4 GB) would otherwise allocate, fill and free a copy of every key
        past the budget. ``keep``: ids of entries that are not evicted to make room (``MergeCache``)."""
        return self._put(key, tensor, copy=True, keep=keep)

    def _put(self, key: Hashable, tensor: torch.Tensor, copy: bool, keep: Container | None = None) -> bool:
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:
            slot = ("result", key)
            if slot in self._entries:
                self._drop(slot)
            if not self._evict(nbytes, keep_current=True, keep=keep):
                return False
            self._entries[slot] = _Entry(tensor.clone() if copy else tensor, nbytes, self._run)
            self._stats.bytes += nbytes
            return True

    def discard(self, keys: Iterable[Hashable]) -> None:
        """Drop the results stored under ``keys`` (those absent are ignored): a caller that knows nothing
        reads them again (Merge Grid, past their last variant) frees their memory now."""
        with self._lock:
            for key in keys:
                if ("result", key) in self._entries:
                    self._drop(("result", key))

    def method_store(self, owner: Hashable) -> MethodStore:
        """The ``{key: dict}`` mapping one call site's ``KeyContext.cache`` dicts live in."""
        return MethodStore(self, owner)

    def _method_dict(self, owner: Hashable, key: str) -> dict:
        with self._lock:
            slot = ("method", owner, key)
            entry = self._entries.get(slot)
            if entry is None:
                entry = self._entries[slot] = _Entry({}, 0, self._run)
            else:
                self._entries.move_to_end(slot)
                entry.run = self._run
            self._pending.add(slot)
            return entry.value

    def settle(self) -> None:
        """Measure the method dicts used since the last call (dropping empty ones) and evict what no
        longer fits."""
        with self._lock:
            fresh, self._pending = self._pending, set()
            for slot in fresh:
                entry = self._entries.get(slot)
                if entry is not None and not entry.value:  # the method kept nothing for this key
                    self._drop(slot)
                elif entry is not None:
                    size = _nbytes(entry.value)
                    self._stats.bytes += size - entry.nbytes
                    entry.nbytes = size
            if not self._evict(0, keep_current=True):
                for slot in fresh:  # over budget by this run's own method dicts: drop the newest
                    if slot in self._entries and self._stats.bytes > self.budget_bytes:
                        self._drop(slot)

    def clear(self) -> None:
        """Forget everything (method dicts in use stay valid objects, just no longer kept)."""
        with self._lock:
            self._entries.clear()
            self._pending.clear()
            self._stats.bytes = 0

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(len(self._entries), self._stats.bytes, self._stats.hits, self._stats.misses,
                              self._stats.evictions)

    def _evict(self, needed: int, keep_current: bool, keep: Container | None = None) -> bool:
        """Evict until ``needed`` more bytes fit; False (nothing more evicted) when they cannot."""
        budget = self.budget_bytes
        if needed > budget:
            return False
        if keep is not None and self._stats.bytes + needed > budget and not self._frees(needed, keep):
            return False  # the room is held by entries to keep: evict nothing for an entry that won't fit
        for slot in list(self._entries):
            if self._stats.bytes + needed <= budget:
                break
            if keep_current and self._entries[slot].run == self._run:
                continue
            if keep is not None and slot[0] == "result" and slot[1] in keep:
                continue
            self._drop(slot)
            self._stats.evictions += 1
        return self._stats.bytes + needed <= budget

    def _frees(self, needed: int, keep: Container) -> bool:
        """Whether evicting every entry that is neither this run's nor in ``keep`` makes ``needed`` fit."""
        free = sum(entry.nbytes for slot, entry in self._entries.items()
                   if entry.run != self._run and not (slot[0] == "result" and slot[1] in keep))
        return self._stats.bytes - free + needed <= self.budget_bytes

    def _drop(self, slot: tuple) -> None:
        entry = self._entries.pop(slot)
        self._stats.bytes -= entry.nbytes
        self._pending.discard(slot)


class MethodStore:
    """What ``Call.cache`` is when a ``MergeCache`` is in use: ``setdefault(key, {})`` as on a dict."""

    def __init__(self, cache: MergeCache, owner: Hashable) -> None:
        self.cache, self.owner = cache, owner

    def setdefault(self, key: str, default: dict | None = None) -> dict:
        return self.cache._method_dict(self.owner, key)


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 64
