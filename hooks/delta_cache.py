"""A least-recently-used tensor cache with a byte budget (pure): where the hook engine keeps materialised
deltas (LoHa, LoKr, DoRA, model-as-LoRA) so a step does not rebuild them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch

__all__ = ["TensorCache"]


class TensorCache:
    """The hook engine keeps materialised deltas (LoHa, LoKr, DoRA, model-as-LoRA) here, keyed by
    (hook content, weight key, strength where the delta is not linear in it). ``get_or_make`` builds a
    missing entry, stores it when it fits, and evicts the least recently used entries to stay within
    ``budget_bytes``; an entry larger than the whole budget is returned without being stored. Safe to
    call from several threads (ComfyUI's multi-GPU workers): one lock around each lookup and insert.
    """

    def __init__(self, budget_bytes: int) -> None:
        self._entries: OrderedDict[Hashable, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._lock = threading.RLock()
        self.resize(budget_bytes)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def get_or_make(self, key: Hashable, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        with self._lock:
            if key in self._entries:
                self.hits += 1
                self._entries.move_to_end(key)
                return self._entries[key]
            self.misses += 1
        value = make()
        size = value.numel() * value.element_size()
        with self._lock:
            if size <= self.budget_bytes and key not in self._entries:
                self._evict_to(self.budget_bytes - size)
                self._entries[key] = value
                self.bytes += size
        return value

    def resize(self, budget_bytes: int) -> None:
        """A new budget; least recently used entries are dropped until the cache fits it."""
        if budget_bytes < 0:
            raise ValueError(f"cache budget must be >= 0 bytes, got {budget_bytes}")
        with self._lock:
            self.budget_bytes = budget_bytes
            self._evict_to(budget_bytes)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0

    def _evict_to(self, limit: int) -> None:
        """Drop least recently used entries until at most ``limit`` bytes are held (lock held)."""
        while self.bytes > limit:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()
