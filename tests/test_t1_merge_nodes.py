"""T1: the merge nodes as ComfyUI loads them, without running a merge: one node per registered method
(typed widgets, ranges, variadic sockets, doc and help page), inputs, parameter maps, recipe text in
and out, and every bad path or recipe refused with a message naming it and the fix (issue 16, items 1,
7 and "Bad input")."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.t1

CKPT_A, CKPT_B = "patchbay-sd15-tiny-a.safetensors", "patchbay-sd15-tiny-b.safetensors"


@pytest.fixture(scope="module")
def pack(comfy):
    return comfy.pack


@pytest.fixture(scope="module")
def node(pack):
    def make(node_id: str):
        return pack.NODE_CLASS_MAPPINGS[node_id]()

    return make


def ckpt(node, name: str):
    return node("PatchbayMergeCheckpoint").make(ckpt_name=name)[0]


def test_every_registered_method_is_a_node_with_typed_inputs_defaults_ranges_and_its_doc(pack):
    registry = pack.merge.method_registry
    methods = registry.all_methods()
    assert len(methods) >= 29
    for method in methods:
        cls = pack.NODE_CLASS_MAPPINGS[pack.nodes.merge_methods.node_id(method)]
        assert method.doc == cls.DESCRIPTION and cls.CATEGORY == "Patchbay/merge/methods"
        types = cls.INPUT_TYPES()
        required, optional = types["required"], types.get("optional", {})  # V3 leaves out an empty one
        for spec in method.inputs:
            if spec.variadic:
                assert required[f"{spec.name}_1"][0] == "PATCHBAY_RECIPE"
                slots = [k for k in optional if k.removeprefix(f"{spec.name}_").isdigit()]
                assert len(slots) >= 8, method.name
            else:
                assert required[spec.name][0] == "PATCHBAY_RECIPE"
        for spec in method.params:
            kind, options = required[spec.name]
            expected = {bool: "BOOLEAN", int: "INT", float: "FLOAT", str: "STRING"}[spec.type]
            assert kind == expected or (spec.optional and kind in ("INT", "STRING")), (method.name, spec.name)
            if spec.default is not None and kind != "STRING":
                assert options["default"] == spec.default
            if spec.range is not None and kind in ("INT", "FLOAT"):
                assert options["min"] == spec.range.low
                assert options["max"] == spec.range.high or not math.isfinite(spec.range.high)
            if spec.type in (float, int):
                assert optional[f"{spec.name}_map"][0] == "PATCHBAY_RECIPE"
            if kind == "INT":  # a "seed" would get a randomising control widget: every queue a new merge
                assert options["control_after_generate"] is False


def test_the_method_help_pages_are_generated_from_the_registry(pack):
    import build_merge_docs

    for method in pack.merge.method_registry.all_methods():
        node_id = pack.nodes.merge_methods.node_id(method)
        assert build_merge_docs.node_id(method.name) == node_id
        text = build_merge_docs.help_page(node_id).read_text()
        assert text == build_merge_docs.page(method), f"run devtools/build_merge_docs.py ({node_id})"
        assert method.doc in text and (method.paper is None or method.paper in text)


def test_a_method_added_to_the_registry_becomes_a_node_with_no_node_code(pack):
    registry, methods = pack.merge.method_registry, pack.nodes.merge_methods
    with registry.scope():
        def blend3(a, b, *more, alpha: float = 0.25, steps: int = 2):
            """Blends any number of models (a test method)."""
            return a

        blend3.__annotations__ = {"a": registry.Weight, "b": registry.Weight, "more": registry.Weight,
                                  "alpha": registry.Fraction, "steps": int, "return": registry.Weight}
        registry.merge_method(blend3)
        cls = methods.method_node(registry.get("blend3"))
        assert cls.NODE_ID == "PatchbayMethodBlend3"
        assert cls.DESCRIPTION == "Blends any number of models (a test method)."
        types = cls.INPUT_TYPES()
        assert types["required"]["alpha"][1]["min"] == 0.0 and types["required"]["alpha"][1]["max"] == 1.0
        a, b, c = (pack.merge.recipe.model(f"checkpoints/{n}.safetensors") for n in "abc")
        (recipe,) = cls().build(a=a, b=b, more_1=c, more_4=None, alpha=0.5, steps=3)
        assert recipe == pack.merge.recipe.call("blend3", a, b, c, alpha=0.5, steps=3)


def test_method_nodes_take_maps_and_param_space_recipes_and_refuse_models_for_parameters(node, pack):
    a, b = ckpt(node, CKPT_A), ckpt(node, CKPT_B)
    R = pack.merge.recipe
    (blocks,) = node("PatchbayMergeBlockWeightsSD15").make(**{w: 0.25 for w, _ in
                                                              pack.nodes.merge_inputs.PatchbayMergeBlockWeightsSD15.widgets()})
    (mask,) = node("PatchbayMethodTrainDifferenceMask").build(a=a, b=b, c=a, alpha=1.0)
    (by_blocks,) = node("PatchbayMethodWeightedSum").build(a=a, b=b, alpha=0.5, alpha_map=blocks)
    assert by_blocks.kwarg("alpha") == blocks and blocks.mapping["IN05"] == 0.25
    (by_mask,) = node("PatchbayMethodAddDifference").build(
        a=a, b=node("PatchbayMethodSubtract").build(a=b, b=a)[0], alpha=1.0, alpha_map=mask)
    assert by_mask.kwarg("alpha") == mask
    with pytest.raises(ValueError, match="alpha_map takes a parameter map .* not a model"):
        node("PatchbayMethodWeightedSum").build(a=a, b=b, alpha=0.5, alpha_map=b)
    widgets = {"probability": 0.5, "della_eps": 0.0, "rescale": True, "k": 0.2, "vote_sgn": False,
               "apply_stock": False, "cos_eps": 1e-6, "apply_median": False, "eps": 1e-6, "maxiter": 100,
               "ftol": 1e-20, "seed": -1}
    (ties,) = node("PatchbayMethodTiesSumWithDropout").build(deltas_1=R.model("loras/x.safetensors", "delta"),
                                                             **widgets)
    assert ties.kwarg("seed").value is None and ties.kwarg("probability").value == 0.5
    delta = node("PatchbayMethodSubtract").build(a=b, b=a)[0]  # one int per key into an int parameter
    (rank,) = node("PatchbayMethodGetRankFromRatio").build(a=delta, ratio=0.25)
    (truncated,) = node("PatchbayMethodTruncateRank").build(
        a=delta, rank=8, rank_map=rank, use_approximate_basis=True, approximate_basis_iters=2,
        approximate_basis_seed=-1)
    assert truncated.kwarg("rank") == rank
    with pytest.raises(pack.merge.recipe.RecipeError, match="gives one int per key, not a tensor"):
        node("PatchbayMethodScale").build(a=rank, alpha=1.0)


def test_block_weight_nodes_have_one_widget_per_block_and_make_complete_maps(pack, node):
    blocks = pack.merge.blocks
    for node_id, arch, count in (("PatchbayMergeBlockWeightsSD15", "sd15", 26),
                                 ("PatchbayMergeBlockWeightsSDXL", "sdxl", 20),
                                 ("PatchbayMergeBlockWeightsFlux", "flux", 64)):
        cls = pack.NODE_CLASS_MAPPINGS[node_id]
        widgets = cls.INPUT_TYPES()["required"]
        assert len(widgets) == count, node_id
        values = {name: i / 100 for i, name in enumerate(widgets)}
        (literal,) = node(node_id).make(**values)
        assert set(literal.mapping) == set(blocks.block_names(arch))
        blocks.check_map(literal.mapping, arch)
        if arch == "flux":
            assert literal.mapping["double_blocks.3"] == values["double_blocks_3"]
        if "VAE" in literal.mapping:
            assert literal.mapping["VAE"] == literal.mapping["BASE"]


def test_key_patterns_read_json_and_items_and_name_every_bad_entry(node, pack):
    patterns = node("PatchbayMergeKeyPatterns")
    (json_map,) = patterns.make('{"IN00": 0.2, "*.attn2.*": 0.8, "default": 0.5}', "sd15")
    (items,) = patterns.make("IN00=0.2, *.attn2.*=0.8\ndefault=0.5", "at merge time")
    assert json_map == items and json_map.mapping["*.attn2.*"] == 0.8
    cls = pack.NODE_CLASS_MAPPINGS["PatchbayMergeKeyPatterns"]
    with pytest.raises(ValueError, match="entry 'IN01' has 'x', not a number"):
        patterns.make('{"IN01": "x"}', "sd15")
    with pytest.raises(ValueError, match="'IN0' is no block of sd15.*did you mean 'IN00'"):
        patterns.make("IN0=0.2, default=1", "sd15")
    assert "IN0=" in cls.VALIDATE_INPUTS("IN0=zero", "sd15") and "line 1, column 1" in cls.VALIDATE_INPUTS(
        "IN0=zero", "sd15")
    assert cls.VALIDATE_INPUTS("OUT05=0.5, default=1", "sdxl") is True
    assert "check_blocks 'sd4'" in cls.VALIDATE_INPUTS("OUT05=0.5", "sd4")  # ComfyUI skips the combo check
    # every family of the architecture table, ranges written out, block globs, counts from the file later
    assert cls.INPUT_TYPES()["required"]["check_blocks"][1]["options"] == ["at merge time",  # a V3 combo
                                                                          *pack.merge.blocks.ARCHS]
    (ranged,) = patterns.make("double_blocks.0-7=0.5\nsingle_blocks.*=1, default=0", "flux2")
    assert list(ranged.mapping)[:2] == ["double_blocks.0", "double_blocks.1"] and len(ranged.mapping) == 10
    assert "'singel_blocks.3' is no block of flux2" in cls.VALIDATE_INPUTS("singel_blocks.3=0", "flux2")
    assert "'OUT05' is no block of sd3" in cls.VALIDATE_INPUTS("OUT05=0.5", "sd3")


@pytest.fixture
def recipes_folder(comfy, tmp_path):
    folder = tmp_path / "recipes"
    folder.mkdir()
    comfy.folder_paths.add_model_folder_path("recipes", str(folder))
    yield folder
    comfy.folder_paths.folder_names_and_paths["recipes"][0].remove(str(folder))


def test_recipe_text_reads_the_textbox_or_a_recipes_file_and_binds_open_inputs_and_params(node, pack,
                                                                                         recipes_folder):
    R = pack.merge.recipe
    text = ('version 0.1.0\ninput "first"\nmodel "patchbay-sd15-tiny-b.safetensors"\nparam "alpha"\n'
            'merge "weighted_sum" &0 &1 alpha=&2')
    (recipes_folder / "mine.mecha").write_text(text)
    listed = pack.NODE_CLASS_MAPPINGS["PatchbayMergeRecipeText"].INPUT_TYPES()["required"]["recipe_file"]
    listed = listed[1]["options"]  # a V3 combo
    assert "mine.mecha" in listed  # listed without a restart
    a = ckpt(node, CKPT_A)
    (from_file,) = node("PatchbayMergeRecipeText").make("", "mine.mecha", "alpha=0.3", input_1=a)
    expected = R.weighted_sum(a, R.model("patchbay-sd15-tiny-b.safetensors"), alpha=0.3)
    assert from_file == expected
    (from_box,) = node("PatchbayMergeRecipeText").make(text, "(textbox)", "alpha=0.3  # a comment", input_1=a)
    assert from_box == expected
    with pytest.raises(ValueError, match="open input 'first' is not bound: connect a recipe to input_1"):
        node("PatchbayMergeRecipeText").make(text, "(textbox)", "alpha=0.3")
    with pytest.raises(ValueError, match="parameter 'alpha' is not bound: add a line alpha=<value>"):
        node("PatchbayMergeRecipeText").make(text, "(textbox)", "", input_1=a)
    with pytest.raises(ValueError, match="input_2 is connected but the recipe has 1 open input"):
        node("PatchbayMergeRecipeText").make(text, "(textbox)", "alpha=1", input_1=a, input_2=a)
    (recipes_folder / "binary.mecha").write_bytes(b"\x80\x04\x95 not text")
    with pytest.raises(ValueError, match="recipe file 'binary.mecha' .*not a text file"):
        node("PatchbayMergeRecipeText").make("", "binary.mecha", "")


def test_recipe_text_errors_name_the_line_the_method_or_the_parameter(node, pack):
    cls = pack.NODE_CLASS_MAPPINGS["PatchbayMergeRecipeText"]
    head = f'version 0.1.0\nmodel "{CKPT_A}"\nmodel "{CKPT_B}"\n'
    assert "line 4, column" in cls.VALIDATE_INPUTS(head + 'merge "weighted_sum" &0 &1 alpha=', "(textbox)")
    with pytest.raises(ValueError, match="unknown merge method 'weighted_summ'.*did you mean 'weighted_sum'"):
        node("PatchbayMergeRecipeText").make(head + 'merge "weighted_summ" &0 &1', "(textbox)", "")
    with pytest.raises(ValueError, match="no parameter 'alpah'.*did you mean 'alpha'"):
        node("PatchbayMergeRecipeText").make(head + 'merge "weighted_sum" &0 &1 alpah=0.5', "(textbox)", "")
    with pytest.raises(ValueError, match="'checkpoints/nope.safetensors'.*no checkpoint named 'nope.saf"):
        node("PatchbayMergeRecipeText").make(
            'version 0.1.0\nmodel "checkpoints/nope.safetensors"\nmodel "a"\nmerge "weighted_sum" &0 &1',
            "(textbox)", "")


def test_recipe_to_text_prints_what_recipe_text_reads_back(comfy, node, pack):
    a, b = ckpt(node, CKPT_A), ckpt(node, CKPT_B)
    (blocks,) = node("PatchbayMergeKeyPatterns").make("IN01=0.2, OUT*=0.7, default=0.5", "sd15")
    (recipe,) = node("PatchbayMethodWeightedSum").build(a=a, b=b, alpha=0.5, alpha_map=blocks)
    for form in ("sd-mecha", "compact"):
        out = node("PatchbayMergeRecipeToText").show(recipe, form)
        (text,) = out["result"]
        assert out["ui"]["text"] == [text] and 'merge "weighted_sum"' in text
        (again,) = node("PatchbayMergeRecipeText").make(text, "(textbox)", "")
        dumps = pack.merge.mecha_text.dumps
        assert dumps(again, arch="sd15") == dumps(recipe, arch="sd15")
    loaded, _, _ = comfy.nodes.CheckpointLoaderSimple().load_checkpoint(CKPT_A)
    (graph_input,) = node("PatchbayMergeModelInput").make(loaded)
    (with_graph,) = node("PatchbayMethodWeightedSum").build(a=graph_input, b=b, alpha=0.5)
    (text,) = node("PatchbayMergeRecipeToText").show(with_graph, "compact")["result"]
    assert f'# {graph_input.path} is a MODEL of the ComfyUI graph' in text
    assert node("PatchbayMergeModelInput").make(loaded)[0].path == graph_input.path  # one token per model


def test_a_graph_model_named_in_a_recipe_text_is_refused_with_the_fix(comfy, node):
    """Issue 32 item 4: only a recipe built in the graph holds a graph MODEL (no registry decodes its
    name): the text Recipe to Text prints for one, read back, is refused before any merge, saying what
    to do."""
    loaded, _, _ = comfy.nodes.CheckpointLoaderSimple().load_checkpoint(CKPT_A)
    (graph_input,) = node("PatchbayMergeModelInput").make(loaded)
    (with_graph,) = node("PatchbayMethodWeightedSum").build(a=graph_input, b=ckpt(node, CKPT_B), alpha=0.5)
    (text,) = node("PatchbayMergeRecipeToText").show(with_graph, "sd-mecha")["result"]
    assert f'model "{graph_input.path}"' in text
    refused = (r"recipe input 'graph:model-[0-9a-f]{12}': no MODEL of this graph has that name .*connect the "
               r"model to a Merge Model Input node, or save it and use checkpoints/<name>")
    with pytest.raises(ValueError, match=refused):
        node("PatchbayMergeRecipeText").make(text, "(textbox)", "")


@pytest.mark.parametrize(("path", "message"), [
    ("/etc/passwd", "absolute paths are not allowed"),
    ("C:\\models\\a.safetensors", "absolute paths are not allowed"),
    ("\\\\server\\share\\a.safetensors", "absolute paths are not allowed"),
    ("~/a.safetensors", "absolute paths are not allowed"),
    ("checkpoints/../../secret.safetensors", "'..' is not allowed"),
    ("embeddings/x.safetensors", "not in checkpoints, diffusion_models, loras"),
    ("checkpoints/patchbay-sd15-tiny-a.ckpt", "only .safetensors files are read"),
])
def test_recipe_paths_outside_the_model_folders_are_refused(pack, path, message):
    with pytest.raises(ValueError, match=message):
        pack.comfy_merge.runtime.resolve(path)


def test_a_symlink_leading_out_of_the_model_folders_is_refused(comfy, pack, tmp_path, models):
    folder, outside = tmp_path / "more_checkpoints", tmp_path / "elsewhere"
    folder.mkdir()
    outside.mkdir()
    (outside / "secret.safetensors").write_bytes(models.checkpoints["patchbay-sd15-tiny-a"].read_bytes()[:64])
    os.symlink(outside / "secret.safetensors", folder / "linked.safetensors")
    os.symlink(models.checkpoints["patchbay-sd15-tiny-b"], folder / "inside.safetensors")
    comfy.folder_paths.add_model_folder_path("checkpoints", str(folder))
    try:
        comfy.folder_paths.filename_list_cache.pop("checkpoints", None)
        with pytest.raises(ValueError, match="leads to .*elsewhere/secret.safetensors, outside the checkpo"):
            pack.comfy_merge.runtime.resolve("checkpoints/linked.safetensors")
        # a link to a file inside another checkpoints folder is fine (models folders are often linked)
        assert pack.comfy_merge.runtime.resolve("checkpoints/inside.safetensors") == \
            models.checkpoints["patchbay-sd15-tiny-b"].resolve()
    finally:
        comfy.folder_paths.folder_names_and_paths["checkpoints"][0].remove(str(folder))
        comfy.folder_paths.filename_list_cache.pop("checkpoints", None)


@pytest.mark.parametrize(("path", "message"), [
    ("checkpoint/patchbay-sd15-tiny-a.safetensors", "'checkpoint' is no model folder, and no checkpoint "
     "subfolder of one holds patchbay-sd15-tiny-a.safetensors; did you mean checkpoints/patchbay-sd15"),
    ("lora/x/patchbay-sd15-tiny-a.safetensors", "did you mean loras/x/patchbay-sd15-tiny-a.safetensors?"),
    ("checkpoints/sd15/patchbay-sd15-tiny-a.safetensors", "checkpoints has no 'sd15/patchbay-sd15-tiny-a"),
])
def test_a_misspelt_folder_or_subfolder_is_refused_never_skipped_over(pack, path, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("?", r"\?")):
        pack.comfy_merge.runtime.resolve(path)


def test_a_file_in_a_subfolder_is_found_by_its_exact_path_and_a_near_miss_is_named(comfy, pack, tmp_path,
                                                                                     models):
    folder = tmp_path / "more_checkpoints"
    (folder / "sd15").mkdir(parents=True)
    os.symlink(models.checkpoints["patchbay-sd15-tiny-b"], folder / "sd15" / "inside.safetensors")
    comfy.folder_paths.add_model_folder_path("checkpoints", str(folder))
    try:
        comfy.folder_paths.filename_list_cache.pop("checkpoints", None)
        assert pack.comfy_merge.runtime.resolve("checkpoints/sd15/inside.safetensors") == \
            models.checkpoints["patchbay-sd15-tiny-b"].resolve()
        with pytest.raises(ValueError, match=r"checkpoints has no 'sd51/inside.safetensors'; did you mean "
                                             r"'sd15/inside.safetensors'"):
            pack.comfy_merge.runtime.resolve("checkpoints/sd51/inside.safetensors")
    finally:
        comfy.folder_paths.folder_names_and_paths["checkpoints"][0].remove(str(folder))
        comfy.folder_paths.filename_list_cache.pop("checkpoints", None)


def test_an_output_name_through_a_link_out_of_its_folder_makes_no_folder_anywhere(comfy, pack, tmp_path,
                                                                                  monkeypatch):
    """Issue 30 item 2: output/evil-out links elsewhere; evil-out/newsub/esc is refused, and no newsub is
    made in that other directory (it was made first and checked after)."""
    files = pack.comfy_merge.files
    loras = tmp_path / "loras"
    loras.mkdir()
    monkeypatch.setitem(comfy.folder_paths.folder_names_and_paths, "loras",
                        ([str(loras)], comfy.folder_paths.folder_names_and_paths["loras"][1]))
    for target, root in ((files.output_file, Path(comfy.folder_paths.get_output_directory())),
                         (files.lora_file, loras)):
        elsewhere = tmp_path / f"elsewhere-{target.__name__}"
        elsewhere.mkdir()
        os.symlink(elsewhere, root / "evil-out")
        try:
            with pytest.raises(ValueError, match=r"evil-out/newsub/esc'.* outside the (output|loras) folder"):
                target("evil-out/newsub/esc", "number")
            assert list(elsewhere.iterdir()) == []
            assert target("inside/newsub/ok", "number") == root / "inside" / "newsub" / "ok.safetensors"
        finally:
            (root / "evil-out").unlink()


@pytest.mark.parametrize("name", ["/tmp/evil", "../evil", "checkpoints/../../evil", "C:\\evil"])
def test_save_and_extract_names_outside_their_folders_are_refused(comfy, pack, name):
    files = pack.comfy_merge.files
    before = sorted(os.listdir(comfy.folder_paths.get_output_directory()))
    for target in (files.output_file, files.lora_file):
        with pytest.raises(ValueError, match="not allowed"):
            target(name, "number")
    assert sorted(os.listdir(comfy.folder_paths.get_output_directory())) == before


def test_recipes_folder_is_registered_for_mecha_files(comfy):
    folders, extensions = comfy.folder_paths.folder_names_and_paths["recipes"]
    assert ".mecha" in extensions
    assert os.path.join(comfy.folder_paths.models_dir, "recipes") in folders
