"""What a merge method sees besides its tensors: the key being merged and a per-key cache (``KeyContext``),
and the key-by-key loop with interrupt and progress (``checked_steps``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch


@dataclass(frozen=True)
class KeyContext:
    """Read-only facts about the key a method evaluates, plus a mutable cache.

    - ``key``: the state-dict key being merged (``model.diffusion_model.input_blocks.1.0...``).
    - ``cache``: a dict owned by the executor that persists for this (method call, key) across
      merges in one process; methods store reusable work there (``rotate`` keeps its
      decomposition so that changing only ``alpha`` is cheap). The dict itself is mutable.
    - ``seed``: the merge seed; random methods derive their generator from ``seed`` and ``key``.
    - ``device``: where the tensors live and the work should happen.
    - ``arch``: the detected family of the output (merge/architectures.py: ``sd15``, ``flux2``, ...,
      ``unknown``);
      ``pick_component`` / ``omit_component`` need it to know a key's component.

    The executor (merge/execute.py) builds one ``KeyContext`` per (method call, key) and passes it as
    ``ctx=`` to ``method.fn(*tensors, **scalars, ctx=ctx)``; methods import nothing else from it.

    Absent keys: a method may return ``None`` to say "this key is absent from my output"
    (``pick_component`` / ``omit_component``); a method registered with ``accepts_missing=True``
    (``fallback``) receives ``None`` for an input that has no such key, every other method is skipped
    for that key (the executor applies its missing-key policy).

    ``checked_steps`` is the loop of the commands that go key by key or module by module (extract,
    lora-stack): an interrupt check and a progress report before each item.
    """

    key: str = ""
    cache: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    seed: int = 0
    device: torch.device | str = "cpu"
    arch: str = "unknown"

    def generator(self) -> torch.Generator:
        """A torch generator seeded from ``seed`` and ``key`` (stable across processes)."""
        gen = torch.Generator(device=torch.device(self.device))
        gen.manual_seed(key_seed(self.seed, self.key))
        return gen


def key_seed(seed: int, key: str) -> int:
    """Mix a merge seed and a key name into a 63-bit seed, independent of PYTHONHASHSEED."""
    import hashlib

    digest = hashlib.blake2b(f"{seed}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


T = TypeVar("T")


def checked_steps(items: Sequence[T], check: Callable[[], None] | None,
                  on_progress: Callable[[int, int], None] | None) -> Iterator[T]:
    """``items`` one by one, after ``check()`` (an interrupt raises there) and ``on_progress(done,
    total)``: the loop of the key-by-key commands (extract, lora-stack)."""
    for done, item in enumerate(items):
        if check is not None:
            check()
        if on_progress is not None:
            on_progress(done, len(items))
        yield item
