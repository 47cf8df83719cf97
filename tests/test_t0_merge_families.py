"""T0: the families table (merge/architectures.py): detection of every family from tiny files of its real
key layout (devtools/tiny_families.py), blocks counted from the file, block maps on every family, and
merges of different families or layouts refused before anything is written."""

from __future__ import annotations

import os

import pytest
import tiny_families as tf
import torch

pytestmark = pytest.mark.t0

FAMILIES = [f for f in tf.FAMILIES if f != "unknown"]


@pytest.fixture(scope="module")
def archs():
    from patchbay_merge import architectures

    return architectures


@pytest.fixture(scope="module")
def blocks():
    from patchbay_merge import blocks

    return blocks


def _infos(shapes):
    from patchbay_merge.io import TensorInfo

    return {k: TensorInfo("F16", s, 0, 0) for k, s in shapes.items()}


def test_the_table_and_the_tiny_layouts_cover_the_same_families(archs):
    assert set(FAMILIES) == set(archs.BY_ID)


def test_the_design_doc_lists_every_family():
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "design-merge.md").read_text()
    rows = {line.split("`")[1] for line in doc.splitlines() if line.startswith("| `")}
    assert set(FAMILIES) <= rows


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("checkpoint", [False, True], ids=["diffusion-model", "checkpoint"])
def test_every_family_is_detected_in_both_file_layouts(family, checkpoint):
    from patchbay_merge import io

    assert io.detect_architecture(_infos(tf.shapes(family, checkpoint=checkpoint))) == (
        family,
        not checkpoint,
    )


def test_a_file_of_no_known_family_is_unknown_and_loras_stay_loras():
    from patchbay_merge import io

    assert io.detect_architecture(_infos(tf.shapes("unknown"))) == ("unknown", False)
    lora = {
        "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": (4, 8),
        "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": (24, 4),
    }
    assert io.detect_architecture(_infos(lora)) == ("lora-kohya", False)
    peft = {"transformer.blocks.0.attn1.to_q.lora_A.weight": (4, 8)}  # a Wan LoRA (diffusers names)
    assert io.detect_architecture(_infos(peft)) == ("lora-peft", False)


@pytest.mark.parametrize(
    ("family", "counts", "layout"),
    [
        ("flux2", (8, 48), "8 double_blocks + 48 single_blocks"),  # Flux.2 [dev]
        ("flux2", (5, 20), "5 double_blocks + 20 single_blocks"),  # Klein 4B
        ("flux", (19, 38), "19 double_blocks + 38 single_blocks"),
        ("qwen_image", (60,), "60 transformer_blocks"),
        ("wan21", (30,), "30 blocks"),
        ("wan21", (40,), "40 blocks"),
        ("sd3", (24,), "24 joint_blocks"),
        ("sd3", (38,), "38 joint_blocks"),
        ("hunyuan_video15", (54, 0), "54 double_blocks"),
        ("cosmos", (36,), "36 blocks.blockN"),
        ("z_image", (30,), "30 layers + 2 noise_refiner + 2 context_refiner"),
    ],
)
def test_blocks_are_counted_from_the_file(archs, blocks, family, counts, layout):
    shapes = tf.shapes(family, *counts, checkpoint=True)
    found = archs.detect(shapes)
    assert archs.describe(found.family, found.layout).endswith(f", {layout})")
    names = blocks.block_names(family, shapes)
    indexed = [n for n in names if n[-1].isdigit()]
    assert len(indexed) == sum(counts) + (4 if family == "z_image" else 0)
    for key in shapes:
        assert blocks.block_of(family, key) in names, key


