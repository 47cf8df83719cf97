"""T0: the recipe graph (immutability, builders, checks with paths, bind) and the method registry."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.t0


@pytest.fixture(scope="module")
def R():
    from patchbay_merge import recipe

    return recipe


@pytest.fixture(scope="module")
def reg():
    from patchbay_merge import method_registry as registry

    return registry


# ---- graph ---------------------------------------------------------------------------------------

def test_builders_make_frozen_hashable_nodes_with_defaults(R):
    a, b = R.model("a.safetensors"), R.model("b.safetensors")
    r = R.weighted_sum(a, b, alpha=0.3)
    assert r == R.call("weighted_sum", a, b, alpha=0.3) == R.weighted_sum(a, b, 0.3)
    assert hash(r) == hash(R.weighted_sum(R.model("a.safetensors"), R.model("b.safetensors"), alpha=0.3))
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.method = "slerp"
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.path = "c"
    assert isinstance(r.args, tuple) and isinstance(r.kwargs, tuple)
    assert R.weighted_sum(a, b).kwarg("alpha") == R.LiteralNode(0.5)  # default filled in
    assert dict(R.ties_sum(R.subtract(a, b), k=0.5).kwargs) == {
        "k": R.LiteralNode(0.5), "vote_sgn": R.LiteralNode(False)}


def test_literal_maps_are_frozen_and_resolve_per_key(R):
    lit = R.literal({"IN00": 0.1, "*.attn2.*": 0.7, "default": 0.5})
    assert isinstance(lit.value, tuple) and hash(lit)
    assert lit.mapping == {"IN00": 0.1, "*.attn2.*": 0.7, "default": 0.5}
    assert lit.scalar_for("sd15", "model.diffusion_model.input_blocks.0.0.weight") == 0.1
    attn2 = "model.diffusion_model.output_blocks.3.1.transformer_blocks.0.attn2.to_k.weight"
    assert lit.scalar_for("sd15", attn2) == 0.7
    assert lit.scalar_for("sd15", "model.diffusion_model.middle_block.0.in_layers.0.weight") == 0.5
    assert R.literal(0.25).scalar_for("sd15", "anything") == 0.25
    with pytest.raises(R.RecipeError, match="map key"):
        R.literal({"bad key": 1.0})
    with pytest.raises(R.RecipeError, match="not a scalar"):
        R.literal({"IN00": [1.0]})


def test_call_checks_name_params_types_and_spaces_with_paths(R):
    a, b = R.model("a"), R.model("b")
    with pytest.raises(R.RecipeError, match=r"did you mean 'weighted_sum'"):
        R.call("wieghted_sum", a, b)
    with pytest.raises(AttributeError, match=r"did you mean 'weighted_sum'"):
        R.wieghted_sum  # noqa: B018
    with pytest.raises(R.RecipeError, match=r"^weighted_sum.alpah: .*did you mean 'alpha'"):
        R.weighted_sum(a, b, alpah=0.3)
    with pytest.raises(R.RecipeError, match=r"weighted_sum.alpha: 'x' is not a float"):
        R.weighted_sum(a, b, alpha="x")
    with pytest.raises(R.RecipeError, match=r"entry 'IN00'"):
        R.weighted_sum(a, b, alpha={"IN00": True})
    with pytest.raises(R.RecipeError, match=r"^add_difference.b: expects a delta-space input, got weight "
                                            r"\(model 'b'\) \(a LoRA .*: write merge_space=\"delta\" on its"):
        R.add_difference(a, b)
    with pytest.raises(R.RecipeError, match="takes 2 tensor inputs, got 1"):
        R.weighted_sum(a)
    with pytest.raises(R.RecipeError, match=r"wrap a file path in model"):
        R.weighted_sum("a.safetensors", b)
    with pytest.raises(R.RecipeError, match="other inputs are in weight space"):
        R.weighted_sum(a, R.subtract(a, b))


def test_node_values_in_messages_are_named_as_nodes_never_by_their_repr(R):
    a, b = R.model("a"), R.model("b")
    cases = [(lambda: R.param(a), "parameter name model 'a' must be an identifier"),
             (lambda: R.free_input(R.param("x")), "input name param 'x' must be an identifier"),
             (lambda: R.weighted_sum(a, R.param("x")), "expects a tensor recipe (model, method call or free "
                                                       "input), got param 'x'"),
             (lambda: R.literal(R.weighted_sum(a, b)), "not a weighted_sum call"),
             (lambda: R.literal({"IN00": a}), "map entry 'IN00': model 'a' is not a scalar"),
             (lambda: R.model("a", config=5), "model 'a': model_config 5 is not a config name")]
    for make, message in cases:
        with pytest.raises(R.RecipeError) as info:
            make()
        assert message in str(info.value)
        assert "Node(" not in str(info.value)


def test_nested_errors_carry_the_path_through_the_graph(R):
    a, b = R.model("a"), R.model("b")
    bad = R.CallNode("add_difference", (a, R.CallNode("weighted_sum", (a, b), {"alpha": R.LiteralNode(0.5)})),
                     {"alpha": R.LiteralNode(1.0)})
    root = R.CallNode("slerp", (bad, b), {"alpha": R.LiteralNode(0.5)})
    with pytest.raises(R.RecipeError) as info:
        R.validate(root)
    assert info.value.path == ("slerp.a", "add_difference.b")
    assert str(info.value).startswith("slerp.a > add_difference.b: expects a delta-space input")
    with pytest.raises(R.RecipeError, match=r"^slerp.alpha: unknown merge method 'no_such'"):
        R.validate(R.CallNode("slerp", (a, b), {"alpha": R.CallNode("no_such", (a,))}))


def test_param_space_call_as_a_float_parameter(R):
    a, b, c = R.model("a"), R.model("b"), R.model("c")
    r = R.add_difference(a, R.subtract(b, c), alpha=R.train_difference_mask(a, b, c))
    R.validate(r)
    with pytest.raises(R.RecipeError, match="only a float parameter takes a method call"):
        R.add_difference(a, R.subtract(b, c), alpha=R.subtract(b, c))


def test_free_inputs_params_and_walk(R):
    r = R.add_difference(R.free_input("base"), R.subtract(R.model("b"), R.free_input("base")),
                         alpha=R.param("strength"))
    assert R.free_inputs(r) == ("base",) and R.params(r) == ("strength",)
    paths = [p for p, _ in R.walk(r)]
    assert () in paths and ("add_difference.b", "subtract.a") in paths
    assert R.output_space(r) == "any" and R.output_space(R.subtract(R.model("a"), R.model("b"))) == "delta"


# ---- bind ----------------------------------------------------------------------------------------

def _two_recipes(R):
    inner = R.add_difference(R.model("a"), R.subtract(R.model("b"), R.model("c")), alpha=R.param("alpha"))
    outer = R.weighted_sum(R.free_input("x"), R.model("d"), alpha=R.param("alpha"))
    return inner, outer


def test_bind_plugs_recipes_and_values(R):
    inner, outer = _two_recipes(R)
    bound = R.bind(outer, inputs={"x": inner}, shared={"alpha"}, params={"alpha": 0.4})
    assert R.free_inputs(bound) == () and R.params(bound) == ()
    assert bound.args[0].kwarg("alpha") == bound.kwarg("alpha") == R.LiteralNode(0.4)
    assert R.bind(outer, inputs={"x": inner}, shared={"alpha": 0.4}) == bound
    assert outer.args[0] == R.free_input("x")  # the original is untouched
    partial = R.bind(outer, params={"alpha": 0.2})
    assert R.free_inputs(partial) == ("x",) and R.params(partial) == ()


def test_bind_refuses_a_parameter_used_by_two_recipes_unless_shared(R):
    inner, outer = _two_recipes(R)
    with pytest.raises(R.RecipeError, match=r"parameter 'alpha' is used by both the recipe and the recipe "
                                            r"bound to 'x'; pass shared=\{'alpha'\}"):
        R.bind(outer, inputs={"x": inner})


def test_bind_names_unknown_inputs_and_params(R):
    inner, outer = _two_recipes(R)
    with pytest.raises(R.RecipeError, match=r"no open input 'y'.*open inputs: x"):
        R.bind(outer, inputs={"y": inner})
    with pytest.raises(R.RecipeError, match=r"no open parameter 'alpah' \(did you mean 'alpha'\?\)"):
        R.bind(outer, params={"alpah": 0.5})
    with pytest.raises(R.RecipeError, match=r"weighted_sum.alpha: 'high' is not a float"):
        R.bind(outer, params={"alpha": "high"})
    with pytest.raises(R.RecipeError, match="expects a tensor recipe"):
        R.bind(outer, inputs={"x": 0.5})


def test_bind_checks_spaces_of_plugged_recipes(R):
    needs_delta = R.add_difference(R.model("a"), R.free_input("d"))
    with pytest.raises(R.RecipeError, match=r"add_difference.b: expects a delta-space input, got weight"):
        R.bind(needs_delta, inputs={"d": R.model("b")})
    bound = R.bind(needs_delta, inputs={"d": R.subtract(R.model("b"), R.model("c"))})
    assert bound.args[1].method == "subtract"


# ---- registry ------------------------------------------------------------------------------------

def test_methods_expose_their_specs(reg):
    ws = reg.get("weighted_sum")
    assert (ws.name, ws.output, ws.paper.startswith("https://")) == ("weighted_sum", "any", True)
    assert [(i.name, i.space, i.variadic) for i in ws.inputs] == [("a", "any", False), ("b", "any", False)]
    assert [(p.name, p.type, p.default) for p in ws.params] == [("alpha", float, 0.5)]
    assert ws.doc and "\n" not in ws.doc
    ties = reg.get("ties_sum")
    assert ties.variadic and ties.inputs[0].space == "delta" and ties.output == "delta"
    assert reg.get("ties_sum_with_dropout").param("seed").optional
    names = [m.name for m in reg.all_methods()]
    assert names == sorted(names) and len(names) >= 24


def test_registry_get_suggests(reg):
    with pytest.raises(reg.UnknownMethodError, match=r"did you mean 'slerp'"):
        reg.get("slepr")


def _define(reg, source: str, **options):
    namespace = {"reg": reg, "Weight": reg.Weight, "Delta": reg.Delta}
    exec(f"from __future__ import annotations\n{source}", namespace)  # noqa: S102
    return reg.merge_method(namespace["f"], **options)


def test_scope_undoes_registrations(reg):
    with reg.scope():
        _define(reg, "def f(a: Weight, *, factor: float = 2.0) -> Weight:\n '''Scale.'''\n return a * factor",
                name="double")
        assert reg.get("double").fn(torch.ones(2), factor=3.0, ctx=None).tolist() == [3.0, 3.0]
    with pytest.raises(reg.UnknownMethodError):
        reg.get("double")


def test_duplicates_are_refused(reg):
    with reg.scope(), pytest.raises(reg.MethodDefinitionError, match="already registered"):
        _define(reg, "def f(a: Weight) -> Weight:\n '''Nothing.'''\n return a", name="weighted_sum")


@pytest.mark.parametrize(("source", "fragment"), [
    ("def f(a: int) -> Weight:\n '''d'''", "must be annotated Weight, Delta"),
    ("def f(a: Weight, *, s: float) -> Weight:\n '''d'''", "needs a default value"),
    ("def f(a: Weight, *, s: list = 1) -> Weight:\n '''d'''", "must be annotated float, int, bool or str"),
    ("def f(a: Weight, *, s: int = 0.5) -> Weight:\n '''d'''", "default 0.5 of 's' is not a int"),
    ("def f(a: Weight):\n '''d'''", "annotate the return"),
    ("def f(a: Weight, **kw) -> Weight:\n '''d'''", "**kw is not allowed"),
    ("def f(*, s: float = 1.0) -> Weight:\n '''d'''", "at least one tensor input"),
    ("def f(a: Weight) -> Weight:\n pass", "give it a docstring"),
    ("def f(a: Weight, b: Weight = None) -> Weight:\n '''d'''", "cannot have a default"),
    ("def f(a: Weight) -> reg.AnySpace:\n '''d'''", "no AnySpace input"),
])
def test_bad_definitions_are_refused_at_registration(reg, source, fragment):
    with reg.scope(), pytest.raises(reg.MethodDefinitionError, match=fragment.replace("*", r"\*")):
        _define(reg, source)


def test_random_methods_are_declared_and_a_random_one_cannot_be_elementwise(reg):
    assert {m.name for m in reg.all_methods() if m.random} == {"dropout", "ties_sum_with_dropout",
                                                               "truncate_rank", "truncate_kronecker",
                                                               "della", "della_linear"}
    with reg.scope(), pytest.raises(reg.MethodDefinitionError, match="a random method cannot be elementwise"):
        _define(reg, "def f(a: Weight) -> Weight:\n 'd'\n return a", random=True, elementwise=True)


def test_fn_always_accepts_ctx(reg):
    from patchbay_merge.context import KeyContext

    assert torch.equal(reg.get("subtract").fn(torch.ones(2), torch.ones(2), ctx=KeyContext()), torch.zeros(2))


# ---- blocks --------------------------------------------------------------------------------------

@pytest.mark.parametrize(("arch", "key", "block"), [
    ("sd15", "model.diffusion_model.input_blocks.11.0.out_layers.3.weight", "IN11"),
    ("sd15", "model.diffusion_model.middle_block.1.proj_in.weight", "M00"),
    ("sd15", "model.diffusion_model.output_blocks.0.0.skip_connection.bias", "OUT00"),
    ("sd15", "model.diffusion_model.out.2.weight", "OUT11"),
    ("sd15", "model.diffusion_model.time_embed.0.weight", "BASE"),
    ("sd15", "cond_stage_model.transformer.text_model.embeddings.position_ids", "BASE"),
    ("sd15", "first_stage_model.decoder.conv_in.weight", "BASE"),
    ("sdxl", "model.diffusion_model.label_emb.0.0.weight", "BASE"),
    ("sdxl", "model.diffusion_model.input_blocks.8.0.in_layers.2.weight", "IN08"),
    ("sdxl", "model.diffusion_model.out.0.bias", "OUT08"),
    ("sdxl", "first_stage_model.encoder.conv_in.weight", "VAE"),
    ("sdxl", "conditioner.embedders.1.model.ln_final.weight", "BASE"),
    ("flux", "model.diffusion_model.double_blocks.18.img_attn.qkv.weight", "double_blocks.18"),
    ("flux", "single_blocks.37.linear1.weight", "single_blocks.37"),
    ("flux", "model.diffusion_model.img_in.weight", "img_in"),
    ("flux", "final_layer.linear.bias", "final_layer"),
    ("flux", "text_encoders.t5xxl.transformer.shared.weight", "BASE"),
    ("flux", "vae.decoder.conv_in.weight", "VAE"),
    ("unknown", "model.diffusion_model.input_blocks.0.0.weight", None),
])
def test_block_of(arch, key, block):
    from patchbay_merge import blocks

    assert blocks.block_of(arch, key) == block
    if block is not None:
        assert block in blocks.block_names(arch)


def test_block_counts_and_components():
    from patchbay_merge import blocks

    assert len(blocks.block_names("sd15")) == 26
    assert len([b for b in blocks.block_names("sdxl") if b != "VAE"]) == 20
    assert blocks.component_of("sdxl", "conditioner.embedders.1.model.ln_final.weight") == "clip_g"
    assert blocks.component_of("sd15", "alphas_cumprod") == "scheduler"
    assert blocks.component_of("flux", "double_blocks.0.img_mod.lin.weight") == "diffuser"
    with pytest.raises(KeyError, match="add it or a 'default' entry"):
        blocks.resolve({"IN00": 1.0}, "sd15", "model.diffusion_model.out.2.weight")


@pytest.mark.parametrize("doc", ["docs/merge-methods.md", "README.md"])
def test_methods_table_lists_every_method_with_a_link(reg, doc):
    from pathlib import Path

    table = (Path(__file__).resolve().parent.parent / doc).read_text()
    names = {m.name for m in reg.all_methods()}
    rows = {line.split("`")[1]: line for line in table.splitlines()
            if line.startswith("| `") and line.split("`")[1] in names}
    assert set(rows) == names
    assert all("](http" in row for row in rows.values())


def test_deep_recipes_with_shared_parts_stay_fast(R):
    """Hash, equality, checks, bind and text are linear in a DAG whose parts are shared (not 2**depth)."""
    import time

    from patchbay_merge import mecha_text

    def chain(depth):
        x, y = R.model("a"), R.model("b")
        for _ in range(depth):
            x = R.weighted_sum(x, R.slerp(x, y))
        return x

    start = time.perf_counter()
    x = chain(60)
    R.validate(x)
    assert mecha_text.parse(mecha_text.dumps(x)) == x == chain(60) and hash(x) == hash(chain(60))
    assert R.bind(R.weighted_sum(R.free_input("q"), R.model("b")), inputs={"q": x}).args[0] == x
    assert x != R.weighted_sum(x.args[0], R.slerp(x.args[0], R.model("c")))
    assert time.perf_counter() - start < 5


def test_check_map_refuses_entries_that_match_nothing():
    from patchbay_merge import blocks

    entries = {"IN00": 1, "*.attn2.*": 0.5, "default": 0, "model.diffusion_model.out.2.weight": 1}
    blocks.check_map(entries, "sd15")
    blocks.check_map({"double_blocks.3": 1.0}, "flux")
    with pytest.raises(ValueError, match=r"'IN0' is no block of sd15.*did you mean 'IN"):
        blocks.check_map({"IN0": 1.0}, "sd15")
    with pytest.raises(ValueError, match="no key and no glob"):
        blocks.check_map({"model.x": 1.0}, "sd15", keys={"model.y"})
