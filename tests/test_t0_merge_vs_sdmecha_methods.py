"""T0: our methods give sd-mecha 1.1.8's numbers (fp32, <= 1e-5) for each deterministic method both have.

sd-mecha runs through its public API (``sd_mecha.merge`` of in-memory state dicts, fp32), ours
through ``registry.get(name).fn`` on the same tensors. Seeded methods are compared where both
draw from the same torch generator (DARE / DELLA with an explicit seed).
"""

from __future__ import annotations

import sys

import pytest
import torch
from bench_merge import SilentProgress as _NoBar  # a tqdm that prints nothing

pytestmark = pytest.mark.t0

sd_mecha = pytest.importorskip("sd_mecha")
from sd_mecha.extensions.builtin.merge_methods import (  # noqa: E402
    cosine,
    kronecker,
    limiting,
    linear,
    logistics,
    slicing,
    svd,
    ties,
)

crossover = sys.modules["sd_mecha.extensions.builtin.merge_methods.crossover"]  # the name is shadowed

KEY = "layer.weight"


def t(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


A, B, C = t(8, 6, seed=11), t(8, 6, seed=12), t(8, 6, seed=13)
CONV_A, CONV_B = t(4, 3, 3, 3, seed=14), t(4, 3, 3, 3, seed=15)


def sdm(tensor, space="weight"):
    return sd_mecha.model({KEY: tensor}, merge_space=space)


def run_sd_mecha(node, space):
    out: dict = {}
    sd_mecha.merge(node, output=out, merge_dtype=torch.float32, output_dtype=torch.float32,
                   merge_device="cpu", output_device="cpu", threads=0, tqdm=_NoBar, strict_merge_space=space)
    return out[KEY]


@pytest.fixture(scope="module")
def ours():
    from patchbay_merge import method_registry as registry
    from patchbay_merge.context import KeyContext

    def call(name, *tensors, **scalars):
        return registry.get(name).fn(*tensors, **scalars, ctx=KeyContext(key=KEY, cache={}))

    return call


D1, D2, D3 = A - C, B - C, t(8, 6, seed=16)
_SKEW = 0.1 * t(8, 8, seed=17)
WIDE_A = t(6, 8, seed=18)  # B is A turned a little: the Stiefel geodesic iteration converges
WIDE_B = WIDE_A @ torch.linalg.matrix_exp(_SKEW - _SKEW.T) + 0.01 * t(6, 8, seed=19)

CASES = [
    ("weighted_sum", lambda: linear.weighted_sum(sdm(A), sdm(B), alpha=0.3), (A, B), {"alpha": 0.3}),
    ("n_average", lambda: linear.n_average(sdm(A), sdm(B), sdm(C)), (A, B, C), {}),
    ("slerp", lambda: linear.slerp(sdm(A), sdm(B), alpha=0.35), (A, B), {"alpha": 0.35}),
    ("slerp_parallel", lambda: linear.slerp(sdm(A), sdm(2 * A), alpha=0.35), (A, 2 * A), {"alpha": 0.35}),
    ("add_difference", lambda: linear.add_difference(sdm(A), sdm(D2, "delta"), alpha=0.7), (A, D2),
     {"alpha": 0.7}),
    ("subtract", lambda: linear.subtract(sdm(A), sdm(B)), (A, B), {}),
    ("perpendicular_component", lambda: linear.perpendicular_component(sdm(A), sdm(B)), (A, B), {}),
    ("train_difference_mask", lambda: linear.train_difference_mask(sdm(A), sdm(B), sdm(C), alpha=0.6),
     (A, B, C), {"alpha": 0.6}),
    ("add_opposite_mask", lambda: linear.add_opposite_mask(sdm(A), sdm(B), sdm(C), alpha=0.6),
     (A, B, C), {"alpha": 0.6}),
    ("add_strict_opposite_mask", lambda: linear.add_strict_opposite_mask(sdm(A), sdm(B), sdm(C), alpha=0.6),
     (A, B, C), {"alpha": 0.6}),
    ("geometric_sum", lambda: linear.geometric_sum(sdm(A), sdm(B), alpha=0.3), (A, B), {"alpha": 0.3}),
    ("multiply_quotient", lambda: linear.multiply_quotient(sdm(A), sdm(B), sdm(C), alpha=0.8), (A, B, C),
     {"alpha": 0.8}),
    ("add_cosine_a", lambda: cosine.add_cosine_a(sdm(A), sdm(B), alpha=0.1), (A, B), {"alpha": 0.1}),
    ("add_cosine_b", lambda: cosine.add_cosine_b(sdm(A), sdm(B), alpha=0.1), (A, B), {"alpha": 0.1}),
    ("crossover", lambda: crossover.crossover(sdm(A), sdm(B), alpha=0.4, tilt=0.3), (A, B),
     {"alpha": 0.4, "tilt": 0.3}),
    ("crossover_sharp", lambda: crossover.crossover(sdm(CONV_A), sdm(CONV_B), alpha=0.6, tilt=0.0),
     (CONV_A, CONV_B), {"alpha": 0.6, "tilt": 0.0}),
    ("tensor_sum", lambda: slicing.tensor_sum(sdm(A), sdm(B), width=0.4, offset=0.8), (A, B),
     {"width": 0.4, "offset": 0.8}),
    ("top_k_tensor_sum", lambda: slicing.top_k_tensor_sum(sdm(A), sdm(B), width=0.5, offset=0.25), (A, B),
     {"width": 0.5, "offset": 0.25}),
    ("clamp", lambda: limiting.clamp(sdm(A), sdm(B), sdm(C), stiffness=0.3), (A, B, C), {"stiffness": 0.3}),
    ("ties_sum", lambda: ties.ties_sum(sdm(D1, "delta"), sdm(D2, "delta"), sdm(D3, "delta"), k=0.5),
     (D1, D2, D3), {"k": 0.5}),
    ("ties_sum_extended", lambda: ties.ties_sum_extended(sdm(D1, "delta"), sdm(D2, "delta"), k=0.3),
     (D1, D2), {"k": 0.3}),
    ("ties_sum_extended_median", lambda: ties.ties_sum_extended(
        sdm(D1, "delta"), sdm(D2, "delta"), sdm(D3, "delta"), k=0.7, apply_median=True),
     (D1, D2, D3), {"k": 0.7, "apply_median": True}),
    ("ties_sum_with_dropout", lambda: ties.ties_sum_with_dropout(
        sdm(D1, "delta"), sdm(D2, "delta"), probability=0.3, k=0.8, seed=42),
     (D1, D2), {"probability": 0.3, "k": 0.8, "seed": 42}),
    ("della", lambda: ties.ties_sum_with_dropout(
        sdm(D1, "delta"), sdm(D2, "delta"), probability=0.4, della_eps=0.2, k=1.0, seed=5),
     (D1, D2), {"probability": 0.4, "della_eps": 0.2, "k": 1.0, "seed": 5}),
    ("model_stock", lambda: ties.model_stock(sdm(D1, "delta"), sdm(D2, "delta"), sdm(D3, "delta")),
     (D1, D2, D3), {}),
    ("geometric_median", lambda: ties.geometric_median(sdm(A), sdm(B), sdm(C), sdm(D3)), (A, B, C, D3), {}),
    ("rotate", lambda: svd.rotate(sdm(A), sdm(B), alignment=1.0, alpha=0.3), (A, B),
     {"alignment": 1.0, "alpha": 0.3}),
    ("rotate_fractional", lambda: svd.rotate(sdm(A), sdm(B), alignment=0.5, alpha=0.0), (A, B),
     {"alignment": 0.5, "alpha": 0.0}),
    ("rotate_wide_fractional", lambda: svd.rotate(sdm(WIDE_A), sdm(WIDE_B), alignment=0.3, alpha=0.2),
     (WIDE_A, WIDE_B), {"alignment": 0.3, "alpha": 0.2}),
    ("rotate_conv", lambda: svd.rotate(sdm(CONV_A), sdm(CONV_B), alignment=1.0, alpha=0.5,
                                       centralization=0.5),
     (CONV_A, CONV_B), {"alignment": 1.0, "alpha": 0.5, "centralization": 0.5}),
    ("truncate_rank", lambda: svd.truncate_rank(sdm(D1, "delta"), rank=3, use_approximate_basis=False),
     (D1,), {"rank": 3, "use_approximate_basis": False}),
    ("scale", lambda: linear.scale(sdm(D1, "delta"), alpha=-0.7), (D1,), {"alpha": -0.7}),
    ("cast", lambda: logistics.cast(sdm(A), dtype="float16"), (A,), {"dtype": "float16"}),
    ("cast_bfloat16", lambda: logistics.cast(sdm(A), dtype="bfloat16"), (A,), {"dtype": "bfloat16"}),
    ("cast_int8", lambda: logistics.cast(sdm(3 * A), dtype="int8"), (3 * A,), {"dtype": "int8"}),
    ("stack", lambda: logistics.stack(sdm(A), sdm(B), sdm(C)), (A, B, C), {}),
    ("omit_non_finite", lambda: logistics.omit_non_finite(sdm(A)), (A,), {}),
    *[(f"truncate_kronecker_{name}", lambda delta=delta, ratio=ratio: kronecker.truncate_kronecker(
        sdm(delta, "delta"), kronecker_ratio=ratio, use_approximate_basis=False),
       (delta,), {"kronecker_ratio": ratio, "use_approximate_basis": False})
      for name, delta, ratio in (("balanced", D1, 0.5), ("small_w1", D1, 0.0), ("large_w1", D1, 1.0),
                                 ("conv", CONV_A, 0.3), ("square", t(16, 16, seed=20), 0.5))],
    ("truncate_kronecker_seeded", lambda: kronecker.truncate_kronecker(
        sdm(CONV_B, "delta"), kronecker_ratio=0.6, approximate_basis_iters=3, approximate_basis_seed=7),
     (CONV_B,), {"kronecker_ratio": 0.6, "approximate_basis_iters": 3, "approximate_basis_seed": 7}),
]


@pytest.mark.parametrize(("name", "build", "tensors", "scalars"), CASES, ids=[c[0] for c in CASES])
def test_same_numbers_as_sd_mecha(ours, name, build, tensors, scalars):
    from patchbay_merge import method_registry as registry

    method = name.split("_parallel")[0].split("_sharp")[0]
    method = "truncate_kronecker" if method.startswith("truncate_kronecker") else method
    method = {"cast_bfloat16": "cast", "cast_int8": "cast"}.get(method, method)
    method = {"ties_sum_extended_median": "ties_sum_extended", "della": "ties_sum_with_dropout",
              "rotate_fractional": "rotate", "rotate_conv": "rotate",
              "rotate_wide_fractional": "rotate"}.get(method, method)
    space = registry.get(method).output
    delta_in = registry.get(method).inputs[0].space == "delta"
    expected = run_sd_mecha(build(), "delta" if space == "delta" or delta_in or tensors[0] is D1 else
                            "param" if space == "param" else "weight")
    got = ours(method, *tensors, **scalars)
    assert got.shape == expected.shape
    assert torch.allclose(got, expected.to(got.dtype), atol=1e-5, rtol=1e-5), (got - expected).abs().max()


def test_sd_mecha_rotate_wrapper_is_broken_in_1_1_8():
    """Why we compare against ``svd.rotate``: the public ``sd_mecha.rotate`` calls a missing method."""
    with pytest.raises(AttributeError, match="set_cache"):
        sd_mecha.rotate(sdm(A), sdm(B), alignment=0.5)


def test_sd_mecha_dropout_with_overlap_is_broken_in_1_1_8(ours):
    """sd-mecha's dropout crashes unless overlap is an odd integer (torch.lerp on numpy arrays); ours runs."""
    with pytest.raises(TypeError, match="lerp"):
        ties.dropout.__wrapped__(D1, D2, probability=0.5, overlap=0.0, overlap_emphasis=0.0, rescale=1.0,
                                 seed=1)
    res = ours("dropout", torch.ones(100), 3 * torch.ones(100), probability=0.5, overlap=0.0, seed=1)
    assert set(res.unique().tolist()) <= {0.0, 2.0, 6.0}


@pytest.mark.parametrize("kernel", [1, 3])
def test_sd_mecha_model_stock_blows_up_convolutions_in_1_1_8_ours_merges_their_matrix(ours, kernel):
    """sd-mecha takes Model Stock's cosine over the last dimension: in a 1x1 conv a length-1 one (a sign:
    where two deltas differ in sign t = -inf, written as +-3.4e38, issue 30), in a 3x3 conv 3 values of a
    kernel row, some of which point almost opposite ways (t without bound). Ours takes the kernel as its
    [out, in * kh * kw] matrix, so it gives sd-mecha's own numbers for that matrix, within the inputs'
    range."""
    g = torch.Generator().manual_seed(1)
    d1, d2 = (0.015 * torch.randn(64, 64, kernel, kernel, generator=g) for _ in range(2))
    theirs = run_sd_mecha(ties.model_stock(sdm(d1, "delta"), sdm(d2, "delta")), "delta")
    reach = max(d1.abs().max(), d2.abs().max())
    assert theirs.abs().max() > 100 * reach
    rows = (sdm(d1.reshape(64, -1), "delta"), sdm(d2.reshape(64, -1), "delta"))
    matrix = run_sd_mecha(ties.model_stock(*rows), "delta")
    got = ours("model_stock", d1, d2)
    assert torch.allclose(got.reshape(64, -1), matrix, atol=1e-7, rtol=1e-5)
    assert got.abs().max() <= reach


def test_sd_mecha_tensor_sum_changes_its_inputs_in_1_1_8(ours):
    """sd-mecha's tensor_sum writes into A, so a recipe that uses A again sees the change; ours copies."""
    a_sd = {KEY: torch.zeros(4, 2)}
    node = linear.weighted_sum(slicing.tensor_sum(sd_mecha.model(a_sd), sdm(torch.ones(4, 2)), width=0.5),
                               sd_mecha.model(a_sd), alpha=0.5)
    assert run_sd_mecha(node, "weight")[:, 0].tolist() == [1.0, 1.0, 0.0, 0.0]  # should be 0.5, 0.5, 0, 0
    a = torch.zeros(4, 2)
    res = ours("weighted_sum", ours("tensor_sum", a, torch.ones(4, 2), width=0.5), a, alpha=0.5)
    assert res[:, 0].tolist() == [0.5, 0.5, 0.0, 0.0] and not a.any()


def test_omit_non_finite_drops_the_key_as_sd_mecha_does(ours):
    """sd-mecha leaves a key with a NaN or an infinity out of its output; ours returns None (key absent)."""
    for bad in (float("nan"), float("inf")):
        tensor = A.clone()
        tensor[2, 3] = bad
        out: dict = {}
        sd_mecha.merge(logistics.omit_non_finite(sdm(tensor)), output=out, merge_dtype=torch.float32,
                       output_dtype=torch.float32, merge_device="cpu", output_device="cpu", threads=0,
                       tqdm=_NoBar, strict_merge_space="weight")
        assert KEY not in out
        assert ours("omit_non_finite", tensor) is None


def test_cast_names_a_wrong_dtype_and_the_valid_ones(ours):
    with pytest.raises(ValueError, match=r"unknown dtype 'float61'.*did you mean.*float16"):
        ours("cast", A, dtype="float61")


def test_sd_mecha_scale_by_zero_writes_a_scalar_in_1_1_8_ours_keeps_the_shape(ours):
    """sd-mecha's scale returns the number 0.0 for alpha=0, so the key is written as a 0-d tensor; ours
    gives zeros of the delta's shape (what every later method and the output file expect)."""
    theirs = run_sd_mecha(linear.scale(sdm(D1, "delta"), alpha=0.0), "delta")
    assert theirs.shape == () and theirs.item() == 0
    got = ours("scale", D1, alpha=0.0)
    assert got.shape == D1.shape and not got.any()
