"""T0: the methods taken from mergekit give its formulas' numbers on tiny tensors, and their known properties.

mergekit is not installed (it targets LLM weights and pulls in transformers): each reference below is
mergekit's formula (arcee-ai/mergekit: merge_methods/karcher.py, nuslerp.py, multislerp.py, linear.py,
nearswap.py, sce.py, generalized_task_arithmetic.py, sparsify.py) written out again here, in float64,
independently of merge/methods/. Random methods (DELLA) are checked against the reference with the
same keep-mask, and for their keep rates.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.t0

KEY = "layer.weight"


def t(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


A, B, C = t(8, 6, seed=1), t(8, 6, seed=2), t(8, 6, seed=3)
D1, D2, D3 = t(10, 12, seed=4), t(10, 12, seed=5), t(10, 12, seed=6)


@pytest.fixture(scope="module")
def ours():
    from patchbay_merge import method_registry as registry
    from patchbay_merge.context import KeyContext

    def call(name, *tensors, **scalars):
        return registry.get(name).fn(*tensors, **scalars, ctx=KeyContext(key=KEY, cache={}))

    return call


def close(got, want, tol=1e-5):
    assert got.shape == want.shape
    assert torch.allclose(got.double(), want.double(), atol=tol, rtol=tol), (got.double() - want).abs().max()


# ---- the references, from mergekit's formulas --------------------------------------------------------


def ref_karcher(xs, max_iter=10, tol=1e-5):
    vs = [x.double().flatten() for x in xs]
    norms = [math.sqrt(float(v @ v)) for v in vs]
    units = [v / n for v, n in zip(vs, norms, strict=True) if n > tol]
    a = 1.0 / len(units)
    u = sum(a * x for x in units)
    u = u / math.sqrt(float(u @ u))
    for _ in range(max_iter):
        tangent = torch.zeros_like(u)
        for x in units:
            d = max(-1.0, min(1.0, float(u @ x)))
            theta = math.acos(d)
            if theta >= tol:
                tangent += a * theta / math.sin(theta) * (x - d * u)
        nt = math.sqrt(float(tangent @ tangent))
        if nt < tol:
            break
        u = math.cos(nt) * u + math.sin(nt) * tangent / nt
        u = u / math.sqrt(float(u @ u))
    return (sum(norms) / len(xs) * u).reshape(xs[0].shape)


def ref_nuslerp_rows(t_, v0, v1):
    """Row by row (the last dimension): slerp of the raw vectors by the angle of their directions."""
    out = torch.empty_like(v0, dtype=torch.float64)
    for i in range(v0.shape[0]):
        x, y = v0[i].double(), v1[i].double()
        cos = float(x @ y) / max(x.norm().item(), 1e-7) / max(y.norm().item(), 1e-7)
        theta = math.acos(max(-1.0, min(1.0, cos)))
        if abs(math.sin(theta)) < 1e-8:
            out[i] = (1 - t_) * x + t_ * y
        else:
            out[i] = (math.sin((1 - t_) * theta) * x + math.sin(t_ * theta) * y) / math.sin(theta)
    return out


def ref_multislerp(xs, w, eps=1e-8):
    flat = [x.double().flatten() for x in xs]
    w = [wi / sum(w) for wi in w]
    norms = [f.norm().item() for f in flat]
    units = [f / (n + eps) for f, n in zip(flat, norms, strict=True)]
    mean = sum(wi * u for wi, u in zip(w, units, strict=True))
    mean = mean / mean.norm()
    tangent = sum(wi * (u - float(u @ mean) * mean) for wi, u in zip(w, units, strict=True))
    length = tangent.norm().item() + eps
    res = mean * math.cos(length) + tangent * math.sin(length) / length
    return (res * sum(wi * n for wi, n in zip(w, norms, strict=True))).reshape(xs[0].shape)


def ref_breadcrumbs_mask(d, density, gamma):
    """Sorted by magnitude, ascending: drop the n - keep - top smallest and the top largest."""
    n = d.numel()
    top, bottom = int(gamma * n), n - int(density * n) - int(gamma * n)
    if bottom < 0:
        top, bottom = top + bottom, 0
    order = sorted(range(n), key=lambda i: abs(float(d.flatten()[i])))
    mask = torch.zeros(n, dtype=torch.float64)
    for i in order[bottom:n - top]:
        mask[i] = 1
    return mask.reshape(d.shape)


def ref_gta(deltas, weights, masks, elect, normalize, rescale):
    """mergekit's generalized task arithmetic on sparsified deltas (rescale: L1 norm kept)."""
    kept = []
    for d, m in zip(deltas, masks, strict=True):
        d = d.double()
        k = d * m
        if rescale and k.abs().sum() > 1e-7:
            k = k * (d.abs().sum() / k.abs().sum())
        kept.append(k)
    out = torch.zeros_like(kept[0])
    div = torch.zeros_like(kept[0])
    for idx in torch.cartesian_prod(*[torch.arange(s) for s in kept[0].shape]):
        i = tuple(idx.tolist())
        wd = [w * k[i].item() for w, k in zip(weights, kept, strict=True)]
        sign = 1.0 if sum(wd) >= 0 else -1.0
        use = [(not elect) or (x > 0 and sign > 0) or (x < 0 and sign < 0) for x in wd]
        out[i] = sum(x for x, u in zip(wd, use, strict=True) if u)
        div[i] = sum(w for w, u in zip(weights, use, strict=True) if u)
    if not elect:
        div = torch.full_like(div, sum(weights) if abs(sum(weights)) >= 1e-8 else 1.0)
    div[div == 0] = 1
    return out / div if normalize else out


