"""Deterministic tensors for the tiny models: a platform-stable uniform init and the LoRA formats.

``uniform`` draws from a PCG64 stream seeded by a string, through exactly rounded float32 math, so
files made from it are byte-identical on every machine. The module builders write one LoRA module
in kohya LoRA/LoCon, LyCORIS LoHa or LyCORIS LoKr layout, scaled so the weight delta it encodes has
standard deviation ``target`` (used by devtools/tiny_models.py).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class LoraSpec:
    """One LoRA file: ``algo`` is lora, locon, loha or lokr; ``decompose_both`` is LyCORIS' LoKr option."""

    name: str
    algo: str
    rank: int
    decompose_both: bool = False

    @property
    def alpha(self) -> float:
        return self.rank / 2


def uniform(seed: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
    """fp16 tensor, uniform with standard deviation ``std``, a pure function of ``seed``.

    16 bits of a PCG64 stream (whose output numpy keeps stable) per value, mapped with exactly
    rounded float32 arithmetic, so the result is bit-identical on every platform.
    """
    seed_int = int.from_bytes(hashlib.sha256(seed.encode()).digest()[:16], "little")
    count = math.prod(shape)
    raw = np.random.PCG64(seed_int).random_raw((count + 3) // 4).astype("<u8", copy=False).view("<u2")
    values = raw[:count].astype(np.float32)
    values *= np.float32(2.0**-15)  # [0, 2)
    values -= np.float32(1.0 - 2.0**-16)  # (-1, 1), symmetric around 0
    values *= np.float32(std * math.sqrt(3.0))
    return torch.from_numpy(values).reshape(shape).to(torch.float16)


def factorization(dimension: int) -> tuple[int, int]:
    """LyCORIS' LoKr split (factor -1): ``(m, n)``, ``m * n == dimension``, m the largest divisor <= sqrt."""
    m = max(d for d in range(1, math.isqrt(dimension) + 1) if dimension % d == 0)
    return m, dimension // m


Tensors = dict[str, torch.Tensor]


def low_rank_pair(
    shape: tuple[int, ...], rank: int, scale: float, target: float, seed: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(down, up)`` with ``up @ down * scale`` of std ``target``; convs keep their kernel in ``down``.

    kohya writes them as ``lora_down``/``lora_up`` (scale alpha / rank), PEFT and BFL as
    ``lora_A``/``lora_B`` (no alpha: scale 1).
    """
    kernel = shape[2:]
    down_std = 1.0 / math.sqrt(math.prod(shape[1:]))
    up_std = target / (scale * math.sqrt(rank) * down_std)
    down = uniform(f"{seed}/down", (rank, shape[1], *kernel), down_std)
    return down, uniform(f"{seed}/up", (shape[0], rank, *(1 for _ in kernel)), up_std)


def lora_module(name: str, shape: tuple[int, ...], spec: LoraSpec, target: float, seed: str) -> Tensors:
    """kohya LoRA/LoCon: ``up @ down * alpha / rank``; convs keep their kernel in ``lora_down``."""
    down, up = low_rank_pair(shape, spec.rank, spec.alpha / spec.rank, target, seed)
    return {f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up}


def loha_module(name: str, shape: tuple[int, ...], spec: LoraSpec, target: float, seed: str) -> Tensors:
    """LyCORIS LoHa: ``(w1_a @ w1_b) * (w2_a @ w2_b) * alpha / rank``, convs flattened into ``w*_b``."""
    shapes = {"a": (shape[0], spec.rank), "b": (spec.rank, math.prod(shape[1:]))}
    std = (target / spec.alpha) ** 0.25
    return {f"{name}.hada_w{i}_{s}": uniform(f"{seed}/w{i}{s}", shapes[s], std) for i in (1, 2) for s in "ab"}


def lokr_module(name: str, shape: tuple[int, ...], spec: LoraSpec, target: float, seed: str) -> Tensors:
    """LyCORIS LoKr: ``kron(w1, w2)``; w2, and w1 with decompose_both, low-rank where LyCORIS splits them."""
    rank, kernel = spec.rank, shape[2:]
    (out_l, out_k), (in_m, in_n) = factorization(shape[0]), factorization(shape[1])
    split_w1 = spec.decompose_both and rank < max(out_l, in_m) / 2
    split_w2 = rank < max(out_k, in_n) / 2
    w2_std = target / (spec.alpha / rank if split_w1 or split_w2 else 1.0)
    out = {}
    if split_w1:
        out[f"{name}.lokr_w1_a"] = uniform(f"{seed}/w1a", (out_l, rank), rank**-0.25)
        out[f"{name}.lokr_w1_b"] = uniform(f"{seed}/w1b", (rank, in_m), rank**-0.25)
    else:
        out[f"{name}.lokr_w1"] = uniform(f"{seed}/w1", (out_l, in_m), 1.0)
    if split_w2:
        factor_std = math.sqrt(w2_std / math.sqrt(rank))
        out[f"{name}.lokr_w2_a"] = uniform(f"{seed}/w2a", (out_k, rank), factor_std)
        out[f"{name}.lokr_w2_b"] = uniform(f"{seed}/w2b", (rank, in_n * math.prod(kernel)), factor_std)
    else:
        out[f"{name}.lokr_w2"] = uniform(f"{seed}/w2", (out_k, in_n, *kernel), w2_std)
    return out


MODULE_BUILDERS = {"lora": lora_module, "locon": lora_module, "loha": loha_module, "lokr": lokr_module}
