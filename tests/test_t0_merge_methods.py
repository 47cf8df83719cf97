"""T0: every built-in merge method against its formula, computed independently on small tensors."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.t0


@pytest.fixture(scope="module")
def m():
    from patchbay_merge import method_registry as registry

    return registry.get


@pytest.fixture(scope="module")
def ctx():
    from patchbay_merge.context import KeyContext

    def make(key="model.diffusion_model.input_blocks.1.0.weight", **kw):
        return KeyContext(key=key, cache={}, **kw)

    return make


def t(*shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen)


A, B, C = t(6, 5, seed=1), t(6, 5, seed=2), t(6, 5, seed=3)


def run(m, ctx, name, *tensors, **scalars):
    return m(name).fn(*tensors, **scalars, ctx=ctx())


def close(x, y, tol=1e-5):
    assert x.shape == y.shape
    assert torch.allclose(x, y, atol=tol, rtol=tol), (x - y).abs().max()


def test_weighted_sum(m, ctx):
    close(run(m, ctx, "weighted_sum", A, B, alpha=0.3), 0.7 * A + 0.3 * B)
    assert run(m, ctx, "weighted_sum", A, B, alpha=0.0) is A
    assert run(m, ctx, "weighted_sum", A, B, alpha=1.0) is B


def test_n_average(m, ctx):
    close(run(m, ctx, "n_average", A, B, C), (A + B + C) / 3)


def test_slerp(m, ctx):
    alpha = 0.25
    a, b = A.flatten().double(), B.flatten().double()
    omega = math.acos(float(a @ b / (a.norm() * b.norm())))
    unit = (math.sin((1 - alpha) * omega) * a / a.norm() + math.sin(alpha * omega) * b / b.norm())
    unit = unit / math.sin(omega)
    expected = unit * ((1 - alpha) * a.norm() + alpha * b.norm())
    close(run(m, ctx, "slerp", A, B, alpha=alpha), expected.reshape(A.shape).float())


def test_slerp_of_parallel_tensors_is_lerp(m, ctx):
    close(run(m, ctx, "slerp", A, 2 * A, alpha=0.5), 1.5 * A)


def test_task_arithmetic(m, ctx):
    close(run(m, ctx, "subtract", A, B), A - B)
    close(run(m, ctx, "add_difference", A, B - C, alpha=0.5), A + 0.5 * (B - C))
    assert run(m, ctx, "add_difference", A, B, alpha=0.0) is A


def test_perpendicular_component(m, ctx):
    a, b = A.flatten(), B.flatten()
    expected = b - a * (a @ b) / (a @ a)
    res = run(m, ctx, "perpendicular_component", A, B).flatten()
    close(res, expected)
    assert abs(float(res @ a)) < 1e-3
    close(run(m, ctx, "perpendicular_component", torch.zeros(3), torch.ones(3)), torch.zeros(3))


def test_train_difference(m, ctx):
    mask = 1.8 * (B - A).abs() / ((B - A).abs() + (B - C).abs())
    close(run(m, ctx, "train_difference_mask", A, B, C, alpha=0.5), 0.5 * mask)
    close(run(m, ctx, "train_difference", A, B, C, alpha=0.5), A + (B - C) * 0.5 * mask)


def test_opposite_masks(m, ctx):
    expected = 0.5 * 2 * (A - B).abs() / ((A - B).abs() + (A + B - 2 * C).abs())
    close(run(m, ctx, "add_opposite_mask", A, B, C, alpha=0.5), expected)
    spread = torch.maximum((A - C).abs(), (B - C).abs())
    strict = 2 * 0.5 * torch.clamp((C - A) * (B - C) / spread**2, min=0)
    close(run(m, ctx, "add_strict_opposite_mask", A, B, C, alpha=0.5), strict)


def test_geometric_sum(m, ctx):
    a, b = A.abs() + 0.1, B.abs() + 0.1
    close(run(m, ctx, "geometric_sum", a, b, alpha=0.3), a**0.7 * b**0.3)


def test_multiply_quotient(m, ctx):
    a, b, c = A.double(), B.double(), C.double()
    ac, bc = torch.log(a.abs() / c.abs()), torch.log(b.abs() / c.abs())
    power = torch.clamp(-ac * bc / torch.maximum(ac.abs(), bc.abs()) ** 2, min=0)
    expected = a * torch.pow((b / c).to(torch.complex128), power).real
    close(run(m, ctx, "multiply_quotient", A, B, C, alpha=1.0), expected.float(), tol=1e-4)


def test_add_cosine(m, ctx):
    def cos(x, y):
        return (x * y).sum(0) / (x.norm(dim=0) * y.norm(dim=0))

    k_a = 1 - torch.clamp(cos(A, B) - 0.2, 0, 1)
    close(run(m, ctx, "add_cosine_a", A, B, alpha=0.2), A + (B - A) * k_a)
    whole = (A * B).sum() / (A.norm() * B.norm())
    k_b = 1 - torch.clamp((cos(A, B) + whole) / 2 - 0.2, 0, 1)
    close(run(m, ctx, "add_cosine_b", A, B, alpha=0.2), A + (B - A) * k_b)


def test_crossover_splits_frequencies(m, ctx):
    low, high = torch.ones(16), torch.cos(torch.arange(16) * math.pi)  # DC vs the Nyquist frequency
    res = run(m, ctx, "crossover", low + high, 3 * low + 5 * high, alpha=0.5, tilt=0.0)
    close(res, low + 5 * high)
    close(run(m, ctx, "crossover", A, B, alpha=0.3, tilt=1.0), torch.lerp(A, B, 0.3))


def test_tensor_sum_copies_rows_and_leaves_inputs(m, ctx):
    a, b = A.clone(), B.clone()
    res = run(m, ctx, "tensor_sum", a, b, width=0.5, offset=0.0)
    close(res, torch.cat([B[:3], A[3:]]))
    res = run(m, ctx, "tensor_sum", a, b, width=0.5, offset=0.75)  # wraps: rows 4.5..6 and 0..1.5
    close(res, torch.cat([B[:2], A[2:4], B[4:]]))
    assert torch.equal(a, A) and torch.equal(b, B)


def test_top_k_tensor_sum_redistributes_a_by_b_order(m, ctx):
    a, b = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([0.4, 0.1, 0.3, 0.2])
    close(run(m, ctx, "top_k_tensor_sum", a, b, width=1.0, offset=0.0), torch.tensor([4.0, 1.0, 3.0, 2.0]))


def _ties_reference(deltas, k, vote_sgn=False):
    kept = []
    for d in deltas:
        n_drop = max(int((1 - k) * d.numel()), 1)
        threshold = d.abs().flatten().sort().values[n_drop - 1]
        kept.append(torch.where(d.abs() >= threshold, d, torch.zeros_like(d)))
    stacked = torch.stack(kept)
    sign = torch.sign(stacked.sum(0) if vote_sgn else torch.sign(stacked).sum(0))
    agree = torch.sign(stacked) == sign  # zeros count only where the elected sign is zero
    total = (stacked * agree).sum(0)
    count = agree.sum(0)
    return torch.nan_to_num(total / count, nan=0.0, posinf=0.0, neginf=0.0)


def test_ties_sum(m, ctx):
    deltas = (A, B, C)
    close(run(m, ctx, "ties_sum", *deltas, k=0.5), _ties_reference(deltas, 0.5))
    close(run(m, ctx, "ties_sum", *deltas, k=1.0, vote_sgn=True), _ties_reference(deltas, 1.0, True))


def _stock_t(deltas, eps=1e-6):
    cosines = [(x * y).sum(-1) / torch.clamp(x.norm(dim=-1) * y.norm(dim=-1), min=eps)
               for x, y in zip(deltas, deltas[1:], strict=False)]
    cos = torch.stack(cosines).mean(0)
    n = len(deltas)
    return (n * cos / (1 + (n - 1) * cos)).unsqueeze(-1)


def test_model_stock(m, ctx):
    deltas = (A, B, C)
    close(run(m, ctx, "model_stock", *deltas), _stock_t(deltas) * (A + B + C) / 3)


def _conv_1x1_deltas():
    """Issue 30's two deltas of a 1x1 convolution (base c, fine-tunes a and b)."""
    g = torch.Generator().manual_seed(1)
    c = torch.randn(8, 8, 1, 1, generator=g) * 0.05
    a = c + 0.015 * torch.randn(8, 8, 1, 1, generator=g)
    b = c + 0.015 * torch.randn(8, 8, 1, 1, generator=g)
    return a - c, b - c


