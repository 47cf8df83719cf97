"""T0: the sd-mecha 1.1.8 built-ins that are more than one tensor in, one out for the same key.

The methods that read other keys than the one they evaluate (``related=``, merge/method_registry.py):
exchange_ema and balance_attention give sd-mecha's numbers, keep what they must keep through the
streaming executor (one attention head's logits and output, every key outside their reach), refuse the
families they do not know, and read and write as sd-mecha's .mecha text names them. get_rank_from_ratio
gives one int per key, which only an int parameter takes. And every built-in sd-mecha registers is
ours, or refused with a remedy when a .mecha file names it."""

from __future__ import annotations

import os

import pytest
import torch
from bench_merge import SilentProgress as _NoBar  # a tqdm that prints nothing
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.t0

sd_mecha = pytest.importorskip("sd_mecha")
from sd_mecha.extensions import merge_methods as sdm_methods  # noqa: E402
from sd_mecha.extensions.builtin.merge_methods import balance_attention as sdm_balance  # noqa: E402
from sd_mecha.extensions.builtin.merge_methods import ema as sdm_ema  # noqa: E402


def t(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def run_sd_mecha(node, dtype=torch.float32, space="weight") -> dict:
    out: dict = {}
    sd_mecha.merge(node, output=out, merge_dtype=dtype, output_dtype=torch.float32, merge_device="cpu",
                   output_device="cpu", threads=0, tqdm=_NoBar, check_extra_keys=False,
                   strict_mandatory_keys=False, strict_merge_space=space)
    return out


def ours(name: str, state: dict, arch: str) -> dict:
    """Our method on every key of ``state``, each given the keys its ``related`` names."""
    from patchbay_merge import method_registry as registry
    from patchbay_merge.context import KeyContext

    method, keys = registry.get(name), frozenset(state)
    return {key: method.fn({k: state[k] for k in method.related(key, arch, keys)},
                           ctx=KeyContext(key=key, arch=arch)) for key in state}


UNET = "model.diffusion_model.input_blocks.4.1.transformer_blocks.0.attn1"
CLIP_L = "conditioner.embedders.0.transformer.text_model.encoder.layers.0.self_attn"
CLIP_G = "conditioner.embedders.1.model.transformer.resblocks.0.attn"
VAE = "first_stage_model.decoder.mid.attn_1"
W = 128  # two 64-channel heads


def sdxl_attention() -> dict:
    state = {f"{UNET}.to_{p}.weight": t(W, W, seed=10 + i) for i, p in enumerate("qkv")}
    state |= {f"{UNET}.to_out.0.weight": t(W, W, seed=13), f"{UNET}.to_out.0.bias": t(W, seed=14)}
    for i, p in enumerate(("q", "k", "v", "out")):
        state |= {f"{CLIP_L}.{p}_proj.weight": t(W, W, seed=20 + i),
                  f"{CLIP_L}.{p}_proj.bias": t(W, seed=30 + i)}
    state |= {f"{CLIP_G}.in_proj_weight": t(3 * W, W, seed=40), f"{CLIP_G}.in_proj_bias": t(3 * W, seed=41),
              f"{CLIP_G}.out_proj.weight": t(W, W, seed=42), f"{CLIP_G}.out_proj.bias": t(W, seed=43)}
    return state


def test_balance_attention_gives_sd_mecha_numbers_on_sdxl_unet_clip_l_and_clip_g():
    """sd-mecha runs in fp64 here, as ours does inside: in fp32 its eigendecompositions are ~1.3e-5 off the
    fp64 result on these matrices (ours would differ from it by as much, in the other direction)."""
    state = sdxl_attention()
    theirs = run_sd_mecha(sdm_balance(sd_mecha.model(state, config="sdxl-sgm")), torch.float64)
    got = ours("balance_attention", state, "sdxl")
    assert set(theirs) == set(got) == set(state)
    for key, value in got.items():
        assert value.shape == state[key].shape
        assert torch.allclose(value, theirs[key], atol=1e-5, rtol=1e-5), key
    changed = {k for k in state if not torch.equal(got[k], state[k])}
    assert changed == {k for k in state if not k.endswith(("out.0.bias", "out_proj.bias"))}


def test_exchange_ema_gives_sd_mecha_numbers_on_sd1():
    """sd-mecha's public merge of exchange_ema fails in 1.1.8 (its implementation reads a key its key map
    never asked for, next test), so its implementation function runs here on the same state dict."""
    unet = "model.diffusion_model.input_blocks.1.1.proj_in.weight"
    state = {unet: t(4, 4, seed=1), "model_ema.diffusion_modelinput_blocks11proj_inweight": t(4, 4, seed=2),
             "model_ema.decay": torch.tensor(0.999),
             "cond_stage_model.transformer.text_model.final_layer_norm.weight": t(4, seed=3)}
    impl = sdm_methods.resolve("exchange_ema_'sd1-ldm'").__wrapped__
    view = type("StateDict", (dict,), {"model_config": sd_mecha.extensions.model_configs.resolve("sd1-ldm")})
    got = ours("exchange_ema", state, "sd15")
    for key in state:
        assert torch.equal(got[key], impl(view(state), key=key)), key
    assert torch.equal(got[unet], state["model_ema.diffusion_modelinput_blocks11proj_inweight"])


def test_sd_mecha_exchange_ema_merge_is_broken_in_1_1_8():
    state = {"model.diffusion_model.input_blocks.1.1.proj_in.weight": t(4, 4, seed=1),
             "model_ema.diffusion_modelinput_blocks11proj_inweight": t(4, 4, seed=2)}
    with pytest.raises(AssertionError, match="input_keys_for_output"):
        run_sd_mecha(sdm_ema.exchange_ema(sd_mecha.model(state, config="sd1-ldm")))


def test_our_ema_names_are_those_of_sd_mechas_sd1_config():
    from patchbay_merge.methods.ema import ema_key

    config = sd_mecha.extensions.model_configs.resolve("sd1-ldm").keys()
    unet = [k for k in config if k.startswith("model.diffusion_model.")]
    theirs = sdm_ema.to_ema_key_fns["sd1-ldm"]
    assert unet and all(ema_key(k) == theirs(k) and ema_key(k) in config for k in unet)


# ---- through the streaming executor, on an SD 1.5 file ----------------------------------------------------

ATTN = "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1"
TEXT = "cond_stage_model.transformer.text_model.encoder.layers.0.self_attn"
PROBE = "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight"  # detects sd15
EMA_SOURCE = "model.diffusion_model.out.2.weight"


def sd15_file(path, seed):
    inner = 16  # 8 heads of 2 channels (SD 1.x), so 64-channel blocks would mix heads
    state = {PROBE: t(8, 768, seed=seed), EMA_SOURCE: t(4, 8, seed=seed + 1),
             "model_ema.diffusion_modelout2weight": t(4, 8, seed=seed + 2),
             "model_ema.decay": torch.tensor(0.9),
             **{f"{ATTN}.to_{p}.weight": t(inner, 8, seed=seed + 3 + i) for i, p in enumerate("qkv")},
             f"{ATTN}.to_out.0.weight": t(8, inner, seed=seed + 6), f"{ATTN}.to_out.0.bias": t(8, seed=seed)}
    for i, p in enumerate(("q", "k", "v", "out")):
        state |= {f"{TEXT}.{p}_proj.weight": t(64, 64, seed=seed + 10 + i),
                  f"{TEXT}.{p}_proj.bias": t(64, seed=seed + 20 + i)}
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return path


@pytest.fixture(scope="module")
def m():
    from patchbay_merge import execute, recipe

    return type("M", (), {"execute": execute, "R": recipe})


def merged(m, recipe, out):
    m.execute.merge(recipe, out, m.execute.MergeOptions(dtype="fp32", progress=False, fsync=False))
    return load_file(str(out))


def heads(sd, stem, part, size):
    """[heads, size, in (+ 1)]: q, k or v's rows per head, its bias (if any) as one more column; for the
    out projection its columns per head."""
    if part == "out":
        out = "to_out.0.weight" if stem == ATTN else "out_proj.weight"
        return sd[f"{stem}.{out}"].T.unflatten(0, (-1, size))
    weight = sd[f"{stem}.to_{part}.weight" if stem == ATTN else f"{stem}.{part}_proj.weight"]
    if stem != ATTN:
        weight = torch.cat([weight, sd[f"{stem}.{part}_proj.bias"][:, None]], dim=1)
    return weight.unflatten(0, (-1, size))


def test_balance_attention_keeps_each_heads_logits_and_output(m, tmp_path):
    a, b = sd15_file(tmp_path / "a.safetensors", 1), sd15_file(tmp_path / "b.safetensors", 50)
    mix = m.R.weighted_sum(m.R.model(str(a)), m.R.model(str(b)), alpha=0.25)
    before = merged(m, mix, tmp_path / "mix.safetensors")
    after = merged(m, m.R.balance_attention(mix), tmp_path / "balanced.safetensors")
    for stem, size in ((ATTN, 2), (TEXT, 64)):  # SD 1.x UNet: 8 heads of 2 here; CLIP-L: 64-channel heads
        for first, second in (("q", "k"), ("v", "out")):  # per head: the logits' q^T k, the output's o v
            products = [heads(sd, stem, first, size).mT @ heads(sd, stem, second, size)
                        for sd in (before, after)]
            assert torch.allclose(*products, atol=1e-4, rtol=1e-4), (stem, first)
        assert not torch.allclose(heads(after, stem, "q", size), heads(before, stem, "q", size), atol=1e-2)
    untouched = [k for k in before if not k.startswith((ATTN, TEXT)) or k.endswith("out.0.bias")]
    assert all(torch.equal(after[k], before[k]) for k in untouched)


def test_exchange_ema_swaps_each_unet_weight_with_its_copy(m, tmp_path):
    a = sd15_file(tmp_path / "a.safetensors", 1)
    source = load_file(str(a))
    out = merged(m, m.R.exchange_ema(m.R.model(str(a))), tmp_path / "ema.safetensors")
    copy = "model_ema.diffusion_modelout2weight"
    assert torch.equal(out[EMA_SOURCE], source[copy]) and torch.equal(out[copy], source[EMA_SOURCE])
    assert all(torch.equal(out[k], source[k]) for k in source if k not in (EMA_SOURCE, copy))


def test_lora_extraction_reads_the_other_keys_too(tmp_path):
    """merge/extract.py evaluates key by key with its own evaluator: it hands it the sources as well."""
    from patchbay_merge import extract
    from patchbay_merge import recipe as R

    a = R.model(str(sd15_file(tmp_path / "a.safetensors", 1)))
    report = extract.extract_lora(R.subtract(R.balance_attention(a), a), tmp_path / "lora.safetensors",
                                  extract.ExtractOptions(rank=4))
    assert len(report.ranks) == 8 and all("attn1" in name or "self_attn" in name for name in report.ranks)


@pytest.mark.parametrize("method", ["balance_attention", "exchange_ema"])
def test_other_families_are_refused_with_the_supported_ones(m, tmp_path, method):
    import tiny_families as tf

    path = tf.write(tmp_path / "flux.safetensors", "flux")
    with pytest.raises(ValueError, match=r"(sd15|sd2).*not of 'flux'.*leave it out"):
        m.execute.merge(m.R.call(method, m.R.model(str(path))), tmp_path / "out.safetensors",
                        m.execute.MergeOptions(progress=False, fsync=False))
    assert not os.path.exists(tmp_path / "out.safetensors")


def test_related_and_group_inputs_are_declared_together():
    from patchbay_merge import method_registry as registry

    def plain(a):
        """Doc."""

    def grouped(a):
        """Doc."""

    plain.__annotations__ = {"a": registry.Weight, "return": registry.Weight}  # this module postpones them
    grouped.__annotations__ = {"a": registry.WeightGroup, "return": registry.Weight}

    with registry.scope():
        with pytest.raises(registry.MethodDefinitionError, match="annotate every tensor input WeightGroup"):
            registry.merge_method(plain, related=lambda key, arch, keys: (key,))
        with pytest.raises(registry.MethodDefinitionError, match="need related="):
            registry.merge_method(grouped)
        with pytest.raises(registry.MethodDefinitionError, match="cannot be elementwise"):
            registry.merge_method(grouped, related=lambda key, arch, keys: (key,), elementwise=True)


def test_sd_mecha_text_names_the_implementation_and_reads_back_as_the_method(tmp_path):
    from patchbay_merge import mecha_text
    from patchbay_merge import recipe as R

    save_file({"model.diffusion_model.out.2.weight": torch.zeros(2)}, str(tmp_path / "x.safetensors"))
    x = sd_mecha.model(str(tmp_path / "x.safetensors"), config="sdxl-sgm")
    y = sd_mecha.model(str(tmp_path / "x.safetensors"), config="sd1-ldm")
    for theirs, name, config in ((sdm_balance(x), "balance_attention", "sdxl-sgm"),
                                 (sdm_ema.exchange_ema(y), "exchange_ema", "sd1-ldm")):
        text = sd_mecha.serialize(theirs, finalize=False)
        expected = R.call(name, R.model(str(tmp_path / "x.safetensors"), config=config))
        assert mecha_text.parse(text) == expected, text
        ours_text = mecha_text.dumps(expected)
        assert mecha_text.parse(ours_text) == expected
        read_back = sd_mecha.serialize(sd_mecha.deserialize(ours_text), finalize=False)
        assert mecha_text.parse(read_back) == expected


def test_every_sd_mecha_builtin_a_recipe_can_name_is_ours_or_refused_with_a_remedy():
    """sd-mecha 1.1.8's registry, name by name: its method, the per-model implementation it dispatches to
    (read as ours), a format conversion (merge/mecha_text.py reads those), or one we left out, which
    parse refuses with what to write instead."""
    from patchbay_merge import mecha_text
    from patchbay_merge import method_registry as registry

    ours_names = {m.name for m in registry.all_methods()}
    left_out = set()
    for method in sdm_methods.get_all():
        name = method.identifier
        if name.startswith("convert_"):
            continue
        if any(pattern.fullmatch(name) for pattern, _ in mecha_text.LEFT_OUT):
            left_out.add(name)
            with pytest.raises(mecha_text.MechaSyntaxError, match="not a Patchbay method; .* "):
                mecha_text.parse(f'version 0.1.0\nmodel "x.safetensors"\nmerge "{name}" &0')
        else:
            assert mecha_text.IMPLEMENTATIONS.get(name, name) in ours_names, name
    assert {"get_dtype", "get_device", "rebasin", "randperm", "extract_kohya_lora", "extract_lycoris_lokr"
            } <= left_out and "get_rank_from_ratio" not in left_out


def test_get_rank_from_ratio_feeds_truncate_rank_as_sd_mecha_does(m, tmp_path):
    """sd-mecha's text of truncate_rank(d, rank=get_rank_from_ratio(d, 0.4)) merges here to its numbers."""
    from patchbay_merge import mecha_text
    from sd_mecha.extensions.builtin.merge_methods import linear, svd

    a, b = (t(12, 9, seed=s) for s in (1, 2))
    paths = [tmp_path / f"{n}.safetensors" for n in "ab"]
    for path, tensor in zip(paths, (a, b), strict=True):
        save_file({"model.diffusion_model.out.2.weight": tensor, PROBE: t(8, 768, seed=3)}, str(path))
    x, y = (sd_mecha.model(str(p), config="sd1-ldm") for p in paths)

    def recipe(x, y):
        delta = linear.subtract(y, x)
        return svd.truncate_rank(delta, rank=svd.get_rank_from_ratio(delta, 0.4), use_approximate_basis=False)

    ours_recipe = mecha_text.parse(sd_mecha.serialize(recipe(x, y), finalize=False))
    assert mecha_text.parse(mecha_text.dumps(ours_recipe)) == ours_recipe
    got = merged(m, ours_recipe, tmp_path / "out.safetensors")["model.diffusion_model.out.2.weight"]
    theirs = run_sd_mecha(recipe(*(sd_mecha.model({"k": v}) for v in (a, b))), space="delta")["k"]
    assert torch.linalg.matrix_rank(got) == round(9 * 0.4)
    assert torch.allclose(got, theirs, atol=1e-5, rtol=1e-5)
    for shape in ((12, 9), (4, 6, 3, 3), (7,), ()):
        for ratio in (0.0, 0.3, 0.5, 1.0, 2.0):
            tensor = torch.zeros(shape)
            theirs_rank = svd.get_rank_from_ratio.__wrapped__(tensor, ratio)
            assert ours_rank(tensor, ratio) == theirs_rank, (shape, ratio)


def ours_rank(tensor, ratio):
    from patchbay_merge import method_registry as registry

    return registry.get("get_rank_from_ratio").fn(tensor, ratio=ratio, ctx=None)


def test_one_value_per_key_is_no_tensor_and_fits_only_its_type():
    from patchbay_merge import recipe as R

    d = R.subtract(R.model("a.safetensors"), R.model("b.safetensors"))
    rank = R.get_rank_from_ratio(d, ratio=0.25)
    R.validate(R.truncate_rank(d, rank=rank))
    with pytest.raises(R.RecipeError, match=r"weighted_sum.a: get_rank_from_ratio gives one int per key"):
        R.weighted_sum(rank, d)
    with pytest.raises(R.RecipeError, match="not a tensor: pass it to such a parameter"):
        R.validate(rank)
    with pytest.raises(R.RecipeError, match="cast.dtype: get_rank_from_ratio gives one int per key, but"):
        R.cast(d, dtype=rank)