def ref_sce(deltas, topk):
    tv = torch.stack([d.double() for d in deltas])
    if topk < 1:
        var = tv.var(dim=0, unbiased=False).flatten()
        k = int(int((var != 0).sum()) * topk)
        mask = torch.zeros_like(var)
        mask[sorted(range(var.numel()), key=lambda i: -float(var[i]))[:k]] = 1
        tv = tv * mask.reshape(tv.shape[1:])
    energy = [float((x**2).mean()) for x in tv]
    w = [e / sum(energy) for e in energy]
    elected = torch.where(tv.sum(dim=0) >= 0, 1.0, -1.0).double()
    num = sum(w[i] * tv[i] * (tv[i].sign() == elected) for i in range(len(w)))
    den = sum(w[i] * (tv[i].sign() == elected).double() for i in range(len(w)))
    return num / den.clamp(min=1e-6)


# ---- against the references -------------------------------------------------------------------------


def test_karcher_matches_the_formula(ours):
    close(ours("karcher", A, B, C), ref_karcher([A, B, C]))
    close(ours("karcher", A, 3 * B, max_iter=3), ref_karcher([A, 3 * B], max_iter=3))


def test_karcher_of_identical_tensors_is_the_tensor_and_zeros_are_skipped(ours):
    close(ours("karcher", A, A, A), A)
    close(ours("karcher", A, torch.zeros_like(A)), A / 2)  # direction of A, mean norm |A| / 2
    assert not ours("karcher", torch.zeros_like(A), torch.zeros_like(A)).any()


@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
def test_nuslerp_matches_the_formula(ours, alpha):
    close(ours("nuslerp", A, B, alpha=alpha), ref_nuslerp_rows(alpha, A.reshape(1, -1), B.reshape(1, -1))
          .reshape(A.shape))
    close(ours("nuslerp", A, B, alpha=alpha, flatten=False), ref_nuslerp_rows(alpha, A, B))
    close(ours("nuslerp", A, B, alpha=alpha, flatten=False, row_wise=True),
          ref_nuslerp_rows(alpha, A.T.contiguous(), B.T.contiguous()).T)


