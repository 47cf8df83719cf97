"""T0: the streaming merge executor (merge/execute.py, merge/stream.py) on small generated files.

Every merge is compared with the same recipe evaluated in memory on whole fp32 tensors; policies,
dtypes, atomicity (no partial or temporary file after an error or Ctrl-C, existing files
untouched) and the memory-budget spill are checked on files of a few kilobytes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.t0

SHAPES = {
    "model.diffusion_model.input_blocks.0.0.weight": (8, 4, 3, 3),
    "model.diffusion_model.input_blocks.0.0.bias": (8,),
    "model.diffusion_model.middle_block.1.proj_in.weight": (16, 24),
    "model.diffusion_model.out.2.weight": (300, 70),  # several slices at chunk_elements=4096
    "cond_stage_model.transformer.text_model.embeddings.position_ids": (1, 7),
}


@pytest.fixture(scope="module")
def m():
    from patchbay_merge import checks, execute, io, recipe, stream
    from patchbay_merge import method_registry as registry

    return type("M", (), {"execute": execute, "io": io, "recipe": recipe, "registry": registry,
                          "stream": stream, "checks": checks})


def make_model(path: Path, seed: int, shapes: dict | None = None, dtype=torch.float16) -> Path:
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for key, shape in (shapes or SHAPES).items():
        if key.endswith("position_ids"):
            tensors[key] = torch.arange(shape[-1], dtype=torch.int64).reshape(shape)
        else:
            tensors[key] = torch.randn(shape, generator=gen).to(dtype)
    save_file(tensors, str(path))
    return path


@pytest.fixture
def abc(tmp_path):
    return [make_model(tmp_path / f"{n}.safetensors", seed) for n, seed in (("a", 1), ("b", 2), ("c", 3))]


def opts(m, **kwargs):
    kwargs.setdefault("progress", False)
    kwargs.setdefault("fsync", False)
    return m.execute.MergeOptions(**kwargs)


def run(m, cache=None, check=None, **kwargs):
    """(options, runtime) for ``merge(recipe, out, *run(m, ...))``."""
    return opts(m, **kwargs), m.execute.MergeRuntime(cache=cache, check=check)


def register(m, fn, *inputs):
    """Register a throwaway weight-space method (annotations set here: this module postpones them)."""
    fn.__annotations__ = {**dict.fromkeys(inputs, m.registry.Weight), "return": m.registry.Weight}
    return m.registry.merge_method(fn)


def reference(m, recipe, paths, key):
    """The recipe on whole fp32 tensors in memory: method.fn applied recursively."""
    from patchbay_merge.context import KeyContext

    tensors = {str(p): load_file(str(p))[key].float() for p in paths}

    def ev(node):
        kind = type(node).__name__
        if kind == "ModelNode":
            return tensors[str(Path(node.path))]
        if kind == "LiteralNode":
            return node.value
        method = m.registry.get(node.method)
        return method.fn(*(ev(a) for a in node.args), **{k: ev(v) for k, v in node.kwargs},
                         ctx=KeyContext(key=key))

    return ev(recipe)


RECIPES = {
    "weighted_sum": lambda R, a, b, c: R.weighted_sum(a, b, alpha=0.3),
    "add_difference": lambda R, a, b, c: R.add_difference(a, R.subtract(b, c), alpha=0.7),
    "n_average": lambda R, a, b, c: R.n_average(a, b, c),
    "slerp": lambda R, a, b, c: R.slerp(a, b, alpha=0.25),  # not elementwise: whole tensors
    "nested": lambda R, a, b, c: R.weighted_sum(R.slerp(a, c, alpha=0.5),
                                                R.add_difference(b, R.subtract(a, c)), alpha=0.4),
    # param-space calls as parameters: elementwise (sliced) and whole-tensor evaluation
    "mask_param": lambda R, a, b, c: R.add_difference(a, R.subtract(b, c),
                                                      alpha=R.train_difference_mask(a, b, c, alpha=0.5)),
    "mask_param_whole": lambda R, a, b, c: R.add_difference(a, R.subtract(b, c),
                                                            alpha=R.add_opposite_mask(a, b, c)),
}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_streaming_output_equals_in_memory_reference(m, abc, tmp_path, name):
    R = m.recipe
    recipe = RECIPES[name](R, *(R.model(str(p)) for p in abc))
    out = tmp_path / "out.safetensors"
    report = m.execute.merge(recipe, out, opts(m, dtype="fp32", chunk_elements=4096))
    merged = load_file(str(out))
    assert report.keys == len(SHAPES) == len(merged)
    for key in SHAPES:
        if key.endswith("position_ids"):
            assert torch.equal(merged[key], load_file(str(abc[0]))[key])  # non-float: copied
            continue
        expected = reference(m, recipe, abc, key)
        assert merged[key].dtype == torch.float32
        torch.testing.assert_close(merged[key], expected, rtol=0, atol=1e-6)
    assert "patchbay.recipe" in m.io.SafetensorsFile(out).metadata


@pytest.mark.parametrize(("dtype", "torch_dtype"), [("fp16", torch.float16), ("bf16", torch.bfloat16),
                                                    ("fp32", torch.float32)])
def test_output_dtype(m, abc, tmp_path, dtype, torch_dtype):
    R = m.recipe
    recipe = R.weighted_sum(R.model(str(abc[0])), R.model(str(abc[1])), alpha=0.5)
    out = tmp_path / "out.safetensors"
    m.execute.merge(recipe, out, opts(m, dtype=dtype, threads=2))
    merged = load_file(str(out))
    key = "model.diffusion_model.out.2.weight"
    assert merged[key].dtype == torch_dtype
    assert torch.equal(merged[key], reference(m, recipe, abc, key).to(torch_dtype))
    assert merged["cond_stage_model.transformer.text_model.embeddings.position_ids"].dtype == torch.int64


def test_inpainting_conv_in_merges_the_overlap(m, tmp_path):
    conv_in = "model.diffusion_model.input_blocks.0.0.weight"
    inpaint = make_model(tmp_path / "inpaint.safetensors", 1, {**SHAPES, conv_in: (8, 9, 3, 3)})
    normal = make_model(tmp_path / "normal.safetensors", 2)
    base = make_model(tmp_path / "base.safetensors", 3)
    R = m.recipe
    recipe = R.add_difference(R.model(str(inpaint)), R.subtract(R.model(str(normal)), R.model(str(base))))
    out = tmp_path / "out.safetensors"
    report = m.execute.merge(recipe, out, opts(m, dtype="fp32"))
    assert report.shape_mismatches == [conv_in] and report.warnings
    merged, i, n, b = (load_file(str(p))[conv_in].float() for p in (out, inpaint, normal, base))
    assert merged.shape == (8, 9, 3, 3)
    torch.testing.assert_close(merged[:, :4], i[:, :4] + (n - b), rtol=0, atol=1e-6)
    assert torch.equal(merged[:, 4:], i[:, 4:])  # the extra mask/latent channels stay the inpainting model's


def test_shape_policies_first_and_error(m, tmp_path):
    conv_in = "model.diffusion_model.input_blocks.0.0.weight"
    inpaint = make_model(tmp_path / "inpaint.safetensors", 1, {**SHAPES, conv_in: (8, 9, 3, 3)})
    normal = make_model(tmp_path / "normal.safetensors", 2)
    R = m.recipe
    recipe = R.weighted_sum(R.model(str(inpaint)), R.model(str(normal)))
    out = tmp_path / "out.safetensors"
    m.execute.merge(recipe, out, opts(m, shape_policy="first"))
    assert torch.equal(load_file(str(out))[conv_in], load_file(str(inpaint))[conv_in])
    with pytest.raises(m.execute.MergeError, match="different shapes.*inpaint.safetensors"):
        m.execute.merge(recipe, tmp_path / "err.safetensors", opts(m, shape_policy="error"))
    assert not (tmp_path / "err.safetensors").exists()


def test_missing_key_policies(m, tmp_path):
    extra = "model.diffusion_model.extra.weight"
    a = make_model(tmp_path / "a.safetensors", 1, {**SHAPES, extra: (5, 5)})
    b = make_model(tmp_path / "b.safetensors", 2)
    R = m.recipe
    recipe = R.weighted_sum(R.model(str(a)), R.model(str(b)), alpha=0.5)
    report = m.execute.merge(recipe, tmp_path / "first.safetensors", opts(m))
    assert report.missing == {extra: ["b.safetensors"]}
    assert torch.equal(load_file(str(tmp_path / "first.safetensors"))[extra], load_file(str(a))[extra])
    report = m.execute.merge(recipe, tmp_path / "skip.safetensors", opts(m, missing_policy="skip"))
    assert report.skipped == [extra] and extra not in load_file(str(tmp_path / "skip.safetensors"))
    with pytest.raises(m.execute.MergeError, match="missing from some inputs.*b.safetensors"):
        m.execute.merge(recipe, tmp_path / "error.safetensors", opts(m, missing_policy="error"))
    assert not (tmp_path / "error.safetensors").exists()


def test_never_overwrites_unless_asked_and_leaves_no_temporary_file(m, abc, tmp_path):
    R = m.recipe
    recipe = R.weighted_sum(R.model(str(abc[0])), R.model(str(abc[1])))
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"precious")
    with pytest.raises(FileExistsError, match="overwrite"):
        m.execute.merge(recipe, out, opts(m))
    assert out.read_bytes() == b"precious"
    m.execute.merge(recipe, out, opts(m, overwrite=True, fsync=True))
    assert len(load_file(str(out))) == len(SHAPES)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors", "b.safetensors", "c.safetensors",
                                                           "out.safetensors"]


@pytest.mark.parametrize("exception", [RuntimeError, KeyboardInterrupt])
def test_error_mid_merge_leaves_no_partial_file_and_existing_files_untouched(m, abc, tmp_path, exception):
    calls = []
    with m.registry.scope():
        def explode_third(a, b):
            """Fails on its third key (shape planning traces it on meta tensors first)."""
            if a.device.type == "meta":
                return a
            calls.append(1)
            if len(calls) == 3:
                raise exception("boom")
            return a

        register(m, explode_third, "a", "b")

        R = m.recipe
        recipe = R.call("explode_third", R.model(str(abc[0])), R.model(str(abc[1])))
        existing = tmp_path / "existing.safetensors"
        existing.write_bytes(b"old")
        before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
        expected = m.stream.MethodError if exception is RuntimeError else exception  # names the key
        for target in (tmp_path / "new.safetensors", existing):
            calls.clear()
            with pytest.raises(expected, match=r"model\.diffusion_model\..*explode_third\(\) failed: boom"
                               if expected is m.stream.MethodError else "boom"):
                m.execute.merge(recipe, target, opts(m, overwrite=True))
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_bad_inputs_give_clear_errors_and_no_output(m, abc, tmp_path):
    R = m.recipe
    good = abc[0]
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[:-100])
    corrupt = tmp_path / "corrupt.safetensors"
    data = bytearray(good.read_bytes())
    data[8:12] = b"\xff\xfe{["
    corrupt.write_bytes(bytes(data))
    sd15 = make_model(tmp_path / "sd15.safetensors", 4, {
        "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight": (8, 768)})
    sdxl = make_model(tmp_path / "sdxl.safetensors", 5, {
        "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight": (8, 2048)})
    cases = [
        (tmp_path / "nope.safetensors", good, "nope.safetensors: no such file"),
        (truncated, good, "truncated.safetensors: truncated"),
        (corrupt, good, "corrupt.safetensors: corrupt header"),
        (sdxl, sd15, "sdxl.safetensors: is a sdxl model but sd15.safetensors is sd15"),
    ]
    out = tmp_path / "out.safetensors"
    for bad, other, message in cases:
        recipe = R.weighted_sum(R.model(str(other)), R.model(str(bad)))
        with pytest.raises(m.io.ModelFileError, match=message):
            m.execute.merge(recipe, out, opts(m))
        assert not out.exists()
    with pytest.raises(Exception, match="unknown merge method 'weighted_summ'.*did you mean 'weighted_sum'"):
        m.execute.merge(m.recipe.CallNode("weighted_summ", (R.model(str(good)),)), out, opts(m))
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".")]


def test_nonfinite_output_is_an_error_or_a_warning(m, abc, tmp_path):
    with m.registry.scope():
        def poison(a):
            """Puts an inf into every tensor."""
            out = a.clone()
            out.view(-1)[0] = float("inf")
            return out

        register(m, poison, "a")

        recipe = m.recipe.call("poison", m.recipe.model(str(abc[0])))
        with pytest.raises(m.checks.NonFiniteError, match="NaN; the recipe made it .*--nonfinite warn"):
            m.execute.merge(recipe, tmp_path / "out.safetensors", opts(m))
        assert not (tmp_path / "out.safetensors").exists()
        report = m.execute.merge(recipe, tmp_path / "out.safetensors", opts(m, nonfinite="warn"))
    assert len(report.nonfinite) == len(SHAPES) - 1
    assert [w for w in report.warnings if w.startswith(f"{len(SHAPES) - 1} tensors hold inf or NaN and were "
                                                       f"written anyway (--nonfinite warn): model.")]


def test_values_far_beyond_every_inputs_range_are_reported_with_the_key(m, abc, tmp_path):
    """Issue 30: finite values far outside the inputs' range (a method's blow-up) never pass silently."""
    with m.registry.scope():
        def blow_up(a):
            """A method that writes 3.4e38 into one key, as model_stock once did on 1x1 convolutions."""
            out = a.clone()
            if a.shape == (16, 24):
                out[0, 0] = torch.finfo(torch.float32).max
            return out

        register(m, blow_up, "a")
        recipe = m.recipe.call("blow_up", m.recipe.model(str(abc[0])))
        report = m.execute.merge(recipe, tmp_path / "fp32.safetensors", opts(m, dtype="fp32"))
        key = "model.diffusion_model.middle_block.1.proj_in.weight"
        assert [k for k, *_ in report.out_of_range] == [key]
        assert [w for w in report.warnings if w.startswith(
            f"1 tensors hold values far beyond every input's range: {key} reaches 3.4e+38 where its inputs ")]
        with pytest.raises(m.checks.NonFiniteError, match="proj_in.weight: the merged tensor holds inf or "
                                                          "NaN; the recipe made it"):  # inf in fp16
            m.execute.merge(recipe, tmp_path / "fp16.safetensors", opts(m))
    plain = m.execute.merge(m.recipe.weighted_sum(m.recipe.model(str(abc[0])), m.recipe.model(str(abc[1])),
                                                  alpha=3.0), tmp_path / "plain.safetensors", opts(m))
    assert plain.out_of_range == [] and not_family(plain.warnings) == []  # extrapolation 3x: within range


def not_family(warnings: list[str]) -> list[str]:
    """The warnings other than the note that these tiny files are of no known family."""
    return [w for w in warnings if "is of no known family" not in w]


def test_the_range_check_measures_whole_inputs_before_it_warns(m, tmp_path):
    """A sample of each input in memory (its first elements) only bounds its range from below: a key
    whose large values come later is measured whole, and merges without a warning."""
    paths = []
    for name in ("a", "b"):
        weight = torch.full((300, 300), 1e-4).half()
        weight[-1, -1] = 1.0  # past the first 65536 elements: the output reaches 1.0, 10000x the sample
        save_file({"model.diffusion_model.out.2.weight": weight}, str(tmp_path / f"{name}.safetensors"))
        paths.append(m.recipe.model(str(tmp_path / f"{name}.safetensors")))
    report = m.execute.merge(m.recipe.weighted_sum(*paths), tmp_path / "out.safetensors", opts(m))
    assert report.out_of_range == [] and not_family(report.warnings) == []


def test_nonfinite_values_of_an_input_file_are_blamed_on_that_file(m, abc, tmp_path):
    tensors = load_file(str(abc[1]))
    tensors["model.diffusion_model.out.2.weight"][3, 4] = float("nan")
    save_file(tensors, str(tmp_path / "nan.safetensors"))
    R = m.recipe
    recipe = R.weighted_sum(R.model(str(abc[0])), R.model(str(tmp_path / "nan.safetensors")), alpha=0.5)
    with pytest.raises(m.checks.NonFiniteError, match=r"out.2.weight: .* from the input file nan.safet"):
        m.execute.merge(recipe, tmp_path / "out.safetensors", opts(m))
    report = m.execute.merge(recipe, tmp_path / "out.safetensors", opts(m, nonfinite="warn"))
    assert report.nonfinite == ["model.diffusion_model.out.2.weight"]
    assert "at the first, it comes from the input file nan.safetensors" in report.warnings[-1]


WIDE = "model.diffusion_model.out.2.weight"  # 300 x 70 = 21000 elements: 329 slices of 64


@pytest.mark.parametrize("budget", [1024, 0], ids=["whole-keys", "sliced-units"])
@pytest.mark.parametrize("where", [0, 10_499, 20_999], ids=["first", "middle", "last"])
def test_elementwise_keys_are_checked_as_written_in_every_span_and_slice(m, tmp_path, budget, where):
    """An elementwise key's magnitude is measured by the evaluator as it writes each slice (merge/stream.py),
    so the writer thread needs no pass of its own: an fp16 overflow (finite in fp32, inf as written), a NaN
    and an out-of-range value are found wherever they sit (the first span, a worker's span, the last
    slice), in whole keys and in sliced units (memory budget 0), and the figures equal a whole-tensor pass."""
    def model(name, big):
        weight = torch.randn(300, 70, generator=torch.Generator().manual_seed(len(name))) * 0.01
        weight.view(-1)[where] = big
        save_file({WIDE: weight}, str(tmp_path / f"{name}.safetensors"))
        return m.recipe.model(str(tmp_path / f"{name}.safetensors"))

    small = dict(chunk_elements=64, workers=2, memory_budget_mb=budget)
    overflow = m.recipe.weighted_sum(model("a", 70000.0), model("bb", 70000.0), alpha=0.5)
    with pytest.raises(m.checks.NonFiniteError, match="out.2.weight: the merged tensor holds inf or NaN"):
        m.execute.merge(overflow, tmp_path / "fp16.safetensors", opts(m, **small))
    fp32 = m.execute.merge(overflow, tmp_path / "fp32.safetensors", opts(m, dtype="fp32", **small))
    assert fp32.nonfinite == [] and fp32.out_of_range == []  # 70000 is finite in fp32, and an input's value

    nan = m.recipe.weighted_sum(model("c", float("nan")), model("dd", 0.0), alpha=0.5)
    report = m.execute.merge(nan, tmp_path / "nan.safetensors", opts(m, nonfinite="warn", **small))
    assert report.nonfinite == [WIDE] and "from the input file c.safetensors" in report.nonfinite_origin

    far = m.recipe.weighted_sum(model("e", 0.0), model("ff", 5.0), alpha=1000.0)  # 5000 where inputs reach 5
    report = m.execute.merge(far, tmp_path / "far.safetensors", opts(m, **small))
    written = load_file(str(tmp_path / "far.safetensors"))[WIDE]
    assert [(k, size) for k, size, _ in report.out_of_range] == [(WIDE, m.checks.magnitude(written))]
    assert report.out_of_range[0][1] == pytest.approx(5000.0, rel=1e-3)


def test_the_evaluator_measures_what_it_wrote(m):
    """Evaluator.evaluate_chunked's magnitude equals a whole pass over the output as written (fp16 rounding
    included), for one span and for spans side by side; NaN wins wherever it is."""
    from patchbay_merge.context import KeyContext
    from patchbay_merge.executable import Call, CompiledRecipe, Leaf

    graph = CompiledRecipe(Call(m.registry.get("weighted_sum"), (Leaf(0), Leaf(1)), {"alpha": 0.25}), [])
    gen = torch.Generator().manual_seed(7)
    a, b = torch.randn(40_000, generator=gen).half() * 300, torch.randn(40_000, generator=gen).half() * 300
    for workers in (1, 2):
        evaluator = m.stream.Evaluator(graph, "refuse", workers=workers)
        try:
            for poison in (None, 123, 39_999):
                x = a.clone()
                if poison is not None:
                    x[poison] = float("nan")
                out = torch.empty(40_000, dtype=torch.float16)
                size = evaluator.evaluate_chunked(graph.root, [x, b], KeyContext(key="k"), out, 256)
                whole = m.checks.magnitude(out)
                assert (size == whole) or (size != size and whole != whole), (workers, poison, size, whole)
        finally:
            evaluator.close()


def test_memory_budget_spills_intermediates_and_gives_the_same_output(m, abc, tmp_path):
    R = m.recipe
    recipe = RECIPES["nested"](R, *(R.model(str(p)) for p in abc))
    roomy = m.execute.merge(recipe, tmp_path / "roomy.safetensors", opts(m))
    tight = m.execute.merge(recipe, tmp_path / "tight.safetensors", opts(m, memory_budget_mb=0))
    assert roomy.spilled_bytes == 0 and tight.spilled_bytes > 0
    roomy_out, tight_out = (load_file(str(tmp_path / n)) for n in ("roomy.safetensors", "tight.safetensors"))
    assert all(torch.equal(roomy_out[k], tight_out[k]) for k in roomy_out)


def test_lora_input_adds_its_delta(m, models, tmp_path):
    checkpoint = m.io.SafetensorsFile(models.checkpoints["patchbay-sd15-tiny-a"])
    base = tmp_path / "unet.safetensors"  # the UNet only, to keep the test fast
    save_file({k: checkpoint.read(k) for k in checkpoint.tensors if k.startswith("model.diffusion_model.")},
              str(base))
    lora = models.loras["patchbay-locon-r4"]
    R = m.recipe
    recipe = R.add_difference(R.model(str(base)), R.model(str(lora), space="delta"), alpha=1.0)
    out = tmp_path / "out.safetensors"
    m.execute.merge(recipe, out, opts(m, dtype="fp32"))
    from patchbay_merge import lora as mlora

    deltas = mlora.LoraSource(m.io.SafetensorsFile(lora), m.io.SafetensorsFile(base))
    merged, original = m.io.SafetensorsFile(out), m.io.SafetensorsFile(base)
    touched = deltas.keys()
    assert len(touched) == 115 and all(name.startswith("lora_te_") for name in deltas.unmapped)
    for key in touched[::10]:
        expected = original.read(key).float() + deltas.delta(key)
        torch.testing.assert_close(merged.read(key), expected, rtol=0, atol=1e-6)
    untouched = "model.diffusion_model.out.2.weight"
    assert untouched not in touched and torch.equal(merged.read(untouched), original.read(untouched).float())


@pytest.mark.parametrize("name", ["weighted_sum", "add_difference", "n_average"])
def test_keys_larger_than_the_read_arena_are_streamed_in_slices(m, abc, tmp_path, name):
    R = m.recipe
    recipe = RECIPES[name](R, *(R.model(str(p)) for p in abc))
    from patchbay_merge import executable, pipeline, plan

    graph = executable.compile_recipe(recipe)
    sources = graph.open_sources()
    plans = plan.plan_keys(graph, sources, opts(m), plan.MergeReport(path=tmp_path))
    units = list(pipeline.split_units(graph, sources, plans, opts(m, chunk_elements=4096), capacity=64))
    big = [u for u in units if u.plan.key == "model.diffusion_model.out.2.weight"]
    assert [(u.start, u.end) for u in big] == [(s, min(s + 4096, 21000)) for s in range(0, 21000, 4096)]
    assert all(u.sliced for u in units if not u.plan.key.endswith("position_ids"))
    whole = m.execute.merge(recipe, tmp_path / "whole.safetensors", opts(m))
    sliced = m.execute.merge(recipe, tmp_path / "sliced.safetensors", opts(m, memory_budget_mb=0,
                                                                         chunk_elements=4096))
    assert whole.keys == sliced.keys == len(SHAPES)
    assert (tmp_path / "whole.safetensors").read_bytes() == (tmp_path / "sliced.safetensors").read_bytes()


def test_method_caches_survive_across_merges_when_the_caller_keeps_them(m, abc, tmp_path):
    computed = []
    with m.registry.scope():
        def cached_scale(a, *, alpha: float = 1.0, ctx=None):
            """Scales a by alpha times a per-key constant it computes once."""
            if a.device.type == "meta":  # the executor traces non-float keys (position_ids) on meta
                return a
            if "norm" not in ctx.cache:
                computed.append(ctx.key)
                ctx.cache["norm"] = 2.0
            return a * alpha * ctx.cache["norm"]

        cached_scale.__annotations__ = {"a": m.registry.Weight, "alpha": float, "return": m.registry.Weight,
                                        "ctx": m.registry.KeyContext}
        m.registry.merge_method(cached_scale)
        cache: dict = {}
        for alpha in (0.5, 0.25):
            recipe = m.recipe.call("cached_scale", m.recipe.model(str(abc[0])), alpha=alpha)
            m.execute.merge(recipe, tmp_path / f"{alpha}.safetensors", *run(m, dtype="fp32", cache=cache))
        m.execute.merge(recipe, tmp_path / "fresh.safetensors", opts(m, dtype="fp32"))
    floats = len(SHAPES) - 1
    assert len(computed) == 2 * floats  # once per key with the kept cache, once more without it
    key = "model.diffusion_model.out.2.weight"
    expected = load_file(str(abc[0]))[key].float() * 0.5
    assert torch.equal(load_file(str(tmp_path / "0.25.safetensors"))[key], expected)


def test_component_picking_and_fallback_drop_and_fill_keys(m, tmp_path):
    probe = "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight"
    a = make_model(tmp_path / "a.safetensors", 1, {**SHAPES, probe: (8, 768)})
    partial = {k: v for k, v in SHAPES.items() if not k.endswith("bias")}
    b = make_model(tmp_path / "b.safetensors", 2, {**partial, probe: (8, 768)})
    R = m.recipe
    unet = m.execute.merge(R.pick_component(R.model(str(a)), component="diffuser"),
                           tmp_path / "unet.safetensors", opts(m))
    kept = load_file(str(tmp_path / "unet.safetensors"))
    assert unet.arch == "sd15" and set(kept) == {k for k in (*SHAPES, probe) if k.startswith("model.")}
    m.execute.merge(R.omit_component(R.model(str(a)), component="diffuser"), tmp_path / "rest.safetensors",
                    opts(m))
    rest = load_file(str(tmp_path / "rest.safetensors"))
    assert set(rest) == {k for k in SHAPES if not k.startswith("model.")}  # int position_ids kept too
    m.execute.merge(R.fallback(R.model(str(b)), R.model(str(a))), tmp_path / "filled.safetensors", opts(m))
    filled, original = load_file(str(tmp_path / "filled.safetensors")), load_file(str(a))
    bias = "model.diffusion_model.input_blocks.0.0.bias"
    assert torch.equal(filled[bias], original[bias]) and len(filled) == len(SHAPES) + 1


ELEMENTWISE = ("weighted_sum", "add_difference", "n_average", "mask_param")


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_two_workers_write_the_bytes_one_writes(m, abc, tmp_path, name):
    """At chunk_elements=256 the (300, 70) key has 83 slices: two spans, one per worker thread."""
    R = m.recipe
    recipe = RECIPES[name](R, *(R.model(str(p)) for p in abc))
    outs = []
    for workers in (1, 2):
        outs.append(tmp_path / f"out-{workers}.safetensors")
        m.execute.merge(recipe, outs[-1], opts(m, chunk_elements=256, workers=workers))
    assert outs[0].read_bytes() == outs[1].read_bytes()


def spans_recipe(m, abc, fn):
    """``fn(a, b, *, ctx)`` registered as an elementwise method (evaluated slice by slice, so in spans)."""
    from patchbay_merge.context import KeyContext

    fn.__annotations__ = {"a": m.registry.Weight, "b": m.registry.Weight, "ctx": KeyContext,
                          "return": m.registry.Weight}
    m.registry.merge_method(fn, elementwise=True)
    return m.recipe.call(fn.__name__, m.recipe.model(str(abc[0])), m.recipe.model(str(abc[1])))


def test_a_large_key_is_evaluated_in_two_threads_and_small_keys_in_one(m, abc, tmp_path):
    import threading

    seen: dict[str, set] = {}
    with m.registry.scope():
        def where(a, b, *, ctx):
            """Records the threads that evaluate each key."""
            if a.device.type != "meta":
                seen.setdefault(ctx.key, set()).add(threading.current_thread().name)
            return a

        recipe = spans_recipe(m, abc, where)
        m.execute.merge(recipe, tmp_path / "out.safetensors", opts(m, chunk_elements=256, workers=2))
    large = "model.diffusion_model.out.2.weight"
    assert seen.pop(large) == {"MainThread", "patchbay-merge-math_0"}
    assert seen and all(threads == {"MainThread"} for threads in seen.values()), seen


@pytest.mark.parametrize("exception", [RuntimeError, KeyboardInterrupt])
def test_an_error_in_the_second_span_stops_the_merge_and_leaves_no_file(m, abc, tmp_path, exception):
    import threading

    with m.registry.scope():
        def fails_off_the_calling_thread(a, b, *, ctx):
            """Fails in a span worker."""
            if a.device.type != "meta" and threading.current_thread().name.startswith("patchbay-merge-math"):
                raise exception("boom in a span")
            return a

        recipe = spans_recipe(m, abc, fails_off_the_calling_thread)
        expected = m.stream.MethodError if exception is RuntimeError else exception
        with pytest.raises(expected, match=r"out\.2\.weight: fails_off_the_calling_thread\(\) failed: boom"
                           if expected is m.stream.MethodError else "boom in a span"):
            m.execute.merge(recipe, tmp_path / "out.safetensors", opts(m, chunk_elements=256, workers=2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors", "b.safetensors", "c.safetensors"]


def test_an_interrupt_checked_in_a_span_worker_stops_the_merge(m, abc, tmp_path):
    """``MergeRuntime.check`` (ComfyUI's interrupt) runs in the span workers too."""
    import threading

    class Stop(Exception):
        pass

    def check():
        if threading.current_thread().name.startswith("patchbay-merge-math"):
            raise Stop("interrupted")

    shapes = {**SHAPES, "model.diffusion_model.out.2.weight": (640, 640)}  # 200 slices per span
    paths = [make_model(tmp_path / f"{n}.safetensors", seed, shapes) for n, seed in (("a", 1), ("b", 2))]
    recipe = m.recipe.weighted_sum(*(m.recipe.model(str(p)) for p in paths), alpha=0.5)
    with pytest.raises(Stop, match="interrupted"):
        m.execute.merge(recipe, tmp_path / "out.safetensors", *run(m, chunk_elements=1024, workers=2,
                                                                  check=check))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors", "b.safetensors", "c.safetensors"]
