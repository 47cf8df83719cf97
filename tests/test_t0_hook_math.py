"""T0: forward-pass deltas (hooks/lowrank.py) against baked weights, and the byte-budget cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.t0


@pytest.fixture(scope="module")
def lr(pack):
    from patchbay.hooks import lowrank

    return lowrank


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _rows(strengths, per_chunk):
    return torch.tensor(strengths, dtype=torch.float32).repeat_interleave(per_chunk)


def test_linear_low_rank_equals_baked_weight_per_row(lr):
    g = _gen()
    lin = torch.nn.Linear(12, 10)
    x = torch.randn(4, 5, 12, generator=g)  # 2 chunks x 2 rows, 5 tokens
    downs = [torch.randn(3, 12, generator=g), torch.randn(2, 12, generator=g)]
    ups = [torch.randn(10, 3, generator=g), torch.randn(10, 2, generator=g)]
    scales = [0.5, 2.0]
    deltas = lr.ModuleDeltas("linear", tuple(lin.weight.shape),
                             [lr.LowRankDelta(h, downs[h], ups[h], scales[h]) for h in (0, 1)])
    host = [[1.0, 0.0], [0.3, 0.7]]  # chunk 0: hook 0 only; chunk 1: both
    out = deltas.apply(lin, x, lin(x), lr.RowStrengths(host))
    for row in range(4):
        w = lin.weight.detach().clone()
        for h in (0, 1):
            w += host[row // 2][h] * scales[h] * ups[h] @ downs[h]
        torch.testing.assert_close(out[row], F.linear(x[row], w, lin.bias), rtol=1e-5, atol=1e-5)


def test_conv_low_rank_uses_the_modules_stride_and_padding(lr):
    g = _gen(1)
    conv = torch.nn.Conv2d(4, 6, 3, stride=2, padding=1)
    x = torch.randn(2, 4, 9, 9, generator=g)
    down, up = torch.randn(2, 4, 3, 3, generator=g), torch.randn(6, 2, 1, 1, generator=g)
    deltas = lr.ModuleDeltas("conv2d", tuple(conv.weight.shape), [lr.LowRankDelta(0, down, up, 0.25)])
    host = [[0.0], [1.5]]
    out = deltas.apply(conv, x, conv(x), lr.RowStrengths(host))
    baked = conv.weight.detach() + 1.5 * 0.25 * (up.flatten(1) @ down.flatten(1)).reshape(conv.weight.shape)
    torch.testing.assert_close(out[0], conv(x)[0])
    torch.testing.assert_close(out[1], F.conv2d(x[1:], baked, conv.bias, 2, 1)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("module", [torch.nn.Linear(12, 10), torch.nn.Conv2d(12, 10, 1),
                                    torch.nn.Conv2d(12, 10, 3, stride=2, padding=1)],
                         ids=["linear", "conv1x1", "conv3x3"])
def test_compiled_form_with_strengths_as_a_tensor_equals_the_eager_form(lr, module):
    """add_rows (hooks/compiled.py's form: every row, ranks side by side, strengths from a tensor with
    spare hook columns) gives what apply gives with the same strengths."""
    g = _gen(5)
    kind = lr.module_kind(module)
    ones, kernel = (1,) * (module.weight.ndim - 2), tuple(module.weight.shape[2:])
    x = torch.randn(6, 12, 7, 7, generator=g) if kernel else torch.randn(6, 5, 12, generator=g)  # 3 chunks
    deltas = lr.ModuleDeltas(kind, tuple(module.weight.shape), [
        lr.LowRankDelta(h, torch.randn(r, 12, *kernel, generator=g), torch.randn(10, r, *ones, generator=g),
                        scale) for h, r, scale in ((0, 3, 0.5), (1, 2, 2.0))])
    host = [[1.0, 0.0], [0.3, 0.7], [0.0, 0.0]]
    with torch.no_grad():
        y = module(x)
        expected = deltas.apply(module, x, y.clone(), lr.RowStrengths(host))
        rows = torch.zeros(3, 8)
        rows[:, :2] = torch.tensor(host)
        factors = deltas.row_factors(x.device, x.dtype)
        assert factors.down.shape[0] == 5 and factors.hook.tolist() == [0, 0, 0, 1, 1]
        out = deltas.add_rows(module, x, y, rows, factors)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["group_norm", "layer_norm"])
def test_norm_weight_and_bias_deltas_equal_patched_norms(lr, kind):
    g = _gen(2)
    module = torch.nn.GroupNorm(2, 4) if kind == "group_norm" else torch.nn.LayerNorm(4)
    x = torch.randn(2, 4, 3, 3, generator=g) if kind == "group_norm" else torch.randn(2, 3, 4, generator=g)
    dw, db = torch.randn(4, generator=g), torch.randn(4, generator=g)
    dense = [lr.DenseDelta(0, lambda d, t, s: dw.to(d, t)),
             lr.DenseDelta(0, lambda d, t, s: db.to(d, t), bias=True)]
    deltas = lr.ModuleDeltas(kind, (4,), dense=dense)
    host = [[0.5], [2.0]]
    out = deltas.apply(module, x, module(x), lr.RowStrengths(host))
    for row, s in enumerate((0.5, 2.0)):
        w, b = module.weight.detach() + s * dw, module.bias.detach() + s * db
        ref = (F.group_norm(x[row:row + 1], 2, w, b, module.eps) if kind == "group_norm"
               else F.layer_norm(x[row:row + 1], (4,), w, b, module.eps))
        torch.testing.assert_close(out[row:row + 1], ref, rtol=1e-5, atol=1e-5)


def test_nonlinear_dense_delta_is_fetched_once_per_distinct_strength(lr):
    lin = torch.nn.Linear(3, 3, bias=False)
    x = torch.randn(3, 3, generator=_gen(3))
    asked = []

    def fetch(device, dtype, strength):
        asked.append(strength)
        return torch.eye(3) * strength**2  # not linear in the strength

    deltas = lr.ModuleDeltas("linear", (3, 3), dense=[lr.DenseDelta(0, fetch, linear=False)])
    host = [[2.0], [0.0], [2.0]]
    out = deltas.apply(lin, x, lin(x), lr.RowStrengths(host))
    assert asked == [2.0]
    torch.testing.assert_close(out, lin(x) + torch.tensor([[1.0], [0.0], [1.0]]) * 4.0 * x)


@pytest.mark.parametrize("kind", ["linear", "conv2d"])
def test_replacing_delta_recomputes_its_rows_with_the_exact_weight(lr, kind):
    """A replacing delta's rows are the module run with W + D itself (the same call a model whose
    weight is W + D makes, so bit-identical on the full batch); rows it does not carry keep y, and
    where a second replacing hook shares rows it is added as an ordinary delta."""
    g = _gen(4)
    module = torch.nn.Linear(6, 5) if kind == "linear" else torch.nn.Conv2d(3, 4, 3, padding=1)
    x = torch.randn(3, 6, generator=g) if kind == "linear" else torch.randn(3, 3, 5, 5, generator=g)
    d0, d1 = (torch.randn(module.weight.shape, generator=g) for _ in range(2))
    op = F.linear if kind == "linear" else (lambda a, w, b: F.conv2d(a, w, b, padding=1))
    w = module.weight.detach()
    deltas = lr.ModuleDeltas(kind, tuple(w.shape), dense=[
        lr.DenseDelta(0, lambda d, t, s: d0 * s, linear=False, replace=True),
        lr.DenseDelta(1, lambda d, t, s: d1, linear=False, replace=True)])
    with torch.no_grad():
        y = module(x)
        full = deltas.apply(module, x, y.clone(), lr.RowStrengths([[1.0, 0.0]] * 3))
        assert torch.equal(full, op(x, w + d0, module.bias))
        mixed = deltas.apply(module, x, y.clone(), lr.RowStrengths([[0.0, 0.0], [2.0, 0.0], [2.0, 1.0]]))
        assert torch.equal(mixed[0], y[0])
        assert torch.equal(mixed[1], op(x[1:], w + 2 * d0, module.bias)[0])  # rows 1-2 in one call
        torch.testing.assert_close(mixed[2], op(x[2:], w + 2 * d0 + d1, module.bias)[0], rtol=1e-5, atol=1e-5)


def test_rows_follow_chunks_and_refuse_a_batch_they_cannot_split(lr):
    lin = torch.nn.Linear(2, 2)
    deltas = lr.ModuleDeltas("linear", (2, 2), [lr.LowRankDelta(0, torch.ones(1, 2), torch.ones(2, 1), 1.0)])
    host = [[1.0], [0.0]]
    with pytest.raises(ValueError, match="batch of 3 rows for 2 cond chunks"):
        deltas.apply(lin, torch.ones(3, 2), lin(torch.ones(3, 2)), lr.RowStrengths(host))


def test_module_kind(lr):
    assert lr.module_kind(torch.nn.Linear(2, 2)) == "linear"
    assert lr.module_kind(torch.nn.Conv2d(2, 2, 1)) == "conv2d"
    assert lr.module_kind(torch.nn.Conv2d(2, 2, 1, padding_mode="reflect")) is None
    assert lr.module_kind(torch.nn.Embedding(2, 2)) is None


def test_tensor_cache_evicts_least_recent_and_stays_in_budget(pack):
    from patchbay.hooks.delta_cache import TensorCache

    cache = TensorCache(budget_bytes=3 * 400)
    made = []

    def make(i):
        made.append(i)
        return torch.zeros(100)  # 400 bytes

    for i in (0, 1, 2, 0, 3):  # 0 is used again, so 1 is the least recent when 3 arrives
        cache.get_or_make(i, lambda i=i: make(i))
    assert made == [0, 1, 2, 3] and 1 not in cache and 0 in cache and cache.bytes == 1200
    cache.get_or_make("big", lambda: torch.zeros(1000))  # larger than the budget: returned, not kept
    assert "big" not in cache and cache.bytes <= cache.budget_bytes
    cache.resize(400)  # keeps the most recent entry only
    assert len(cache) == 1 and 3 in cache and cache.bytes == 400
    with pytest.raises(ValueError, match="budget"):
        TensorCache(-1)


def test_row_strengths_group_consecutive_chunks_with_one_strength(lr):
    rs = lr.RowStrengths([[1.0, 0.0], [1.0, 0.5], [0.0, 0.5], [1.0, 0.25]])
    assert rs.runs == {0: ((0, 2, 1.0), (3, 4, 1.0)), 1: ((1, 3, 0.5), (3, 4, 0.25))}
    assert rs.chunks == 4
    assert lr.RowStrengths([[0.0], [0.0]]).runs == {}


def test_deltas_add_in_place_only_where_it_is_safe(lr):
    g = _gen(4)
    lin = torch.nn.Linear(6, 5)
    x = torch.randn(3, 4, 6, generator=g)
    deltas = lr.ModuleDeltas("linear", (5, 6), [lr.LowRankDelta(0, torch.randn(2, 6, generator=g),
                                                                torch.randn(5, 2, generator=g), 0.5)])
    host = [[0.0], [2.0], [0.0]]
    expected = lin(x).detach()
    expected[1] += 2.0 * 0.5 * F.linear(F.linear(x[1], deltas.low_rank[0].down), deltas.low_rank[0].up)
    with torch.no_grad():
        y = lin(x)
        out = deltas.apply(lin, x, y, lr.RowStrengths(host))
    assert out is y  # sampling: no copy of the output
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    with torch.inference_mode():
        y = lin(x)
    out = deltas.apply(lin, x, y, lr.RowStrengths(host))  # an inference tensor outside inference mode
    assert out is not y
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    y = lin(x)  # autograd history: a copy, and gradients flow through the delta
    out = deltas.apply(lin, x, y, lr.RowStrengths(host))
    assert out is not y and out.requires_grad
    torch.testing.assert_close(out.detach(), expected, rtol=1e-5, atol=1e-5)


def test_linear_delta_on_a_non_contiguous_output(lr):
    g = _gen(5)
    lin = torch.nn.Linear(6, 5)
    x = torch.randn(2, 3, 6, generator=g)
    d = lr.LowRankDelta(0, torch.randn(2, 6, generator=g), torch.randn(5, 2, generator=g), 0.5)
    deltas = lr.ModuleDeltas("linear", (5, 6), [d])
    with torch.no_grad():
        y = lin(x.transpose(0, 1).contiguous()).transpose(0, 1)  # same values, strided
        assert not y.is_contiguous()
        expected = lin(x) + 0.5 * 3.0 * F.linear(F.linear(x, d.down), d.up)
        out = deltas.apply(lin, x, y, lr.RowStrengths([[3.0], [3.0]]))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["linear", "pointwise", "conv3x3"])
def test_token_subset_adds_the_delta_on_its_tokens_only(lr, kind):
    """A per-token weight that is 0 on most tokens (an Attention Couple region): the delta is computed on
    the other tokens only (gathered; a 3x3 convolution falls back to the dense weight), equals the weight
    baked per token there, and leaves every other token of the output bit-identical."""
    g = _gen(6)
    if kind == "linear":
        module, x, w = torch.nn.Linear(6, 5), torch.randn(2, 12, 6, generator=g), torch.zeros(12, 1)
    else:
        k = 1 if kind == "pointwise" else 3
        module = torch.nn.Conv2d(6, 5, k, padding=k // 2)
        x, w = torch.randn(2, 6, 3, 4, generator=g), torch.zeros(3, 4)
    w.view(-1)[[2, 3, 7]] = torch.tensor([0.25, 1.0, 0.5])
    d = lr.LowRankDelta(0, torch.randn(2, *module.weight.shape[1:], generator=g),
                        torch.randn(5, 2, *([1, 1] if kind != "linear" else []), generator=g), 0.5)
    deltas = lr.ModuleDeltas("linear" if kind == "linear" else "conv2d", tuple(module.weight.shape), [d])
    subset = lr.TokenSubset.of(w, x.device, x.dtype, positions=kind != "linear")
    assert isinstance(subset, lr.TokenSubset) and subset.index.tolist() == [2, 3, 7]
    assert not isinstance(lr.TokenSubset.of(w + 1.0, x.device, x.dtype), lr.TokenSubset)  # no 0: dense
    with torch.no_grad():
        plain = module(x)
        out = deltas.apply(module, x, plain.clone(), lr.RowStrengths([[2.0]], lambda h, m, y: subset))
        baked = (d.up.reshape(5, 2) @ d.down.flatten(1)).view(module.weight.shape)  # B @ A
        delta = F.linear(x, baked) if kind == "linear" else F.conv2d(x, baked, padding=module.padding)
    expected = plain + 2.0 * 0.5 * delta * w  # w [12, 1] over tokens, [3, 4] over positions
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    outside = (w == 0).expand_as(out)
    assert torch.equal(out[outside], plain[outside])
