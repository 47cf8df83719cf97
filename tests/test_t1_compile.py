"""T1: torch.compile (CPU) with LoRAs: what weight_patch_first fixes, and no recompiles.

The tiny UNet is compiled once for the module and installed the way KJNodes-era workflows did it:
``model.add_object_patch("diffusion_model", torch.compile(...))``. A counting backend wraps dynamo's
eager backend, so every graph dynamo captures is seen. Sampling is 2 euler steps on an 8x8 latent. The
UNet runs PyTorch attention as on a GPU (``with_pytorch_attention``): one graph.

The eager backend on every version: what is tested here (whether the compiled UNet sees the weights
ComfyUI patched, and which graphs dynamo captures and guards on) is dynamo's, and inductor reads
parameters at run time as eager does (no freezing in inference). Inductor's code generation is tested
where the pack's own code runs inside the graphs (tests/test_t1_compile_hooks.py); here it cost 60 s of
a fresh machine's T1 for a graph of core's UNet alone.
"""

from __future__ import annotations

import importlib
import types

import pytest
import torch
from compile_attention import with_pytorch_attention

pytestmark = pytest.mark.t1

CKPT = "patchbay-sd15-tiny-a.safetensors"
LORA = "patchbay-lora-r4.safetensors"


@pytest.fixture(scope="module")
def run(comfy):
    import comfy.model_management as mm
    from torch._dynamo.utils import counters

    n = comfy.nodes.NODE_CLASS_MAPPINGS
    model, clip, _vae = n["CheckpointLoaderSimple"]().load_checkpoint(CKPT)
    model = with_pytorch_attention(model)
    (lora,) = n["LoraLoaderModelOnly"]().load_lora_model_only(model, LORA, 1.0)
    (positive,) = n["CLIPTextEncode"]().encode(clip, "a knight in armor")
    (negative,) = n["CLIPTextEncode"]().encode(clip, "blurry")
    (latent,) = n["EmptyLatentImage"]().generate(64, 64, 1)
    graphs: list[int] = []

    backend = torch._dynamo.lookup_backend("eager")

    def counting_backend(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(len(gm.graph.nodes))
        return backend(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(model.get_model_object("diffusion_model"), backend=counting_backend,
                             dynamic=False)

    def sample(patcher, seed: int = 1, pos=positive, neg=negative) -> torch.Tensor:
        mm.unload_all_models()  # every run loads its model afresh
        (out,) = n["KSampler"]().sample(patcher, seed, 2, 7.0, "euler", "normal", pos, neg, latent)
        return out["samples"]

    def with_compiled_unet(patcher):
        clone = patcher.clone()
        clone.add_object_patch("diffusion_model", compiled)
        return clone

    def compilations() -> tuple[int, int]:
        return len(graphs), counters["stats"]["unique_graphs"]

    mp = importlib.import_module(f"{comfy.pack.__name__}.patcher.model_patcher")
    plain, with_lora = sample(model), sample(lora)
    compiled_lora = sample(with_compiled_unet(mp.set_patch_order(lora, "weight_patch_first")))  # compiles
    yield types.SimpleNamespace(
        n=n, model=model, lora=lora, positive=positive, negative=negative, sample=sample,
        with_compiled_unet=with_compiled_unet, compilations=compilations, first_compile=compilations(),
        mp=mp, plain=plain, with_lora=with_lora, compiled_lora=compiled_lora)
    mm.unload_all_models()
    torch._dynamo.reset()


def close_to(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    atol = 1e-3 * expected.abs().max().item()
    return torch.allclose(actual, expected, rtol=1e-3, atol=atol)


def test_weight_patch_first_lora_on_compiled_unet_matches_uncompiled(run):
    assert not close_to(run.with_lora, run.plain), "the LoRA has no visible effect on the tiny model"
    assert run.first_compile[0] > 0, "the compiled UNet never ran"
    torch.testing.assert_close(run.compiled_lora, run.with_lora, rtol=1e-3,
                               atol=1e-3 * run.with_lora.abs().max().item())


def test_core_order_silently_drops_the_lora_on_compiled_unet(run):
    """ComfyUI 0.3.75 still has the bug: loading walks the compiled module's ``_orig_mod.`` names."""
    out = run.sample(run.with_compiled_unet(run.lora))
    assert close_to(out, run.plain) and not close_to(out, run.with_lora)
    ours = run.sample(run.with_compiled_unet(run.mp.set_patch_order(run.lora, "object_patch_first")))
    assert close_to(ours, run.plain)


def test_lora_hook_on_compiled_unet(run):
    """Hooks patch weights during sampling: weight_patch_first lets them reach the compiled UNet too
    (a hook on both prompts equals LoraLoader)."""
    n = run.n
    (hooks,) = n["CreateHookLora"]().create_hook(LORA, 1.0, 1.0)
    (pos,) = n["ConditioningSetProperties"]().set_properties(run.positive, 1.0, "default", hooks=hooks)
    (neg,) = n["ConditioningSetProperties"]().set_properties(run.negative, 1.0, "default", hooks=hooks)
    core = run.sample(run.with_compiled_unet(run.model), pos=pos, neg=neg)
    assert close_to(core, run.plain), "core now applies hooks through a compiled object patch"
    ours = run.with_compiled_unet(run.mp.set_patch_order(run.model, "weight_patch_first"))
    assert close_to(run.sample(ours, pos=pos, neg=neg), run.with_lora)


def test_new_seed_does_not_recompile(run):
    ours = run.with_compiled_unet(run.mp.set_patch_order(run.lora, "weight_patch_first"))
    second = run.sample(ours, seed=2)
    assert not torch.equal(run.compiled_lora, second)
    assert run.compilations() == run.first_compile, "the backend compiled again"


def test_no_recompile_across_orders_and_hooks(run):
    """Runs after the others (file order): the core order, a hook, a new seed reused the first graphs."""
    assert run.compilations() == run.first_compile, "the backend compiled again"


def test_hook_engine_on_compiled_unet_leaves_hooks_to_core(run, caplog):
    """torch.compile'd graphs do not see forward hooks added after compiling (dynamo skips hook guards),
    so on a compiled model the engine hands every hook to core's path, which weight_patch_first makes
    reach the compiled UNet; the result equals LoraLoader and a new seed compiles nothing."""
    import logging

    he = importlib.import_module(run.mp.__name__.rsplit(".", 2)[0] + ".hooks.enable")
    n = run.n
    (hooks,) = n["CreateHookLora"]().create_hook(LORA, 1.0, 1.0)
    (pos,) = n["ConditioningSetProperties"]().set_properties(run.positive, 1.0, "default", hooks=hooks)
    (neg,) = n["ConditioningSetProperties"]().set_properties(run.negative, 1.0, "default", hooks=hooks)
    ordered = run.mp.set_patch_order(run.model, "weight_patch_first")
    fast = run.with_compiled_unet(he.enable_hook_engine(ordered))
    before = run.compilations()
    with caplog.at_level(logging.DEBUG, logger="patchbay.hooks"):
        assert close_to(run.sample(fast, pos=pos, neg=neg), run.with_lora)
    assert "compiled with torch.compile" in caplog.text
    # The UNet's forward looks up transformer_options["wrappers"], which dynamo guards as empty in the
    # first graphs: the engine's sampling wrappers make that guard fail once (any pack's wrapper
    # does), a single new graph; after it no hooked run compiles.
    first = run.compilations()
    assert first[0] - before[0] <= 1 and first[1] - before[1] <= 1, "the hooked run compiled more than once"
    assert close_to(run.sample(fast, seed=2, pos=pos, neg=neg), run.sample(run.lora, seed=2))
    assert run.compilations() == first, "the second hooked run compiled again"
