"""Decomposition methods: rotate (orthogonal Procrustes alignment), truncate_rank (SVD) and the rank for
it from a ratio (get_rank_from_ratio)."""

from __future__ import annotations

import math

import torch

from ..context import KeyContext
from ..declare import AnySpace, Count, Delta, builtin_method
from ._util import generator, is_close
from .logistics import SD_MECHA
from .stiefel import exp_stiefel, log_stiefel

PROCRUSTES = "https://doi.org/10.1007/BF02289451"
ECKART_YOUNG = "https://doi.org/10.1007/BF02288367"
Tensor = torch.Tensor


@builtin_method(paper=PROCRUSTES)
def rotate(a: AnySpace, b: AnySpace, *, alignment: float = 1.0, alpha: float = 0.0,
           centralization: float = 1.0, stiefel_eps: float = 1e-8, stiefel_max_iters: int = 100,
           ctx: KeyContext) -> AnySpace:
    """Rotate A towards B by the orthogonal Procrustes transform Q**alignment; alpha lerps the rest."""
    if is_close(alignment, 0.0) and is_close(alpha, 0.0):
        return a
    if is_close(alignment, 1.0) and is_close(alpha, 1.0):
        return b
    if a.dim() <= 1 or torch.allclose(a.half(), b.half()):
        return torch.lerp(a, b, alpha)
    is_conv = a.dim() == 4 and a.shape[-2:].numel() != 1
    split = 2 if is_conv else 1
    shape_2d = (a.shape[:split].numel(), a.shape[split:].numel())
    a_2d, b_2d = a.reshape(shape_2d), b.reshape(shape_2d)
    a_mean, b_mean = a_2d.mean(0) * centralization, b_2d.mean(0) * centralization
    a_2d, b_2d = a_2d - a_mean, b_2d - b_mean
    fractional = not math.isclose(alignment, round(alignment))
    transform = _cached_procrustes(ctx.cache, a_2d, b_2d, centralization, fractional)
    transform.stiefel = (stiefel_eps, stiefel_max_iters)
    if not is_close(alpha, 0.0):
        a_2d = torch.lerp(a_2d, transform(b_2d, -1), alpha)
    a_2d = transform(a_2d, alignment)
    return (a_2d + torch.lerp(a_mean, b_mean, alignment)).reshape_as(a)


@builtin_method(paper=SD_MECHA)
def get_rank_from_ratio(a: AnySpace, *, ratio: float = 0.5) -> int:
    """The rank that is `ratio` of a's largest (of its 2-d view), rounded: truncate_rank's rank, per key."""
    full = min(a.shape[:1].numel(), a.shape[1:].numel())
    return min(max(round(full * ratio), 0), full)


@builtin_method(paper=ECKART_YOUNG, random=True)
def truncate_rank(a: Delta, *, rank: Count = 8, use_approximate_basis: bool = True,
                  approximate_basis_iters: Count = 2, approximate_basis_seed: int | None = None,
                  ctx: KeyContext) -> Delta:
    """Best rank-r approximation of a delta by (randomised or exact) SVD of its 2-d view."""
    if a.dim() < 2:
        return a
    a_2d = a.flatten(start_dim=1)
    max_rank = min(a_2d.shape)
    target = min(max(round(rank), 0), max_rank)
    if target == max_rank:
        return a
    if target == 0:
        return torch.zeros_like(a)
    settings = ("exact",) if not use_approximate_basis else (
        "approximate", target, approximate_basis_iters, approximate_basis_seed, ctx.seed)
    settings += (a.shape, a.sum().item())  # a changed input invalidates the cached decomposition
    if ctx.cache.get("svd_settings") != settings:
        if use_approximate_basis:
            gen = generator(ctx, approximate_basis_seed, a.device)
            u, s, vh = svd_lowrank(a_2d, target, approximate_basis_iters, gen)
        else:
            u, s, vh = torch.linalg.svd(a_2d, full_matrices=False)
        ctx.cache.update(svd_settings=settings, svd=(u.cpu(), s.cpu(), vh.cpu()))
    u, s, vh = (t.to(a.device) for t in ctx.cache["svd"])
    return (u[:, :target] * s[:target].unsqueeze(-2) @ vh[:target, :]).reshape(a.shape)