def test_model_stock_takes_a_conv_as_its_matrix_and_a_single_value_as_the_mean(m, ctx):
    k1, k2 = t(6, 4, 3, 3, seed=4), t(6, 4, 3, 3, seed=5)  # one vector per output filter, 36 values
    kernel = run(m, ctx, "model_stock", k1, k2)
    rows = (k1.reshape(6, 36), k2.reshape(6, 36))
    close(kernel.reshape(6, 36), _stock_t(rows) * (rows[0] + rows[1]) / 2)
    d1, d2 = _conv_1x1_deltas()
    got = run(m, ctx, "model_stock", d1, d2)
    flat = (d1.reshape(8, 8), d2.reshape(8, 8))  # what a linear of the same matrix gives, by the formula
    close(got.reshape(8, 8), _stock_t(flat) * (flat[0] + flat[1]) / 2)
    assert got.abs().max() <= max(d1.abs().max(), d2.abs().max())  # was +-3.4e38 at 27 of 64 values
    column_a, column_b = torch.tensor([0.1, 0.2]), torch.tensor([0.3, -0.1])  # [2, 1]: one cosine over 2
    column = run(m, ctx, "model_stock", column_a.reshape(2, 1), column_b.reshape(2, 1))
    close(column, _stock_t([column_a, column_b]) * torch.tensor([[0.2], [0.05]]))
    one = run(m, ctx, "model_stock", torch.tensor([[0.1]]), torch.tensor([[-0.3]]))  # no angle: the mean
    close(one, torch.tensor([[-0.1]]))
    stock = run(m, ctx, "ties_sum_extended", d1, d2, k=1.0)  # TIES + Model Stock: the same definition
    close(stock.reshape(8, 8), run(m, ctx, "ties_sum_extended", *flat, k=1.0))
    assert stock.abs().max() < 1


