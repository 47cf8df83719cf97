"""T0: ``merge.extract.decompose``, the SVD behind Extract LoRA, against the Eckart-Young formula.

Wide matrices (out < in * kh * kw: CLIP's ``fc2``, most convolutions) are decomposed through their
transpose, which LAPACK does about 3x faster; the result must be the same best rank-r approximation
and the same reported error as for a tall matrix, whichever way the matrix lies.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.t0


@pytest.mark.parametrize("shape", [(24, 96), (96, 24), (32, 32), (16, 12, 3, 3), (48, 8, 1, 1)])
@pytest.mark.parametrize("rank", [1, 5])
def test_decompose_gives_the_best_rank_r_approximation_and_its_error(shape, rank):
    from patchbay_merge.extract import decompose

    gen = torch.Generator().manual_seed(sum(shape) + rank)
    delta = torch.randn(*shape, generator=gen, dtype=torch.float64)
    matrix = delta.reshape(shape[0], -1)
    up, down, kept, error = decompose(delta, rank, None)
    singular = torch.linalg.svdvals(matrix)
    assert kept == rank
    assert up.shape == (shape[0], rank, *([1, 1] if len(shape) == 4 else []))
    assert down.shape == (rank, *shape[1:])
    approx = up.reshape(shape[0], rank) @ down.reshape(rank, -1)
    # Eckart-Young: the best rank-r approximation leaves exactly the tail singular values
    residual = torch.linalg.svdvals(matrix - approx)
    assert torch.allclose(residual[: singular.numel() - rank], singular[rank:], rtol=1e-4, atol=1e-5)
    tail = (singular[rank:].square().sum() / singular.square().sum()).sqrt().item()
    assert error == pytest.approx(tail, rel=1e-4)
    # balanced factors: up's and down's column/row norms are equal (sqrt of each singular value)
    up_norms, down_norms = up.reshape(shape[0], rank).norm(dim=0), down.reshape(rank, -1).norm(dim=1)
    assert torch.allclose(up_norms, down_norms, rtol=1e-4)


def test_decompose_by_energy_keeps_the_smallest_rank_that_holds_it():
    from patchbay_merge.extract import decompose

    matrix = torch.diag(torch.tensor([4.0, 2.0, 1.0, 0.5])) @ torch.linalg.qr(torch.randn(4, 9).T)[0].T
    power = torch.tensor([16.0, 4.0, 1.0, 0.25])
    # cumulative shares of the squared singular values: 0.753, 0.941, 0.988, 1
    for energy, expected in ((0.75, 1), (0.94, 2), (0.95, 3), (0.98, 3), (0.99, 4), (1.0, 4)):
        _, _, kept, error = decompose(matrix, None, energy)
        assert kept == expected, energy
        assert error == pytest.approx((power[expected:].sum() / power.sum()).sqrt().item(), abs=1e-5)
