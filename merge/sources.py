"""Recipe inputs that are not files: a model already in memory, read one key at a time, so a caller (the
ComfyUI nodes) can hand the engine a model without the engine knowing where it lives.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping

import torch

from .io import DTYPE_NAMES, TensorInfo, detect_architecture


def tensor_info(dtype: torch.dtype, shape: tuple[int, ...]) -> TensorInfo:
    """The ``TensorInfo`` of an in-memory tensor (no file offsets: the span is its byte size)."""
    size = dtype.itemsize
    for n in shape:
        size *= int(n)
    return TensorInfo(DTYPE_NAMES[dtype], tuple(int(n) for n in shape), 0, size)


class MemorySource:
    """A model held elsewhere: ``infos`` lists its canonical keys, ``fetch(key)`` returns one tensor.

    ``fingerprint`` must change whenever the values may have changed (the cache trusts it).

    The executor reads every input through one small interface (what ``FileSource`` in merge/executable.py
    and ``LoraSource`` in merge/lora.py also offer)::

        name, space, arch                  a label for messages, the merge space, the architecture
        keys() / has(key) / info(key)      canonical checkpoint keys, TensorInfo (dtype name, shape)
        tensor(key) -> torch.Tensor        that key's values (a fresh tensor; any float dtype)
        fingerprint                        equal fingerprints mean equal contents (merge/cache.py)
        close()

    A recipe takes a source object as a leaf (``recipe.source(obj)``, a ``SourceNode``), or a caller's
    ``MergeRuntime.resolve`` maps a model path to one. A source object has ``name``, ``fingerprint`` and
    ``open(space)``, which gives the interface above in that merge space when a merge opens its inputs: a
    ``MemorySource`` gives a copy of itself (the object a caller holds is never changed); ComfyUI's MODEL
    (comfy_merge/graph_model.py) gives a ``MemorySource`` with its patches applied key by key, so the
    engine never knows where a model lives.
    """

    def __init__(self, name: str, infos: Mapping[str, TensorInfo], fetch: Callable[[str], torch.Tensor],
                 fingerprint: str, space: str = "weight") -> None:
        self.name, self.space, self.fingerprint = name, space, fingerprint
        self._infos = dict(infos)
        self._fetch = fetch
        self.arch, _ = detect_architecture(self._infos)

    def open(self, space: str) -> MemorySource:
        """This source entering a recipe in merge ``space``: a copy sharing the infos and ``fetch``."""
        opened = copy.copy(self)
        opened.space = space
        return opened

    def keys(self) -> list[str]:
        return list(self._infos)

    def has(self, key: str) -> bool:
        return key in self._infos

    def info(self, key: str) -> TensorInfo:
        return self._infos[key]

    def tensor(self, key: str) -> torch.Tensor:
        value = self._fetch(key)
        info = self._infos[key]
        if tuple(value.shape) != info.shape:
            raise ValueError(f"{self.name}: {key} came back with shape {list(value.shape)}, "
                             f"announced {list(info.shape)}")
        return value

    def close(self) -> None:
        """Nothing to release: the model belongs to the caller."""
