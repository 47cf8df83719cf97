"""T0: the .mecha text format: round trips, files written by sd-mecha 1.1.8 itself, errors with line/col."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.t0


@pytest.fixture(scope="module")
def R():
    from patchbay_merge import recipe

    return recipe


@pytest.fixture(scope="module")
def M():
    from patchbay_merge import mecha_text

    return mecha_text


def _recipes(R):
    a, b, c = R.model("a.safetensors"), R.model("b.safetensors"), R.model("dir/c \"q\" \\.safetensors")
    base = R.model("base.safetensors", config="sd1-ldm")
    blocks = R.literal({"IN00": 0.2, "M00": 0.75, "*.attn2.*": 1, "default": 0.5})
    return {
        "weighted_sum": R.weighted_sum(a, b, alpha=0.3),
        "defaults": R.weighted_sum(a, b),
        "blocks": R.weighted_sum(a, b, alpha=blocks),
        "add_difference": R.add_difference(a, R.subtract(b, c), alpha=0.5),
        "ties_dare": R.add_difference(base, R.ties_sum_with_dropout(
            R.subtract(a, base), R.subtract(b, base), probability=0.3, seed=7, rescale=False), alpha=1e-20),
        "train_difference": R.add_difference(a, R.subtract(b, c), alpha=R.train_difference_mask(a, b, c)),
        "open": R.weighted_sum(R.free_input("x", "weight"), a, alpha=R.param("alpha")),
        "delta_model": R.add_difference(a, R.model("lora_delta.safetensors", space="delta")),
        "strings": R.pick_component(R.n_average(a, b, c), component="clip_l"),
        "shared_line": R.clamp(R.weighted_sum(a, b, alpha=blocks), a, R.slerp(a, b, alpha=blocks)),
        "negative": R.crossover(a, b, alpha=0.25, tilt=-0.5),
    }


@pytest.mark.parametrize("name", [
    "weighted_sum", "defaults", "blocks", "add_difference", "ties_dare", "train_difference", "open",
    "delta_model", "strings", "shared_line", "negative"])
def test_round_trip(R, M, name):
    recipe = _recipes(R)[name]
    text = M.dumps(recipe)
    assert text.startswith("version 0.1.0\n") and not text.endswith("\n")
    assert M.parse(text) == recipe
    assert M.dumps(M.parse(text)) == text


def test_dumps_is_compact_and_shares_lines(R, M):
    text = M.dumps(_recipes(R)["weighted_sum"], compact=True)
    assert text == ('version 0.1.0\nmodel "a.safetensors"\nmodel "b.safetensors"\n'
                    'merge "weighted_sum" &0 &1 alpha=0.3')
    sd_mecha_form = text.replace('safetensors"', 'safetensors" merge_space="weight"')
    assert M.dumps(_recipes(R)["weighted_sum"]) == sd_mecha_form
    assert M.dumps(_recipes(R)["defaults"]).endswith('merge "weighted_sum" &0 &1')
    shared = M.dumps(_recipes(R)["shared_line"]).split("\n")
    assert sum(line.startswith("dict ") for line in shared) == 1
    assert len(shared) == len(set(shared))


def test_reads_sd_mecha_scalar_indirection_comments_and_positional_params(R, M):
    text = "\n".join([
        "version 0.1.0",
        "# a comment is not an instruction",
        'model "a.safetensors" model_config="structural" merge_space="weight"',
        '  # an indented comment',
        'model "b.safetensors" model_config="structural" merge_space="weight"',
        "dict key=0.3",
        'literal &2 model_config="singleton-mecha" merge_space="param"',
        'merge "convert_singleton" &3',
        'merge "weighted_sum" &0 &1 &4',
    ])
    a = R.model("a.safetensors", config="structural")
    b = R.model("b.safetensors", config="structural")
    assert M.parse(text) == R.weighted_sum(a, b, alpha=0.3)


def test_reads_sd_mecha_block_literals(R, M):
    text = "\n".join([
        "version 0.1.0",
        'model "x1.safetensors" model_config="sd1-ldm" merge_space="weight"',
        'model "x2.safetensors" model_config="sd1-ldm" merge_space="weight"',
        "dict IN00=0.2 M00=0.7 OUT11=1.0",
        'literal &2 model_config="sd1-supermerger_blocks" merge_space="param"',
        'merge "convert_sd1_blocks_to_ldm" &3',
        'merge "weighted_sum" &0 &1 &4',
    ])
    x1, x2 = R.model("x1.safetensors", config="sd1-ldm"), R.model("x2.safetensors", config="sd1-ldm")
    assert M.parse(text) == R.weighted_sum(x1, x2, alpha={"IN00": 0.2, "M00": 0.7, "OUT11": 1.0})


# ---- files written by sd-mecha's own serialize -----------------------------------------------------

@pytest.fixture(scope="module")
def sdm_files(tmp_path_factory):
    sd_mecha = pytest.importorskip("sd_mecha")
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("sdm")
    paths = {}
    for i, name in enumerate("abc"):
        paths[name] = str(folder / f"{name}.safetensors")
        tensor = torch.randn(4, 4, generator=torch.Generator().manual_seed(i))
        save_file({"layer.weight": tensor}, paths[name])
    return sd_mecha, paths


def _sd_mecha_cases(sd_mecha, p, R):
    from sd_mecha.extensions.builtin.merge_methods import svd, ties

    sa, sb, sc = (sd_mecha.model(p[n]) for n in "abc")
    a, b, c = (R.model(p[n], config="structural") for n in "abc")
    d_ac, d_bc = R.subtract(a, c), R.subtract(b, c)
    return [
        (sd_mecha.weighted_sum(sa, sb, alpha=0.3), R.weighted_sum(a, b, alpha=0.3)),
        (sd_mecha.weighted_sum(sa, sb), R.weighted_sum(a, b)),
        (sd_mecha.slerp(sa, sb, alpha=0.2), R.slerp(a, b, alpha=0.2)),
        (sd_mecha.n_average(sa, sb, sc), R.n_average(a, b, c)),
        (sd_mecha.add_difference(sa, sb, sc, alpha=0.5),
         R.fallback(R.add_difference(a, R.subtract(b, c), alpha=0.5), a)),
        (sd_mecha.add_perpendicular(sa, sb, sc, alpha=0.4),
         R.add_difference(a, R.perpendicular_component(d_ac, d_bc), alpha=0.4)),
        (sd_mecha.ties_sum(sd_mecha.subtract(sa, sc), sd_mecha.subtract(sb, sc), k=0.5),
         R.ties_sum(d_ac, d_bc, k=0.5)),
        (ties.ties_sum_with_dropout(sd_mecha.subtract(sa, sc), sd_mecha.subtract(sb, sc),
                                    probability=0.2, seed=3),
         R.ties_sum_with_dropout(d_ac, d_bc, probability=0.2, seed=3)),
        (sd_mecha.n_model_stock(sc, sa, sb), R.add_difference(c, R.model_stock(d_ac, d_bc), alpha=1.0)),
        (sd_mecha.geometric_median(sa, sb, sc), R.geometric_median(a, b, c)),
        (sd_mecha.crossover(sa, sb, alpha=0.3, tilt=0.5), R.crossover(a, b, alpha=0.3, tilt=0.5)),
        (sd_mecha.tensor_sum(sa, sb, width=0.3), R.tensor_sum(a, b, width=0.3)),
        (sd_mecha.clamp(sa, sb, sc), R.clamp(a, b, c)),
        (sd_mecha.add_cosine_a(sa, sb, alpha=0.2), R.add_cosine_a(a, b, alpha=0.2)),
        (sd_mecha.add_cosine_b(sa, sb), R.add_cosine_b(a, b)),
        (sd_mecha.multiply_quotient(sa, sb, sc), R.multiply_quotient(a, b, c)),
        (sd_mecha.train_difference_mask(sa, sb, sc), R.train_difference_mask(a, b, c)),
        (svd.rotate(sa, sb, alignment=0.5, alpha=0.25), R.rotate(a, b, alignment=0.5, alpha=0.25)),
        (sd_mecha.truncate_rank(sd_mecha.subtract(sa, sb), rank=2),
         R.truncate_rank(R.subtract(a, b), rank=2)),
        (sd_mecha.dropout(sa, sb, sc, probability=0.5, seed=1),
         R.add_difference(a, R.dropout(R.subtract(b, a), R.subtract(c, a), probability=0.5, seed=1),
                          alpha=0.5)),
    ]


def test_files_written_by_sd_mecha_parse_into_the_equivalent_recipe(R, M, sdm_files):
    sd_mecha, paths = sdm_files
    for sd_recipe, expected in _sd_mecha_cases(sd_mecha, paths, R):
        text = sd_mecha.serialize(sd_recipe)
        assert M.parse(text) == expected, text
        assert M.parse(M.dumps(M.parse(text))) == expected


def test_unfinalized_sd_mecha_text_with_inline_scalars_and_blocks(R, M, sdm_files):
    sd_mecha, paths = sdm_files
    x1, x2 = (sd_mecha.model(f"x{i}.safetensors", config="sd1-ldm") for i in (1, 2))
    blocks = sd_mecha.literal({"IN00": 0.2, "M00": 0.7}, config="sd1-supermerger_blocks")
    text = sd_mecha.serialize(sd_mecha.weighted_sum(x1, x2, alpha=blocks), finalize=False)
    r1, r2 = (R.model(f"x{i}.safetensors", config="sd1-ldm") for i in (1, 2))
    assert M.parse(text) == R.weighted_sum(r1, r2, alpha={"IN00": 0.2, "M00": 0.7})


def _sd_mecha_form_cases(R):
    a, b, c = R.model("a.safetensors"), R.model("b.safetensors"), R.model("c.safetensors")
    x1, x2 = R.model("x1.safetensors", config="sd1-ldm"), R.model("x2.safetensors", config="sd1-ldm")
    sd15 = ("BASE", *(f"IN{i:02}" for i in range(12)), "M00", *(f"OUT{i:02}" for i in range(12)))
    lora = R.model("lora.safetensors", space="delta", config="sd1-kohya_kohya_lora")
    return [  # (recipe, arch given to dumps, what sd-mecha's own text of it reads back as)
        (R.weighted_sum(a, b, alpha=0.3), None, None),
        (R.weighted_sum(x1, x2, alpha={"IN00": 0.2, "M00": 0.7, "default": 0.5}), None,
         R.weighted_sum(x1, x2, alpha={b: {"IN00": 0.2, "M00": 0.7}.get(b, 0.5) for b in sd15})),
        (R.weighted_sum(a, b, alpha={"IN08": 0.2, "VAE": 0.0, "default": 1.0}), "sdxl",
         R.weighted_sum(a, b, alpha={"BASE": 1.0, **{f"IN{i:02}": 0.2 if i == 8 else 1.0 for i in range(9)},
                                     "M00": 1.0, **{f"OUT{i:02}": 1.0 for i in range(9)}, "VAE": 0.0})),
        (R.add_difference(a, R.subtract(b, c), alpha=R.train_difference_mask(a, b, c, alpha=0.5)), None,
         None),
        (R.add_difference(x1, R.ties_sum_with_dropout(R.subtract(a, x1), R.subtract(b, x1), probability=0.3,
                                                      seed=7)), "sd15", None),
        (R.add_difference(x1, lora, alpha=0.8), None, None),
        (R.pick_component(R.n_average(a, b, c), component="clip_l"), None, None),
    ]


def test_sd_mecha_reads_back_what_dumps_writes(R, M, sdm_files):
    """Our text through sd-mecha's parser and serializer and back through ours: the same recipe."""
    sd_mecha, _ = sdm_files
    for recipe, arch, expected in _sd_mecha_form_cases(R):
        text = M.dumps(recipe, arch=arch)
        assert "dict " not in text or "supermerger_blocks" in text, text  # no bare map sd-mecha misreads
        theirs = sd_mecha.serialize(sd_mecha.deserialize(text), finalize=False)
        assert M.parse(theirs) == (expected or recipe), (text, theirs)
        assert M.parse(text) == (expected or recipe)