def test_flux2_block_maps_name_flux2_blocks_with_the_nearest_in_errors(blocks):
    keys = set(tf.shapes("flux2", 8, 48, checkpoint=True))
    blocks.check_map(
        {
            "single_blocks.40": 0.5,
            "double_blocks.7": 1,
            "double_stream_modulation_img": 0,
            "BASE": 1,
            "VAE": 1,
            "default": 0,
        },
        "flux2",
        keys,
    )
    assert (
        blocks.block_of("flux2", "model.diffusion_model.single_blocks.40.linear1.weight")
        == "single_blocks.40"
    )
    with pytest.raises(
        ValueError,
        match=r"'double_blocks\.8' is no block of flux2 \(counted from the file: .*"
        r"double_blocks\.0-7, single_blocks\.0-47.*did you mean 'double_blocks\.7'",
    ):
        blocks.check_map({"double_blocks.8": 1}, "flux2", keys)
    with pytest.raises(
        ValueError, match=r"'singel_blocks\.3' is no block of flux2.*did you mean 'single_blocks\.3'"
    ):
        blocks.check_map({"singel_blocks.3": 1}, "flux2", keys)
    # Flux.1's 19 + 38 when no file is at hand (the block-weight node), Flux.2 [dev]'s 8 + 48 for flux2
    assert "double_blocks.18" in blocks.block_names("flux") and "double_blocks.8" not in blocks.block_names(
        "flux2"
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_block_maps_and_key_patterns_work_on_every_family(blocks, family):
    keys = tf.shapes(family, checkpoint=True)
    names = blocks.block_names(family, keys)
    mapping = {name: i / 100 for i, name in enumerate(names)}
    blocks.check_map(mapping, family, set(keys))
    for key in keys:
        assert blocks.resolve(mapping, family, key) == mapping[blocks.block_of(family, key)], key
    blocks.check_map({"*.attn*": 0.3, "default": 1.0}, family, set(keys))
    assert blocks.component_of(family, next(k for k in keys if k.startswith("model."))) == "diffuser"
    with pytest.raises(ValueError, match=f"'Base' is no block of {family}.*did you mean 'BASE'"):
        blocks.check_map({"Base": 1.0}, family, set(keys))


# ---- merges -----------------------------------------------------------------------------------------


def _pair(folder, a, b):
    first = tf.write(folder / f"{a[0]}.safetensors", *a, seed=1)
    second = tf.write(folder / f"{b[0]}-b.safetensors", *b, seed=2)
    return first, second


@pytest.mark.parametrize(
    ("a", "b", "said"),
    [
        (
            ("flux2", 8, 48),
            ("hunyuan_video15", 8, 0),
            "is a hunyuan_video15 model but flux2.safetensors is flux2",
        ),
        (("wan21", 30), ("ltxv", 28), "is a ltxv model but wan21.safetensors is wan21"),
        (("flux", 19, 38), ("flux2", 8, 48), "is a flux2 model but flux.safetensors is flux"),
        (
            ("wan21", 30),
            ("wan21", 40),
            "is a wan21 model but wan21.safetensors is wan21: wan21 (Wan 2.1 / Wan 2.2 "
            "A14B, 40 blocks) vs wan21 (Wan 2.1 / Wan 2.2 A14B, 30 blocks), one family",
        ),
        (("wan21", 30), ("wan22_5b", 30), "is a wan22_5b model but wan21.safetensors is wan21"),
        (("flux", 19, 38), ("unknown",), "is a model of unknown architecture"),
    ],
)
def test_merges_of_different_families_or_layouts_stop_before_anything_is_written(tmp_path, a, b, said):
    from patchbay_merge import execute, io
    from patchbay_merge import recipe as R

    first, second = _pair(tmp_path, a, b)
    out = tmp_path / "out.safetensors"
    before = sorted(os.listdir(tmp_path))
    recipe = R.weighted_sum(R.model(str(first)), R.model(str(second)), alpha=0.5)
    with pytest.raises(io.ModelFileError) as caught:
        execute.merge(recipe, out)
    message = str(caught.value)
    assert message.startswith(f"{second}: {said}"), message
    assert "architecture_policy 'allow'" in message and "--architecture-policy allow" in message
    assert sorted(os.listdir(tmp_path)) == before
    with pytest.raises(io.ModelFileError):
        execute.plan(recipe)


def test_the_allow_policy_merges_by_key_and_says_so(tmp_path):
    from patchbay_merge import execute
    from patchbay_merge import recipe as R
    from safetensors.torch import load_file

    first, second = _pair(tmp_path, ("wan21", 2), ("ltxv", 2))
    out = tmp_path / "out.safetensors"
    report = execute.merge(
        R.weighted_sum(R.model(str(first)), R.model(str(second)), alpha=0.5),
        out,
        execute.MergeOptions(architecture_policy="allow", progress=False),
    )
    assert any(
        "is a ltxv model but wan21.safetensors is wan21" in w and "merged key by key" in w
        for w in report.warnings
    ), report.warnings
    union = {f"model.diffusion_model.{k}" for k in (*tf.shapes("wan21", 2), *tf.shapes("ltxv", 2))}
    assert set(load_file(str(out))) == union  # diffusion-model-only inputs give checkpoint names
    with pytest.raises(ValueError, match="architecture_policy='maybe'; choose one of refuse, allow"):
        execute.MergeOptions(architecture_policy="maybe")


def test_a_file_of_no_known_family_merges_by_key_and_says_so(tmp_path):
    from patchbay_merge import execute
    from patchbay_merge import recipe as R

    first, second = _pair(tmp_path, ("unknown", 3), ("unknown", 3))
    report = execute.merge(
        R.weighted_sum(R.model(str(first)), R.model(str(second)), alpha=0.5),
        tmp_path / "out.safetensors",
        execute.MergeOptions(progress=False),
    )
    assert report.arch == "unknown" and report.keys == len(tf.shapes("unknown", 3))
    assert any(
        "unknown.safetensors is of no known family" in w and "merged key by key" in w for w in report.warnings
    ), report.warnings


def test_a_flux2_block_map_merges_and_a_flux1_block_map_is_refused_at_plan_time(tmp_path):
    from patchbay_merge import execute, graph
    from patchbay_merge import recipe as R
    from safetensors.torch import load_file

    first, second = (
        tf.write(tmp_path / f"{n}.safetensors", "flux2", 2, 6, checkpoint=True, seed=s)
        for n, s in (("a", 1), ("b", 2))
    )
    alpha = R.literal({"single_blocks.5": 1.0, "*.double_blocks.*": 0.0, "default": 0.5})
    out = tmp_path / "out.safetensors"
    execute.merge(
        R.weighted_sum(R.model(str(first)), R.model(str(second)), alpha=alpha),
        out,
        execute.MergeOptions(progress=False, dtype="fp32"),
    )
    merged, a, b = (load_file(str(p)) for p in (out, first, second))
    key = "model.diffusion_model.single_blocks.5.linear1.weight"
    assert torch.allclose(merged[key], b[key].float(), atol=1e-6)
    key = "model.diffusion_model.double_blocks.1.img_attn.qkv.weight"
    assert torch.allclose(merged[key], a[key].float(), atol=1e-6)
    with pytest.raises(
        graph.RecipeError,
        match=r"'single_blocks\.6' is no block of flux2 \(counted from the "
        r"file: .*single_blocks\.0-5",
    ):
        execute.plan(
            R.weighted_sum(
                R.model(str(first)),
                R.model(str(second)),
                alpha=R.literal({"single_blocks.6": 1.0, "default": 0.5}),
            )
        )


def test_the_cli_takes_the_policy(tmp_path, capsys):
    from patchbay_merge import cli

    first, second = _pair(tmp_path, ("wan21", 2), ("ltxv", 2))
    recipe = tmp_path / "r.mecha"
    recipe.write_text(
        f'version 0.1.0\nmodel "{first}"\nmodel "{second}"\nmerge "weighted_sum" &0 &1 alpha=0.5'
    )
    out = tmp_path / "out.safetensors"
    assert cli.main(["merge", str(recipe), str(out), "--no-progress"]) == cli.EXIT_USER_ERROR
    assert "--architecture-policy allow" in capsys.readouterr().err and not out.exists()
    assert cli.main(["merge", str(recipe), str(out), "--no-progress", "--architecture-policy", "allow"]) == 0
    assert "merged key by key" in capsys.readouterr().err and out.exists()
    assert cli.main(["validate", str(recipe)]) == cli.EXIT_USER_ERROR
    assert "is a ltxv model but wan21.safetensors is wan21" in capsys.readouterr().err
    assert cli.main(["validate", str(recipe), "--architecture-policy", "allow"]) == 0
    assert "warning: " in capsys.readouterr().out


def test_extract_lora_obeys_the_architecture_policy(tmp_path, capsys):
    from patchbay_merge import cli, extract, io
    from patchbay_merge import recipe as R

    first, second = _pair(tmp_path, ("wan21", 2), ("ltxv", 2))
    delta = R.subtract(R.model(str(first)), R.model(str(second)))
    out = tmp_path / "lora.safetensors"
    with pytest.raises(io.ModelFileError, match="is a ltxv model but wan21.safetensors is wan21"):
        extract.extract_lora(delta, out)
    assert not out.exists()
    report = extract.extract_lora(delta, out, extract.ExtractOptions(rank=2, architecture_policy="allow"))
    assert out.exists() and report.modules > 0
    assert any("merged key by key" in w for w in report.warnings), report.warnings
    with pytest.raises(ValueError, match="architecture_policy='maybe'; choose one of refuse, allow"):
        extract.ExtractOptions(architecture_policy="maybe")
    recipe = tmp_path / "d.mecha"
    recipe.write_text(f'version 0.1.0\nmodel "{first}"\nmodel "{second}"\nmerge "subtract" &0 &1')
    again = tmp_path / "cli.safetensors"
    assert cli.main(["extract", str(recipe), str(again), "--rank", "2"]) == cli.EXIT_USER_ERROR
    assert "--architecture-policy allow" in capsys.readouterr().err and not again.exists()
    command = ["extract", str(recipe), str(again), "--rank", "2", "--architecture-policy", "allow"]
    assert cli.main(command) == 0
    assert "merged key by key" in capsys.readouterr().err and again.exists()


# ---- block maps as text: ranges and globs over block names ----------------------------------------------


def _text_map(archs, family, counts):
    """A block map in the nodes' text form for ``family``: the first half of each indexed group as a
    range (0.25), its other blocks by a glob over block names (0.75), default 0.5."""
    table = archs.BY_ID[family]
    if table.unet:
        return {"IN00-05": 0.25, "OUT*": 0.75, "default": 0.5}, lambda name: (
            0.25 if name in {f"IN{i:02}" for i in range(6)} else 0.75 if name.startswith("OUT") else 0.5)
    entries, expect = {}, {}
    for template, count in counts:
        stem = template.replace("{n}", "")
        if count >= 2:
            entries[f"{stem}0-{count // 2 - 1}"] = 0.25
            expect.update({f"{stem}{i}": 0.25 for i in range(count // 2)})
        entries[f"{stem}*"] = 0.75
        expect.update({f"{stem}{i}": 0.75 for i in range(count) if f"{stem}{i}" not in expect})
    return {**entries, "default": 0.5}, lambda name: expect.get(name, 0.5)


@pytest.mark.parametrize("family", FAMILIES)
def test_ranges_and_block_globs_cover_every_family(archs, blocks, family):
    shapes = tf.shapes(family, checkpoint=True)
    found = archs.detect(shapes)
    text, expect = _text_map(archs, family, found.layout)
    mapping = blocks.expand_ranges(text)
    assert not any("-" in entry for entry in mapping), mapping
    blocks.check_map(mapping, family, set(shapes))
    for key in shapes:
        block = blocks.block_of(family, key)
        assert blocks.resolve(mapping, family, key) == expect(block), (key, block)


def test_flux2_ranges_follow_the_file_and_name_the_nearest_blocks(blocks):
    text = {"double_blocks.0-7": 0.5, "single_blocks.*": 1.0, "img_in": 0.0, "default": 0.25}
    mapping = blocks.expand_ranges(text)
    assert [k for k in mapping if k.startswith("double_blocks")] == [f"double_blocks.{i}" for i in range(8)]
    dev = set(tf.shapes("flux2", 8, 48, checkpoint=True))
    blocks.check_map(mapping, "flux2", dev)
    for key, value in (("double_blocks.7.img_attn.qkv.weight", 0.5), ("single_blocks.47.linear1.weight", 1.0),
                       ("final_layer.linear.weight", 0.25)):
        assert blocks.resolve(mapping, "flux2", f"model.diffusion_model.{key}") == value, key
    klein = set(tf.shapes("flux2", 5, 20, checkpoint=True))  # Klein 4B: 5 double blocks
    with pytest.raises(ValueError, match=r"'double_blocks\.5' is no block of flux2 \(counted from the file: "
                                         r".*double_blocks\.0-4, single_blocks\.0-19.*did you mean"):
        blocks.check_map(mapping, "flux2", klein)
    # without a file an indexed block of the family passes whatever its number; a misspelt group does not
    blocks.check_map(blocks.expand_ranges({"double_blocks.30": 1, "single_blocks.0-63": 1}), "flux2")
    with pytest.raises(ValueError, match=r"'singel_blocks\.3' is no block of flux2.*'single_blocks\.3'"):
        blocks.check_map({"singel_blocks.3": 1}, "flux2")


def test_unet_ranges_keep_the_zero_padding_and_bad_ranges_are_named(blocks):
    assert list(blocks.expand_ranges({"IN00-02": 1, "OUT09-OUT11": 0})) == [
        "IN00", "IN01", "IN02", "OUT09", "OUT10", "OUT11"]
    assert blocks.expand_ranges({"IN03": 1, "IN00-05": 0.5, "IN04": 2}) == {
        "IN03": 0.5, "IN00": 0.5, "IN01": 0.5, "IN02": 0.5, "IN04": 2, "IN05": 0.5}  # later entries win
    assert blocks.expand_ranges({"*.attn2.*": 1, "blocks.block0-1": 2}) == {
        "*.attn2.*": 1, "blocks.block0": 2, "blocks.block1": 2}
    with pytest.raises(ValueError, match=r"range 'double_blocks\.7-0' runs from 7 to 0: write the lower"):
        blocks.expand_ranges({"double_blocks.7-0": 1})
    with pytest.raises(ValueError, match=r"at most 1000 blocks"):
        blocks.expand_ranges({"blocks.0-5000": 1})


def test_a_wan_merge_takes_a_text_block_map_with_ranges(tmp_path):
    from patchbay_merge import execute
    from patchbay_merge import recipe as R
    from safetensors.torch import load_file

    first, second = (tf.write(tmp_path / f"{n}.safetensors", "wan21", 30, seed=n) for n in (1, 2))
    alpha = R.literal({"blocks.0-9": 1.0, "blocks.2*": 0.0, "default": 0.5})  # ranges: any map takes them
    assert dict(alpha.value) == {**{f"blocks.{i}": 1.0 for i in range(10)}, "blocks.2*": 0.0, "default": 0.5}
    out = tmp_path / "out.safetensors"
    execute.merge(R.weighted_sum(R.model(str(first)), R.model(str(second)), alpha=alpha), out,
                  execute.MergeOptions(progress=False, dtype="fp32"))
    merged, a, b = (load_file(str(p)) for p in (out, first, second))
    for index, want in ((3, 1.0), (25, 0.0), (14, 0.5)):
        key = f"model.diffusion_model.blocks.{index}.ffn.0.weight"
        source = f"blocks.{index}.ffn.0.weight"
        expected = a[source].float() * (1 - want) + b[source].float() * want
        assert torch.allclose(merged[key], expected, atol=1e-6), index


@pytest.mark.parametrize(("lineage", "family"), [
    (("KOALA_700M", "SDXL", "BASE"), "sdxl"),  # a pruned SDXL: the family of its base class
    (("FluxSchnell", "Flux", "BASE"), "flux"),
    (("Flux2", "Flux", "BASE"), "flux2"),
    (("ZImage", "Lumina2", "BASE"), "z_image"),
    (("WAN21_I2V", "WAN21_T2V", "BASE"), "wan21"),
    (("SD15", "BASE"), "sd15"),
    (("SDXLRefiner", "BASE"), None),
])
def test_a_loaded_model_without_readable_shapes_is_placed_by_its_config_class(archs, lineage, family):
    assert archs.from_comfy_classes(lineage) == family


def test_mecha_dict_lines_take_ranges_and_are_written_back_as_blocks():
    from patchbay_merge import mecha_text

    text = ('version 0.1.0\nmodel "a.safetensors"\nmodel "b.safetensors"\n'
            'dict double_blocks.0-2=0.5 single_blocks.*=1 default=0\nmerge "weighted_sum" &0 &1 alpha=&2')
    written = mecha_text.dumps(mecha_text.parse(text), compact=True)
    blocks = " ".join(f"double_blocks.{i}=0.5" for i in range(3))
    assert f"dict {blocks} single_blocks.*=1 default=0" in written
    assert mecha_text.parse(written) == mecha_text.parse(text)
