"""T0: merge/grid.py, the Merge Grid's variants: what an axis sets, the cells' order and labels, and the
axes refused before anything merges (the node's merging and sampling: tests/test_t1_merge_grid.py)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.t0


@pytest.fixture(scope="module")
def m():
    from patchbay_merge import grid
    from patchbay_merge import recipe as R

    return type("M", (), {"grid": grid, "R": R})


def two_methods(R, alpha=0.5):
    a, b = R.model("a.safetensors"), R.model("b.safetensors")
    return R.add_difference(R.weighted_sum(a, b, alpha=alpha), R.subtract(b, a), alpha=0.5)


def kwarg(node, method, name):
    """``name`` of the first call of ``method`` under ``node`` (depth first)."""
    if getattr(node, "method", None) == method:
        return dict(node.kwargs)[name]
    for child in getattr(node, "args", ()):
        found = kwarg(child, method, name)
        if found is not None:
            return found
    return None


def test_cells_go_row_by_row_and_set_what_each_axis_names(m):
    R = m.R
    recipe = two_methods(R)
    cells = m.grid.variants(recipe, ("weighted_sum.alpha", [0.2, 0.8]),
                            ("add_difference.alpha", [R.literal({"IN*": 1.0, "default": 0.0}), 1.0]))
    assert [labels for labels, _ in cells] == [
        ("weighted_sum.alpha=0.2", "add_difference.alpha=IN*=1, default=0"),
        ("weighted_sum.alpha=0.8", "add_difference.alpha=IN*=1, default=0"),
        ("weighted_sum.alpha=0.2", "add_difference.alpha=1"),
        ("weighted_sum.alpha=0.8", "add_difference.alpha=1")]
    for (_, variant), (x, y) in zip(cells, [(0.2, "map"), (0.8, "map"), (0.2, 1.0), (0.8, 1.0)],
                                         strict=True):
        assert kwarg(variant, "weighted_sum", "alpha") == R.literal(x)
        y_value = kwarg(variant, "add_difference", "alpha")
        assert y_value.is_map if y == "map" else y_value == R.literal(y)
    assert kwarg(recipe, "weighted_sum", "alpha") == R.literal(0.5), "the recipe itself is not changed"


def test_a_plain_name_sets_the_one_method_that_has_it_and_a_free_parameter_is_bound(m):
    R = m.R
    recipe = R.weighted_sum(R.model("a.safetensors"), R.model("b.safetensors"), alpha=R.param("mix"))
    cells = m.grid.variants(recipe, ("mix", [0.25, 0.75]))
    assert [labels for labels, _ in cells] == [("mix=0.25",), ("mix=0.75",)]
    assert all(not R.params(variant) for _, variant in cells)
    plain = m.grid.variants(R.weighted_sum(R.model("a.safetensors"), R.model("b.safetensors"), alpha=0.5),
                            ("alpha", [0.1]))
    assert kwarg(plain[0][1], "weighted_sum", "alpha") == R.literal(0.1)


@pytest.mark.parametrize(("x", "y", "needle"), [
    (("alpha", [0.1]), None, r"'alpha' is a parameter of 2 methods.*add_difference\.alpha, weighted_sum"),
    (("weighted_sum.alpah", [0.1]), None, r"names no .*did you mean 'weighted_sum\.alpha'"),
    (("", [0.1]), ("weighted_sum.alpha", [0.2]), r"x_param is empty"),
    (("weighted_sum.alpha", []), None, r"'weighted_sum\.alpha' has no values"),
    (("weighted_sum.alpha", [0.1]), ("weighted_sum.alpha", [0.2]), r"x and y both set 'weighted_sum\.alpha'"),
    (("weighted_sum.alpha", [0.1] * 9), ("add_difference.alpha", [0.1] * 8), r"72 variants \(over 64\)"),
])
def test_bad_axes_are_refused_naming_the_fix(m, x, y, needle):
    with pytest.raises(m.grid.GridError, match=needle):
        m.grid.variants(two_methods(m.R), x, y)


def test_more_than_64_variants_when_asked(m):
    cells = m.grid.variants(two_methods(m.R), ("weighted_sum.alpha", [0.1] * 9),
                            ("add_difference.alpha", [0.1] * 8), allow_large=True)
    assert len(cells) == 72


def test_a_weighted_sum_that_gives_back_an_input_has_its_id_and_its_values(m, tmp_path):
    """A block preset is 0 or 1 per block, so weighted_sum(a, weighted_sum(a, b, preset), alpha) is a
    wherever the preset is 0, whatever alpha: those keys' ids (CompiledRecipe.key_id: what the merge cache and
    Merge Grid's kept keys go by) are a's at every alpha, and the merge gives a's values there bit for bit
    (weighted_sum returns a at alpha 0, lerp(a, a, w) is a); a key the preset sets to 1 has one id per
    alpha, and a + alpha * (b - a) as values."""
    import torch
    from patchbay_merge.plan import MergeOptions
    from patchbay_merge.session import MergeSession
    from safetensors.torch import save_file

    R = m.R
    inside = "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight"  # IN01
    outside = "model.diffusion_model.output_blocks.2.0.weight"  # OUT02
    paths = []
    for seed in (1, 2):
        gen = torch.Generator().manual_seed(seed)
        paths.append(tmp_path / f"{seed}.safetensors")
        save_file({inside: torch.randn(8, 768, generator=gen).half(),
                   outside: torch.randn(12, 10, generator=gen).half()}, str(paths[-1]))
    a, b = (R.model(str(p)) for p in paths)
    preset = R.literal({"IN*": 1.0, "default": 0.0})
    ids, values = [], []
    for alpha in (0.3, 0.6):
        recipe = R.weighted_sum(a, R.weighted_sum(a, b, alpha=preset), alpha=alpha)
        with MergeSession(recipe, MergeOptions(dtype="fp32")) as session:
            graph = session.graph
            ids.append({k: graph.key_id(graph.root, k, session.arch) for k in (inside, outside)})
            values.append({k: session.evaluate(k) for k in (inside, outside)})
            leaf = {k: graph.key_id(graph.root.args[0], k, session.arch) for k in (inside, outside)}
            raw = [{k: s.tensor(k).float() for k in (inside, outside)} for s in session.sources]
        assert ids[-1][outside] == leaf[outside], "a preset's 0 block is not a's id"
        assert torch.equal(values[-1][outside], raw[0][outside])
        assert torch.allclose(values[-1][inside], raw[0][inside] + alpha * (raw[1][inside] - raw[0][inside]),
                              atol=1e-6)
    assert ids[0][outside] == ids[1][outside] and ids[0][inside] != ids[1][inside]
    with MergeSession(R.weighted_sum(a, b, alpha=1.0), MergeOptions(dtype="fp32")) as session:
        graph = session.graph
        assert graph.key_id(graph.root, inside, session.arch) == graph.key_id(graph.root.args[1], inside,
                                                                              session.arch)


def test_a_declared_passes_input_decides_the_id_not_the_method_name(m, tmp_path):
    """CompiledRecipe.key_id asks the method's ``passes_input`` declaration (merge/method_registry.py),
    not its name: a
    throwaway method that declares "b at t=1" gets b's id there and its own elsewhere, an undeclared twin
    never passes; weighted_sum's ids and values agree at an alpha within is_close of 1 (both use its one
    declaration), and a declaration that is not a function is refused at registration."""
    import torch
    from patchbay_merge import method_registry as registry
    from patchbay_merge.plan import MergeOptions
    from patchbay_merge.session import MergeSession
    from safetensors.torch import save_file

    key = "model.diffusion_model.output_blocks.2.0.weight"
    paths = []
    for seed in (1, 2):
        paths.append(tmp_path / f"{seed}.safetensors")
        save_file({key: torch.randn(6, 4, generator=torch.Generator().manual_seed(seed))}, str(paths[-1]))
    a, b = (m.R.model(str(p)) for p in paths)

    def blend(x, y, *, t=0.5):
        """x moved toward y by t."""
        return x + t * (y - x)

    blend.__annotations__ = {"x": registry.AnySpace, "y": registry.AnySpace, "t": float,
                             "return": registry.AnySpace}  # set here: this module postpones annotations

    def ids(method: str, t: float) -> tuple:
        with MergeSession(m.R.call(method, a, b, t=t), MergeOptions(dtype="fp32")) as session:
            graph = session.graph
            return tuple(graph.key_id(step, key, session.arch) for step in (graph.root, *graph.root.args))

    with registry.scope():
        registry.merge_method(blend, name="blend_declared",
                              passes_input=lambda params, same: 1 if params["t"] == 1 else None)
        registry.merge_method(blend, name="blend_plain")
        root, _, b_id = ids("blend_declared", 1.0)
        assert root == b_id
        root, a_id, b_id = ids("blend_declared", 0.5)
        assert root not in (a_id, b_id)
        root, _, b_id = ids("blend_plain", 1.0)
        assert root != b_id
        with pytest.raises(registry.MethodDefinitionError, match="passes_input"):
            registry.merge_method(blend, name="blend_bad", passes_input=1)
    alpha = 1.0 - 1e-12  # is_close to 1: weighted_sum returns b itself, and its id is b's
    with MergeSession(m.R.weighted_sum(a, b, alpha=alpha), MergeOptions(dtype="fp32")) as session:
        graph = session.graph
        root, b_id = (graph.key_id(step, key, session.arch) for step in (graph.root, graph.root.args[1]))
        assert root == b_id
        assert torch.equal(session.evaluate(key), session.sources[1].tensor(key).float())


def test_cache_wants_names_what_a_later_variant_merges(m):
    """Each variant should leave in the merge cache only the results a later variant merges: a variant that
    fills the previous one's model merges the keys whose id changed, one that builds a new model all."""
    ids = [{"k1": "A1", "k2": "B1"}, {"k1": "A1", "k2": "B2"}, {"k1": "A3", "k2": "B1"}]
    wants = m.grid.cache_wants(ids, [False, True, True])
    assert wants == [{"B2", "A3", "B1"}, {"A3", "B1"}, set()]
    assert "A1" not in wants[0], "k1 keeps A1 in the model for the second variant: no copy is needed"
    assert m.grid.cache_wants(ids, [False, False, False])[0] == {"A1", "B2", "A3", "B1"}