def test_ties_sum_extended_with_stock(m, ctx):
    deltas = (A, B, C)  # apply_stock=True fixes Model Stock's ratio at 1: plain TIES
    close(run(m, ctx, "ties_sum_extended", *deltas, k=0.6, apply_stock=True), _ties_reference(deltas, 0.6))
    stacked = torch.stack([_ties_reference([d], 0.6) for d in deltas])  # trimmed to the top 60 %
    agree = torch.sign(stacked) == torch.sign(torch.sign(stacked).sum(0))
    elected = stacked * agree
    t_ratio = _stock_t(list(elected))  # Model Stock's ratio of the elected deltas
    expected = torch.nan_to_num(elected.sum(0) * t_ratio / agree.sum(0), nan=0.0)
    close(run(m, ctx, "ties_sum_extended", *deltas, k=0.6), expected, tol=1e-4)


def test_geometric_median_resists_an_outlier(m, ctx):
    points = (torch.zeros(4), torch.ones(4) * 0.1, torch.ones(4) * -0.1, torch.ones(4) * 100.0)
    res = run(m, ctx, "geometric_median", *points, maxiter=500)
    assert res.abs().max() < 0.2  # the mean would be ~25
    pts = torch.stack(points)

    def cost(x):
        return (pts - x).norm(dim=1).sum()

    assert cost(res) <= cost(pts.mean(0))


def test_clamp(m, ctx):
    expected = torch.minimum(torch.maximum(A, torch.minimum(B, C)), torch.maximum(B, C))
    close(run(m, ctx, "clamp", A, B, C), expected)
    lo, hi = torch.zeros(3), torch.ones(3)
    x = torch.tensor([-1.0, 0.5, 2.0])
    close(run(m, ctx, "clamp", x, lo, hi, stiffness=1.0), torch.tensor([0.0, 0.5, 1.0]))


def test_dare_dropout_is_seeded_and_rescaled(m, ctx):
    from patchbay_merge.context import KeyContext

    delta = torch.ones(2000)
    fn = m("ties_sum_with_dropout").fn
    res = fn(delta, probability=0.5, k=1.0, apply_stock=True, ctx=KeyContext(key="k", seed=7))
    assert set(res.unique().tolist()) <= {0.0, 2.0}
    assert 0.4 < (res != 0).float().mean() < 0.6
    again = fn(delta, probability=0.5, k=1.0, apply_stock=True, ctx=KeyContext(key="k", seed=7))
    other_key = fn(delta, probability=0.5, k=1.0, apply_stock=True, ctx=KeyContext(key="j", seed=7))
    assert torch.equal(res, again) and not torch.equal(res, other_key)
    assert torch.equal(fn(delta, probability=1.0, ctx=KeyContext()), torch.zeros(2000))


