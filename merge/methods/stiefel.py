"""Geodesics on the Stiefel manifold, for ``rotate`` with a fractional alignment of a wide matrix.
"""

from __future__ import annotations

import logging

import torch

Tensor = torch.Tensor


def exp_stiefel(u: Tensor, delta: Tensor) -> Tensor:
    """The point reached from frame ``u`` along tangent ``delta`` (u tall: rows > columns)."""
    n, p = u.shape[-2:]
    k = min(n - p, p)
    a = u.mH @ delta
    q, r = qr_pos(delta - u @ a)
    q, r = q[..., :k], r[..., :k, :]
    w = torch.cat((torch.cat((a, -r.mH), -1), torch.cat((r, torch.zeros_like(a[..., :k, :k])), -1)), -2)
    m = torch.linalg.matrix_exp(w)
    return u @ m[..., :p, :p] + q @ m[..., p:, :p]


def log_stiefel(a: Tensor, b: Tensor, eps: float = 1e-8, max_iters: int = 100) -> Tensor:
    """The tangent vector at frame ``a`` whose geodesic reaches frame ``b`` (both tall).

    A wide matrix's Procrustes transform is a rotation taking the orthonormal frame ``v`` to ``u``
    (both tall, p x n). Rotating part of the way means walking the geodesic between the two frames:
    ``log_stiefel`` finds the tangent vector from ``v`` to ``u`` (Zimmermann's algorithm,
    https://arxiv.org/abs/1604.05054, as sd-mecha implements it), ``exp_stiefel`` walks along it.
    """
    shape = a.shape
    a, b = a.reshape(-1, *shape[-2:]), b.reshape(-1, *shape[-2:])
    p = shape[-1]
    q, v = _initial_frame(a, b)
    k = v.shape[-1] - p
    diag = torch.arange(k, device=v.device)
    logv = _logm(v)
    for _ in range(max(1, max_iters)):
        logv = _logm(v)
        c = logv[..., p:, p:]
        c_norm = float(torch.linalg.matrix_norm(c).max())
        if c_norm <= eps:
            break
        s = logv[..., p:, :p] @ logv[..., p:, :p].mH / 12
        s[..., diag, diag] -= 0.5
        v[..., p:] = v[..., p:] @ torch.linalg.matrix_exp(_solve_symmetric_sylvester(s, c))
    else:
        logging.getLogger(__name__).warning(
            "log_stiefel did not converge in %d iterations (residual %.3g): the frames are far apart and "
            "a fractional rotate of this key is unreliable (sd-mecha gives the same numbers)",
            max_iters, c_norm)
    return (a @ logv[..., :p, :p] + q @ logv[..., p:, :p]).reshape(shape)


def _initial_frame(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """(q, V): the complement basis q and the orthogonal (p+k) x (p+k) start of the iteration."""
    n, p = a.shape[-2:]
    k = min(n - p, p)
    m = a.mH @ b
    q, n_mat = qr_pos(b - a @ m)
    q, n_mat = q[..., :k], n_mat[..., :k, :]
    v = _orthogonal_complete(torch.cat((m, n_mat), dim=-2))
    r, sigma, r_hat_t = torch.linalg.svd(v[..., p:, p:])
    q = q @ r
    v[..., p:, :p] = r.mH @ n_mat
    v[..., :p, p:] = v[..., :p, p:] @ r_hat_t.mH
    v[..., p:, p:] = 0
    idx = torch.arange(p, p + k, device=v.device)
    v[..., idx, idx] = sigma
    v[v.slogdet()[0] < 0, ..., -1] *= -1
    return q, v


def qr_pos(x: Tensor) -> tuple[Tensor, Tensor]:
    """QR with a non-negative diagonal of R (unique, so geodesics are continuous)."""
    q, r = torch.linalg.qr(x)
    s = torch.sign(r.diagonal(dim1=-2, dim2=-1))
    s[s == 0] = 1
    return q * s.unsqueeze(-2), r / s.unsqueeze(-1)


def _orthogonal_complete(a: Tensor) -> Tensor:
    m, n = a.shape[-2:]
    if m <= n:
        return a
    proj = torch.eye(m, device=a.device, dtype=a.dtype)[:, n:] - a @ a.mH[..., n:]
    return torch.cat((a, torch.linalg.householder_product(*torch.geqrf(proj))), dim=-1)


def _logm(m: Tensor) -> Tensor:
    values, vectors = torch.linalg.eig(m)
    return torch.linalg.solve(vectors, vectors * values.unsqueeze(-2).log(), left=False).real.to(m.dtype)


def _solve_symmetric_sylvester(s: Tensor, c: Tensor) -> Tensor:
    values, vectors = torch.linalg.eigh(s)
    c_t = vectors.mH @ c @ vectors
    return vectors @ (c_t / (values.unsqueeze(-2) + values.unsqueeze(-1))) @ vectors.mH
