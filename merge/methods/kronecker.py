"""truncate_kronecker: the best single Kronecker product w1 (x) w2 approximating a delta (sd-mecha 1.1.8).

A LoKr holds a delta as ``kron(w1, w2)``; the nearest such product to a matrix is the leading singular
pair of its Van Loan-Pitsianis rearrangement (each (m2 x n2) block of the delta becomes one row), so a
delta truncated here is what a rank-1 LoKr of those factor shapes can carry. ``kronecker_ratio`` picks
the factor shapes: 0 makes w1 as small as the divisors allow, 1 as large, 0.5 balanced.
"""

from __future__ import annotations

import math

import torch

from ..context import KeyContext
from ..registry import Count, Delta, Fraction, merge_method
from ._util import generator
from .svd import svd_lowrank

VAN_LOAN = "https://doi.org/10.1007/978-94-015-8196-7_17"


@merge_method(paper=VAN_LOAN, random=True)
def truncate_kronecker(a: Delta, *, kronecker_ratio: Fraction = 0.5, use_approximate_basis: bool = True,
                       approximate_basis_iters: Count = 2, approximate_basis_seed: int | None = None,
                       ctx: KeyContext) -> Delta:
    """Nearest Kronecker product w1 (x) w2 to a delta (a rank-1 LoKr); kronecker_ratio sizes w1 against w2."""
    if a.dim() < 2:
        return a
    m1, m2, n1, n2 = kronecker_shape(a.shape, kronecker_ratio)
    extra = a.shape[2:]
    blocks = a.reshape(m1, m2, n1, n2 * extra.numel()).permute(0, 2, 1, 3).reshape(m1 * n1, -1)
    if use_approximate_basis:
        u, s, vh = svd_lowrank(blocks, 1, approximate_basis_iters,
                               generator(ctx, approximate_basis_seed, a.device))
    else:
        u, s, vh = torch.linalg.svd(blocks, full_matrices=False)
    root = s[0].sqrt()
    w1 = (u[:, 0] * root).reshape(m1, n1, *[1] * len(extra))
    w2 = (vh[0] * root).reshape(m2, n2, *extra)
    return torch.kron(w1, w2).reshape(a.shape)


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