def test_della_keeps_large_magnitudes_more_often(m, ctx):
    from patchbay_merge.context import KeyContext

    delta = torch.linspace(0.01, 1.0, 4000)
    res = m("ties_sum_with_dropout").fn(delta, probability=0.5, della_eps=0.8, k=1.0, apply_stock=True,
                                        rescale=False, ctx=KeyContext(seed=1))
    kept = res != 0
    assert kept[:1000].float().mean() < 0.3 < 0.7 < kept[-1000:].float().mean()


def test_dropout(m, ctx):
    from patchbay_merge.context import KeyContext

    d1, d2 = torch.ones(4000), 3 * torch.ones(4000)
    res = m("dropout").fn(d1, d2, probability=0.5, rescale=1.0, ctx=KeyContext(seed=3))
    # kept by both: mean 2, by one: 1 or 3, by none: 0; all divided by (1 - p) ** rescale
    assert set(res.unique().tolist()) <= {0.0, 2.0, 4.0, 6.0}
    res_disjoint = m("dropout").fn(d1, d2, probability=0.5, overlap=0.0, ctx=KeyContext(seed=3))
    assert set(res_disjoint.unique().tolist()) <= {0.0, 2.0, 6.0}  # overlap 0: never both


def test_overlapping_sets_pmf_is_a_distribution():
    from patchbay_merge.methods.dropout import overlapping_sets_pmf

    for overlap in (0.0, 0.3, 1.0, 1.5, 2.0):
        pmf = overlapping_sets_pmf(3, 0.4, overlap, 0.5)
        assert pmf.shape == (8,) and abs(float(pmf.sum()) - 1) < 1e-9 and (pmf >= 0).all()


def test_rotate_aligns_a_rotated_copy(m, ctx):
    q, _ = torch.linalg.qr(t(5, 5, seed=9))
    b = A @ q
    context = ctx()
    fn = m("rotate").fn
    close(fn(A, b, alignment=1.0, alpha=0.0, centralization=0.0, ctx=context), b, tol=1e-4)
    assert "procrustes" in context.cache
    half = fn(A, b, alignment=0.5, alpha=0.0, centralization=0.0, ctx=context)
    cached = context.cache["procrustes"]
    assert torch.allclose(half.norm(dim=1), A.norm(dim=1), atol=1e-4)  # still a pure rotation
    twice = fn(half, b, alignment=1.0, alpha=0.0, centralization=0.0, ctx=ctx())
    close(twice, b, tol=1e-3)
    fn(A, b, alignment=0.5, alpha=0.7, centralization=0.0, ctx=context)
    assert context.cache["procrustes"] is cached  # only alpha changed: decomposition reused


def test_rotate_wide_matrix_full_alignment(m, ctx):
    wide = t(3, 6, seed=4)
    q, _ = torch.linalg.qr(t(6, 6, seed=5))
    res = m("rotate").fn(wide, wide @ q, alignment=1.0, alpha=0.0, centralization=0.0, ctx=ctx())
    assert (res - wide @ q).norm() < 0.8 * (wide - wide @ q).norm()  # moved towards B
    skew = t(6, 6, seed=7) * 0.1
    near = wide @ torch.linalg.matrix_exp(skew - skew.T)  # a small rotation: the geodesic converges
    context = ctx()
    end = m("rotate").fn(wide, near, alignment=1.0, alpha=0.0, centralization=0.0, ctx=ctx())
    almost = m("rotate").fn(wide, near, alignment=0.999, alpha=0.0, centralization=0.0, ctx=context)
    half = m("rotate").fn(wide, near, alignment=0.5, alpha=0.0, centralization=0.0, ctx=context)
    close(almost, end, tol=1e-2)
    assert (half - end).norm() < (wide - end).norm()  # part of the way
    assert "log_stiefel" in context.cache


def test_truncate_rank(m, ctx):
    u, s, vh = torch.linalg.svd(A, full_matrices=False)
    expected = u[:, :2] @ torch.diag(s[:2]) @ vh[:2]
    close(run(m, ctx, "truncate_rank", A, rank=2, use_approximate_basis=False), expected, tol=1e-4)
    approx = run(m, ctx, "truncate_rank", A, rank=2, use_approximate_basis=True, approximate_basis_iters=8)
    close(approx, expected, tol=1e-3)
    assert torch.equal(run(m, ctx, "truncate_rank", A, rank=99), A)