def test_sd_mecha_lora_conversion_reads_as_the_lora_delta(R, M):
    text = "\n".join([
        "version 0.1.0",
        'model "x1.safetensors" model_config="sd1-ldm" merge_space="weight"',
        'model "l.safetensors" model_config="sd1-kohya_kohya_lora" merge_space="weight"',
        "merge \"convert_'sd1-kohya_kohya_lora'_to_base\" &1",
        "merge \"convert_'sd1-kohya'_to_'sd1-ldm'\" &2",
        'merge "add_difference" &0 &3 alpha=0.8',
    ])
    lora = R.model("l.safetensors", space="delta", config="sd1-kohya_kohya_lora")
    assert M.parse(text) == R.add_difference(R.model("x1.safetensors", config="sd1-ldm"), lora, alpha=0.8)
    unknown = "convert_'sdxl-diffusers_unet_only'_to_'sdxl-sgm'"
    with pytest.raises(M.MechaSyntaxError, match=f"conversion \"{unknown}\" is not supported here; .* "
                                                 'merge_space="delta"'):
        M.parse(f'version 0.1.0\nmodel "u.safetensors"\nmerge "{unknown}" &0')


def test_sd_mecha_reads_our_compact_text_of_plain_recipes(R, M, sdm_files):
    """Our compact lines are sd-mecha lines: sd-mecha deserialises them (scalars inline)."""
    sd_mecha, paths = sdm_files
    a, b = R.model(paths["a"]), R.model(paths["b"])
    text = M.dumps(R.slerp(a, b, alpha=0.3))
    node = sd_mecha.deserialize(text)
    assert node.merge_method.identifier == "slerp"


