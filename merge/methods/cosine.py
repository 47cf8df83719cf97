"""Cosine-similarity guided interpolation (supermerger's "cosine A" and "cosine B")."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..declare import Weight, builtin_method

SUPERMERGER = "https://github.com/hako-mikan/sd-webui-supermerger"


@builtin_method(paper=SUPERMERGER)
def add_cosine_a(a: Weight, b: Weight, *, alpha: float = 1.0) -> Weight:
    """Lerp towards B where the normalised tensors are dissimilar (cosine A)."""
    similarity = F.cosine_similarity(F.normalize(a, dim=0), F.normalize(b, dim=0), dim=0)
    return _add_cosine(a, b, alpha, similarity)


@builtin_method(paper=SUPERMERGER)
def add_cosine_b(a: Weight, b: Weight, *, alpha: float = 1.0) -> Weight:
    """Lerp towards B by the mean of per-column and whole-tensor cosine similarity (cosine B)."""
    similarity = F.cosine_similarity(a, b, dim=0)
    magnitude = torch.sum(a * b) / (torch.norm(a) * torch.norm(b))
    return _add_cosine(a, b, alpha, (similarity + magnitude) / 2.0)


def _add_cosine(a: torch.Tensor, b: torch.Tensor, alpha: float | torch.Tensor,
                similarity: torch.Tensor) -> torch.Tensor:
    return torch.lerp(a, b, 1 - torch.clamp(similarity - alpha, 0, 1))