def test_nuslerp_endpoints_and_parallel_rows(ours):
    close(ours("nuslerp", A, B, alpha=0.0), A)
    close(ours("nuslerp", A, B, alpha=1.0), B)
    close(ours("nuslerp", A, 2 * A, alpha=0.25), 1.25 * A)  # parallel: lerp, no NaN


@pytest.mark.parametrize("weights", ["", "1, 2, 0.5"])
def test_multislerp_matches_the_formula(ours, weights):
    w = [float(x) for x in weights.split(",")] if weights else [1.0, 1.0, 1.0]
    close(ours("multislerp", A, B, C, weights=weights), ref_multislerp([A, B, C], w))


def test_multislerp_of_two_is_slerp_like_and_of_one_is_the_input(ours):
    assert ours("multislerp", A) is A
    close(ours("multislerp", A, A, A), A, tol=1e-4)
    with pytest.raises(ValueError, match=r"weights='1, 1'.*3 input models.*give exactly 3"):
        ours("multislerp", A, B, C, weights="1, 1")


def test_linear_weights_any_number_of_models(ours):
    close(ours("linear", A, B, C, weights="1, 2, 1"), (A.double() + 2 * B + C) / 4)
    close(ours("linear", A, B, C, weights="1, 2, 1", normalize=False), A.double() + 2 * B + C)
    close(ours("linear", A, B, C), (A.double() + B + C) / 3)
    with pytest.raises(ValueError, match=r"weights='1, x'.*not a list of numbers"):
        ours("linear", A, B, weights="1, x")
    with pytest.raises(ValueError, match=r"sum to 0.*normalize=false"):
        ours("linear", A, B, weights="1, -1")


def test_nearswap_matches_the_formula(ours):
    a, b = A, A + 0.01 * B
    weight = (0.004 / (a - b).abs().double().clamp(min=1e-6)).clamp(0, 1)
    close(ours("nearswap", a, b, t=0.004), weight * b + (1 - weight) * a)
    close(ours("nearswap", a, b, t=0.0), a)
    close(ours("nearswap", a, b, t=100.0), b)


def _keep_from(density, gamma):
    return [ref_breadcrumbs_mask(d, density, gamma) for d in (D1, D2, D3)]


@pytest.mark.parametrize(("density", "gamma"), [(0.6, 0.05), (0.9, 0.2), (0.3, 0.0)])
def test_breadcrumbs_matches_the_formula(ours, density, gamma):
    masks = _keep_from(density, gamma)
    close(ours("breadcrumbs", D1, D2, D3, weights="1, 0.5, 2", density=density, gamma=gamma),
          ref_gta([D1, D2, D3], [1, 0.5, 2], masks, elect=False, normalize=False, rescale=False))
    close(ours("breadcrumbs_ties", D1, D2, D3, weights="1, 0.5, 2", density=density, gamma=gamma,
               normalize=True, rescale=True),
          ref_gta([D1, D2, D3], [1, 0.5, 2], masks, elect=True, normalize=True, rescale=True))


def test_breadcrumbs_densities_one_and_zero(ours):
    close(ours("breadcrumbs", D1, D2, density=1.0), D1.double() + D2)  # nothing dropped: task arithmetic
    assert not ours("breadcrumbs", D1, D2, density=0.0, gamma=0.0).any()
    kept = ours("breadcrumbs", D1, density=0.5, gamma=0.1)
    assert int((kept != 0).sum()) == D1.numel() // 2
    assert kept.abs().max() < D1.abs().max()  # the largest magnitudes are gone


def test_della_matches_the_formula_with_the_same_keep_mask(ours):
    from patchbay_merge.context import KeyContext
    from patchbay_merge.methods import _util, sparse

    ctx = KeyContext(key=KEY, cache={})
    gen = _util.generator(ctx, 3, D1.device)
    masks = [sparse.della_mask(d, 0.4, 0.1, gen) for d in (D1, D2)]
    for name, elect, normalize in (("della_linear", False, False), ("della", True, True)):
        got = ours(name, D1, D2, weights="0.7, 1.3", density=0.4, epsilon=0.1, seed=3)
        close(got, ref_gta([D1, D2], [0.7, 1.3], masks, elect=elect, normalize=normalize, rescale=True))