# ---- errors --------------------------------------------------------------------------------------

HEADER = "version 0.1.0\n"
TWO = HEADER + 'model "a"\nmodel "b"\n'


@pytest.mark.parametrize(("text", "line", "column", "fragment"), [
    ("version 0.2.0\nmodel \"a\"", 1, 1, "expected the header 'version 0.1.0'"),
    ("", 1, 1, "expected the header"),
    (HEADER + 'model "a', 2, 7, "unterminated string"),
    (HEADER + 'model "a"\n', 3, 1, "blank line"),
    (HEADER + 'model "a"\n\nmodel "b"', 3, 1, "blank line"),
    (HEADER, 2, 1, "blank line"),
    (HEADER + "# only a comment", 2, 1, "no instruction"),
    (HEADER + "mdoel \"a\"", 2, 1, "unknown instruction 'mdoel'"),
    (TWO + 'merge "weighted_sum" &0 &5', 4, 25, "reference &5 points past the 2 lines"),
    (TWO + 'merge "weighted_sum" &0 &1 alpha=zero', 4, 34, "'zero' is not a number"),
    (TWO + 'merge "weighted_sum" &0 &1 alpha=', 4, 34, "a value is missing"),
    (TWO + 'merge "weighted_sum" &0 &1 =3', 4, 28, "'=' without a name"),
    (TWO + 'merge "weighted_sum" &0 &1 alpha=0.5 alpha=0.2', 4, 38, "alpha= given twice"),
    (TWO + 'merge "weighted_sum"x &0 &1', 4, 21, "expected a space after the closing quote"),
    (TWO + 'merge "wieghted_sum" &0 &1', 4, 1, "did you mean 'weighted_sum'"),
    (TWO + 'merge "weighted_sum" &0 &1 alpah=0.5', 4, 1, "did you mean 'alpha'"),
    (TWO + 'merge "add_difference" &0 &1', 4, 1, "add_difference.b: expects a delta-space input"),
    (TWO + "dict IN00=0.5", 4, 1, "the last instruction must be"),
    (HEADER + 'model "a" bogus=1', 2, 1, "unexpected bogus="),
])
def test_syntax_errors_carry_line_and_column(M, text, line, column, fragment):
    with pytest.raises(M.MechaSyntaxError) as info:
        M.parse(text)
    assert (info.value.line, info.value.column) == (line, column), str(info.value)
    assert fragment in str(info.value)
    assert str(info.value).startswith(f"line {line}, column {column}: ")