def test_fallback_and_components(m, ctx):
    from patchbay_merge.context import KeyContext

    assert m("fallback").accepts_missing
    assert m("fallback").fn(None, B, ctx=ctx()) is B and m("fallback").fn(A, B, ctx=ctx()) is A
    unet = KeyContext(key="model.diffusion_model.out.2.weight", arch="sd15")
    clip = KeyContext(key="cond_stage_model.transformer.text_model.final_layer_norm.weight", arch="sd15")
    assert m("pick_component").fn(A, component="diffuser", ctx=unet) is A
    assert m("pick_component").fn(A, component="diffuser", ctx=clip) is None
    assert m("omit_component").fn(A, component="clip_l", ctx=clip) is None
    assert m("omit_component").fn(A, component="clip_l", ctx=unet) is A
    with pytest.raises(ValueError, match="valid components"):
        m("pick_component").fn(A, component="clip_g", ctx=unet)
    with pytest.raises(ValueError, match="not 'unknown'"):
        m("pick_component").fn(A, component="diffuser", ctx=KeyContext(key="w"))


def test_methods_never_change_their_inputs(m, ctx):
    from patchbay_merge import method_registry as registry

    for method in registry.all_methods():
        inputs = tuple(x.clone() for x in (A, B, C)[: len(method.inputs) + method.variadic])
        before = [x.clone() for x in inputs]
        context = ctx(arch="sd15")
        args = [{context.key: x} for x in inputs] if method.related else inputs  # group inputs: key -> tensor
        method.fn(*args, ctx=context)
        assert all(torch.equal(x, y) for x, y in zip(inputs, before, strict=True)), method.name


@pytest.mark.parametrize("case", [
    "normal", "ties_and_zeros", "mostly_zeros", "tiny_and_huge", "inf_and_nan", "fp16"])
def test_kth_smallest_magnitude_equals_kthvalue_on_large_tensors(case):
    """The radix pass behind TIES's and the slicing methods' thresholds gives torch.kthvalue's value
    exactly, above the size where it takes over (2**20 elements), at the ends and in the middle."""
    from patchbay_merge.methods._util import _RADIX_MIN, kth_smallest_magnitude

    gen = torch.Generator().manual_seed(7)
    n = _RADIX_MIN + 12344  # a multiple of 5: the input is taken as a matrix too
    values = torch.randn(n, generator=gen)
    if case == "ties_and_zeros":
        values = torch.round(values * 4) / 4  # few distinct magnitudes, a third of them zero
    elif case == "mostly_zeros":  # one bucket holds most values: kthvalue on the whole tensor
        values[: n * 3 // 4] = 0
    elif case == "tiny_and_huge":
        values = values * torch.logspace(-40, 38, n)[torch.randperm(n, generator=gen)]
    elif case == "inf_and_nan":
        values[::1000] = float("inf")
        values[5::1000] = -float("inf")
        values[7::977] = float("nan")
    elif case == "fp16":
        values = values.half()
    magnitudes = values.abs().float()
    for k in (1, 2, n // 3, n // 2, n - 1000, n):
        expected, actual = magnitudes.kthvalue(k).values, kth_smallest_magnitude(values.reshape(-1, 5), k)
        assert torch.equal(actual, expected) or (actual.isnan() and expected.isnan()), (case, k, actual)


def test_ties_sum_of_deltas_that_are_all_zero_is_the_votes_zero_bit_for_bit():
    """All-zero deltas (a text encoder both fine-tunes left alone) skip the sort: the result is what the
    full vote gives (0 / n = +0.0 everywhere), byte for byte; one non-zero delta takes the full path."""
    from patchbay_merge.methods.ties import ties_sum, ties_sum_deltas  # the function itself, as declared

    zeros = [torch.zeros(64, 32), torch.zeros(64, 32)]
    filtered, counts = ties_sum_deltas(zeros, 0.5, False)
    full = torch.nan_to_num(filtered.sum(dim=0) / counts, nan=0, posinf=0, neginf=0)
    fast = ties_sum(*zeros, k=0.5)
    assert torch.equal(fast.view(torch.int32), full.view(torch.int32))
    one = [torch.zeros(64, 32), torch.randn(64, 32, generator=torch.Generator().manual_seed(3))]
    filtered, counts = ties_sum_deltas(one, 0.5, False)
    assert torch.equal(ties_sum(*one, k=0.5), torch.nan_to_num(filtered.sum(dim=0) / counts, nan=0))
