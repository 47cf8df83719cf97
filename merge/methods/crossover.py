"""Frequency-domain crossover: low frequencies from A, high frequencies from B."""

from __future__ import annotations

import math

import torch

from ..declare import AnySpace, Fraction, builtin_method


@builtin_method(paper="https://github.com/ljleb/sd-mecha")
def crossover(a: AnySpace, b: AnySpace, *, alpha: Fraction = 0.5, tilt: float = 0.0) -> AnySpace:
    """Mix the n-d Fourier spectra of A and B by a cut at alpha (tilt 0 = sharp, 1 = plain lerp)."""
    if alpha == 0:
        return a
    if alpha == 1:
        return b
    if tilt == 1 or a.dim() == 0 or torch.allclose(a, b):
        return torch.lerp(a, b, alpha)
    a_dft = torch.fft.rfftn(a, s=a.shape)
    b_dft = torch.fft.rfftn(b, s=a.shape)
    dft_filter = create_filter(a_dft.shape, alpha, tilt, device=a.device)
    return torch.fft.irfftn((1 - dft_filter) * a_dft + dft_filter * b_dft, s=a.shape)


def create_filter(shape: tuple[int, ...] | torch.Size, alpha: float, tilt: float,
                  device: torch.device | None = None) -> torch.Tensor:
    """A [0, 1] mask over rfftn frequencies: 0 keeps A (low frequencies), 1 takes B (high)."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"crossover alpha must be between 0 and 1, got {alpha}")
    tilt -= math.floor(tilt // 4 * 4)
    inverted = tilt > 2
    if inverted:
        alpha = 1 - alpha
    mesh = _frequency_mesh(shape, device)
    if tilt < 1e-10 or abs(tilt - 4) < 1e-10:
        dft_filter = (mesh > 1 - alpha).float()
    elif abs(tilt - 2) < 1e-10:
        dft_filter = (mesh < 1 - alpha).float()
    else:
        cot = 1 / math.tan(math.pi * tilt / 2)
        if tilt <= 1 or 2 < tilt <= 3:
            dft_filter = mesh * cot + alpha * cot + alpha - cot
        else:
            dft_filter = mesh * cot - alpha * cot + alpha
        dft_filter = dft_filter.clip(0, 1)
    return 1 - dft_filter if inverted else dft_filter


def _frequency_mesh(shape: tuple[int, ...] | torch.Size, device: torch.device | None) -> torch.Tensor:
    """Normalised radial frequency of each rfftn bin (the last dimension is one-sided)."""
    gradients = []
    for i, s in enumerate(reversed(shape)):
        if i == 0 or s == 1:
            gradients.append(torch.linspace(0, 1, s, device=device))
        else:  # negative frequencies are in the second half of the dimension
            gradients.append(torch.cat([torch.linspace(0, (s - 1) // 2, s - s // 2, device=device),
                                        torch.linspace(s // 2, 1, s // 2, device=device)]) / (s // 2))
    gradients.reverse()
    if len(shape) == 1:
        return gradients[0]
    grids = torch.meshgrid(*(g**2 for g in gradients), indexing="ij")
    return (torch.stack(grids).sum(dim=0) / len(shape)).sqrt()