def test_dumps_refuses_values_the_format_cannot_hold(R, M):
    a, b = R.model("a"), R.model("b")
    with pytest.raises(R.RecipeError, match="weighted_sum.alpha: inf is not a finite number"):
        R.weighted_sum(a, b, alpha=float("inf"))  # the builders refuse it already
    with pytest.raises(ValueError, match="not finite"):
        M.dumps(R.CallNode("weighted_sum", (a, b), {"alpha": R.LiteralNode(float("nan"))}))


@pytest.mark.parametrize(("line", "fragment"), [
    ('merge "weighted_sum" &0 &1 alpha=1e999', "1e999 is beyond the float range"),
    ('merge "weighted_sum" &0 &1 alpha=-1e999', "-1e999 is beyond the float range"),
    ("merge", 'takes a quoted method name, then its inputs: merge "weighted_sum" &0 &1, got 0'),
    ("merge 3 &0", "the method name must be a quoted string, got 3"),
    ("model", 'takes a quoted path: model "a.safetensors", got 0'),
    ("model 5", "the model path must be a quoted string"),
    ("literal", "takes one value or &N reference"),
    ("input 1", "input name 1 must be an identifier (a quoted name"),
    ("param 2", "parameter name 2 must be an identifier (a quoted name"),
    ('input "1x"', "input name '1x' must be an identifier"),
    ("param &1", 'parameter name &1 must be an identifier (a quoted name such as "alpha"), not a reference'),
    ("input &2", "input name &2 must be an identifier"),
    ('model "c" 5', "the model_config must be a quoted string, got 5 (a number); write model \"path\""),
    ('model "c" "sd1-ldm" 5', "the merge_space must be a quoted string, got 5"),
    ('model "c" model_config=&0', "model_config= must be a quoted string, got &0 (a reference"),
    ("merge &0 &1", "the method name must be a quoted string, got &0"),
    ('merge "weighted_sum" &0 &1 alpha=&0', "not model 'a'"),
    ('merge "weighted_sum" &0 &1\nliteral &2', "a literal is a scalar or a dict of scalars, not a subtract"),
    ('merge "crossover" &0 &1 alpha=1.5', "1.5 is outside [0, 1], the range of alpha"),
    ('merge "ties_sum" &2 &2 k=-0.5', "-0.5 is outside [0, 1], the range of k"),
    ('merge "truncate_rank" &2 rank=-1', "-1 is outside [0, inf], the range of rank"),
])
def test_malformed_instructions_and_values_are_refused_with_their_line(M, line, fragment):
    text = TWO + 'merge "subtract" &0 &1\n' + line
    last = 5 + line.count("\n")
    with pytest.raises(M.MechaSyntaxError, match=rf"^line {last}, column \d+: ") as info:
        M.parse(text)
    assert fragment in str(info.value)
    assert "Node(" not in str(info.value)  # values as written, never a Python repr


def test_crlf_files_read_like_lf_files(R, M):
    recipe = _recipes(R)["blocks"]
    assert M.parse(M.dumps(recipe).replace("\n", "\r\n")) == recipe