def test_della_keeps_large_magnitudes_more_often(ours):
    from patchbay_merge.methods import sparse

    rows = torch.arange(1.0, 201.0).repeat(200, 1)  # every row ranks its entries 1..200
    mask = sparse.della_mask(rows, 0.5, 0.3, torch.Generator().manual_seed(0))
    assert abs(mask.mean().item() - 0.5) < 0.01
    assert mask[:, :50].mean() < 0.3 < 0.7 < mask[:, -50:].mean()
    with pytest.raises(ValueError, match=r"density=0.9 \+- epsilon=0.15 leaves \(0, 1\)"):
        ours("della_linear", D1, density=0.9, epsilon=0.15)


@pytest.mark.parametrize("topk", [1.0, 0.5])
def test_sce_matches_the_formula(ours, topk):
    close(ours("sce", D1, D2, D3, select_topk=topk), ref_sce([D1, D2, D3], topk))


def test_sce_of_one_delta_is_the_delta(ours):
    close(ours("sce", D1), D1)


# ---- through the engine: recipes, .mecha text, a merge on tiny files ------------------------------------

SHAPES = {"model.diffusion_model.input_blocks.0.0.weight": (8, 4, 3, 3),
          "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight": (8, 768),
          "model.diffusion_model.out.2.bias": (70,)}


def test_new_methods_merge_through_the_engine_and_round_trip_as_mecha_text(ours, tmp_path):
    from patchbay_merge import mecha_text
    from patchbay_merge import recipe as R
    from patchbay_merge.execute import MergeOptions, merge
    from safetensors.torch import load_file, save_file

    tensors = {}
    for name, seed in (("a", 7), ("b", 8), ("c", 9)):
        gen = torch.Generator().manual_seed(seed)
        tensors[name] = {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}
        save_file(tensors[name], str(tmp_path / f"{name}.safetensors"))
    a, b, c = (R.model(str(tmp_path / f"{n}.safetensors")) for n in "abc")
    deltas = (R.call("subtract", b, a), R.call("subtract", c, a))
    recipe = R.call("add_difference", R.call("linear", a, b, c, weights="1, 2, 0.5"),
                    R.call("breadcrumbs_ties", *deltas, weights="1, 0.5", density=0.7, gamma=0.05), alpha=0.8)
    assert mecha_text.parse(mecha_text.dumps(recipe)) == recipe
    out = tmp_path / "out.safetensors"
    merge(recipe, out, MergeOptions(dtype="fp32", progress=False, fsync=False))
    got = load_file(str(out))
    for key in SHAPES:
        ta, tb, tc = (tensors[n][key] for n in "abc")
        mixed = ours("linear", ta, tb, tc, weights="1, 2, 0.5")
        kept = ours("breadcrumbs_ties", tb - ta, tc - ta, weights="1, 0.5", density=0.7, gamma=0.05)
        want = mixed + 0.8 * kept
        close(got[key], want)


def test_bad_parameters_are_refused_naming_the_value_and_the_fix(ours, tmp_path):
    from patchbay_merge import recipe as R
    from patchbay_merge.graph import RecipeError

    d = R.model("d.safetensors", "delta")
    with pytest.raises(RecipeError, match=r"density.*1\.5.*outside \[0, 1\]"):
        R.validate(R.call("breadcrumbs", d, density=1.5))
    with pytest.raises(RecipeError, match=r"t.*-1.*outside"):
        R.validate(R.call("nearswap", R.model("a"), R.model("b"), t=-1.0))
    with pytest.raises(ValueError, match=r"breadcrumbs: weights='1, 2, 3' gives 3 .* for 2 input models"):
        ours("breadcrumbs", D1, D2, weights="1, 2, 3")