def svd_lowrank(a: Tensor, rank: int, iters: int, gen: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """Randomised SVD (Halko et al.) with a range finder of ``iters`` power iterations."""
    m, n = a.shape[-2:]
    if m < n:
        a = a.mH
    q = _approximate_basis(a, rank, iters, gen)
    u, s, vh = torch.linalg.svd(q.mH @ a, full_matrices=False)
    u = q @ u
    return (vh.mH, s, u.mH) if m < n else (u, s, vh)


def _approximate_basis(a: Tensor, rank: int, iters: int, gen: torch.Generator) -> Tensor:
    r = torch.randn(a.shape[-1], rank, dtype=a.dtype, device=a.device, generator=gen)
    q = torch.linalg.householder_product(*torch.geqrf(a @ r))
    for _ in range(iters):
        q = torch.linalg.householder_product(*torch.geqrf(a.mH @ q))
        q = torch.linalg.householder_product(*torch.geqrf(a @ q))
    return q


def _cached_procrustes(cache: dict, a: Tensor, b: Tensor, centralization: float, fractional: bool):
    """The Procrustes transform of (a, b), reused from ``cache`` while its inputs are unchanged."""
    stamp = (centralization, fractional, a.shape, a.sum().item(), b.sum().item())  # inputs unchanged
    if cache.get("procrustes_stamp") != stamp:
        cache.clear()
        cache["procrustes_stamp"] = stamp
        cache["procrustes"] = orthogonal_procrustes(a, b, cancel_reflection=fractional)
    return cache["procrustes"].bind(cache, a.device)


def orthogonal_procrustes(a: Tensor, b: Tensor, cancel_reflection: bool = False) -> _Orthogonal:
    """The orthogonal Q minimising ||a Q - b|| (low-rank form when a is wide)."""
    n, p = a.shape[-2:]
    if n < p:
        b_q, b_r = torch.linalg.qr(b.mH)
        u, _, vh = torch.linalg.svd(a.mH @ b_r.mH, full_matrices=False)
        return _Orthogonal(u=u.cpu(), v=(vh @ b_q.mH).mH.cpu())
    u, _, vh = torch.linalg.svd(a.mH @ b, full_matrices=False)
    if cancel_reflection:
        u[..., -1] /= torch.slogdet(u @ vh)[0]
    return _Orthogonal(q=(u @ vh).cpu())


class _Orthogonal:
    """x -> x Q**t for the full-rank Q, or the rotation taking span(v) to span(u) when low-rank."""

    def __init__(self, q: Tensor | None = None, u: Tensor | None = None, v: Tensor | None = None) -> None:
        self.q, self.u, self.v = q, u, v
        self.cache: dict = {}
        self.device: torch.device | str = "cpu"
        self.stiefel: tuple[float, int] = (1e-8, 100)

    def bind(self, cache: dict, device: torch.device | str) -> _Orthogonal:
        self.cache, self.device = cache, device
        return self

    def __call__(self, x: Tensor, t: float) -> Tensor:
        if math.isclose(t, 0.0):
            return x
        if self.q is None:
            return self._low_rank(x, t)
        return x @ self._power(t)

    def _low_rank(self, x: Tensor, t: float) -> Tensor:
        u, v = self.u.to(x.device), self.v.to(x.device)
        if math.isclose(t, 1.0):
            return x - x @ v @ v.mH + x @ u @ v.mH
        if math.isclose(t, -1.0):
            return x - x @ u @ u.mH + x @ v @ u.mH
        if self.cache.get("log_stiefel_settings") != self.stiefel:  # the geodesic from v to u
            log = log_stiefel(self.v.to(x.device), self.u.to(x.device), *self.stiefel)
            self.cache.update(log_stiefel_settings=self.stiefel, log_stiefel=log.cpu())
        log = self.cache["log_stiefel"].to(x.device)
        left, right = exp_stiefel(v, log * (t + 1) / 2), exp_stiefel(v, log * (1 - t) / 2)
        return x - x @ right @ right.mH + x @ left @ right.mH

    def _power(self, t: float) -> Tensor:
        q = self.q.to(self.device)
        if math.isclose(t, 1.0):
            return q
        if math.isclose(t, -1.0):
            return q.mH
        if math.isclose(t, round(t)):
            return torch.linalg.matrix_power(q, round(t))
        if "eig" not in self.cache:
            self.cache["eig"] = tuple(e.cpu() for e in torch.linalg.eig(q))
        eig_v, eig_vs = (e.to(self.device) for e in self.cache["eig"])
        return (eig_vs * eig_v.unsqueeze(-2) ** t @ eig_vs.mH).real.to(q.dtype)
