"""truncate_kronecker: the best single Kronecker product w1 (x) w2 approximating a delta (sd-mecha 1.1.8),
what a rank-1 LoKr of those factor shapes can carry.
"""

from __future__ import annotations

import math

import torch

from ..context import KeyContext
from ..declare import Count, Delta, Fraction, builtin_method
from ._util import generator
from .svd import svd_lowrank

VAN_LOAN = "https://doi.org/10.1007/978-94-015-8196-7_17"


@builtin_method(paper=VAN_LOAN, random=True)
def truncate_kronecker(a: Delta, *, kronecker_ratio: Fraction = 0.5, use_approximate_basis: bool = True,
                       approximate_basis_iters: Count = 2, approximate_basis_seed: int | None = None,
                       ctx: KeyContext) -> Delta:
    """Nearest Kronecker product w1 (x) w2 to a delta (a rank-1 LoKr); kronecker_ratio sizes w1 against w2.

    A LoKr holds a delta as ``kron(w1, w2)``; the nearest such product to a matrix is the leading singular
    pair of its Van Loan-Pitsianis rearrangement (each (m2 x n2) block of the delta becomes one row), so a
    delta truncated here is what a rank-1 LoKr of those factor shapes can carry. ``kronecker_ratio`` picks
    the factor shapes: 0 makes w1 as small as the divisors allow, 1 as large, 0.5 balanced.
    """
    if a.dim() < 2:
        return a
    blocks, dims = _rearranged(a, kronecker_ratio)
    if use_approximate_basis:
        u, s, vh = svd_lowrank(blocks, 1, approximate_basis_iters,
                               generator(ctx, approximate_basis_seed, a.device))
    else:
        u, s, vh = torch.linalg.svd(blocks, full_matrices=False)
    w1, w2 = _leading_pair(u, s, vh, dims, a.shape[2:])
    return torch.kron(w1[(...,) + (None,) * (a.dim() - 2)], w2).reshape(a.shape)


def kronecker_factors(a: torch.Tensor, ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The LoKr factors ``w1 [m1, n1]`` and ``w2 [m2, n2, *kernel]`` of the nearest Kronecker product to a
    2-D or 4-D delta ``a`` (exact SVD), w1 sized by ``ratio`` as in ``truncate_kronecker``; the same
    factors as sd-mecha's LoKr extraction (``extract_lycoris_lokr``)."""
    blocks, dims = _rearranged(a, ratio)
    u, s, vh = torch.linalg.svd(blocks, full_matrices=False)
    return _leading_pair(u, s, vh, dims, a.shape[2:])


def _rearranged(a: torch.Tensor, ratio: float) -> tuple[torch.Tensor, tuple[int, int, int, int]]:
    """Van Loan's rearrangement of ``a``: one row per (m2 x n2 x kernel) block, and (m1, m2, n1, n2)."""
    m1, m2, n1, n2 = kronecker_shape(a.shape, ratio)
    blocks = a.reshape(m1, m2, n1, n2 * a.shape[2:].numel()).permute(0, 2, 1, 3).reshape(m1 * n1, -1)
    return blocks, (m1, m2, n1, n2)


def _leading_pair(u: torch.Tensor, s: torch.Tensor, vh: torch.Tensor, dims: tuple[int, int, int, int],
                  kernel: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    """The leading singular pair as ``(w1 [m1, n1], w2 [m2, n2, *kernel])``, sqrt(s) on each side."""
    m1, m2, n1, n2 = dims
    root = s[0].sqrt()
    return (u[:, 0] * root).reshape(m1, n1), (vh[0] * root).reshape(m2, n2, *kernel)


def kronecker_shape(shape: torch.Size, ratio: float) -> tuple[int, int, int, int]:
    """(m1, m2, n1, n2) with m1 * m2 = shape[0], n1 * n2 = shape[1], w1 = m1 x n1 sized by ``ratio``.

    Each pair of divisors is scored by s = log(m1 n1) - log(sqrt(numel)); the target s is
    (2 ratio - 1) times the largest |s|, ties broken by the balance |log(m1/m2)| + |log(n1/n2)|."""
    half_log = 0.5 * math.log(shape.numel())
    candidates = []
    for m1 in _divisors(shape[0]):
        for n1 in _divisors(shape[1]):
            m2, n2 = shape[0] // m1, shape[1] // n1
            balance = abs(math.log(m1 / m2)) + abs(math.log(n1 / n2))
            candidates.append((math.log(m1 * n1) - half_log, balance, (m1, m2, n1, n2)))
    reach = max(abs(c[0]) for c in candidates)
    target = (2.0 * ratio - 1.0) * reach
    return min(candidates, key=lambda c: (abs(c[0] - target) if reach else 0.0, c[1]))[2]


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
