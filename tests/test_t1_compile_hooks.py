"""T1: Fast Hooks on a model compiled by ComfyUI's TorchCompileModel node (CPU; inductor on one ComfyUI
version, dynamo's eager backend on the others: the ``compile_backend`` fixture).

The same TorchCompileModel patcher first samples without hooks, so core's plain graphs exist before
any hook does (the case where dynamo would run a graph without a forward hook added later). Then
Fast Hooks runs a LoRA hook on every prompt, scheduled hooks and two regional LoRAs on it: the hooked
graphs' code holds the delta math (torch's ``graph_code`` log), the latents equal the uncompiled
Fast Hooks run (and LoraLoader) within 1e-3 of the LoRA's effect, and a new seed, new keyframes or
another pair of LoRAs compile nothing (dynamo's ``unique_graphs`` counter, as tests/test_t1_compile.py
counts). Every run samples the same two masked regions and a negative prompt (3 cond chunks), 2 euler
steps on an 8x8 latent: a new batch size or step count compiles again, with or without hooks
(ComfyUI's ``sample_sigmas`` is guarded too). The compiled model runs PyTorch attention, as on a GPU:
one graph (``with_pytorch_attention``).

Cost on 2 CPU cores (measured with a warm inductor cache on a loaded machine, in-process CPU time):
core's plain graph ~22 s, the hooked graph ~70 s (dynamic ranks make inductor work harder), every
later run well under a few seconds.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from compile_attention import with_pytorch_attention

pytestmark = pytest.mark.t1

CKPT = "patchbay-sd15-tiny-a.safetensors"
LORA_A = "patchbay-lora-r4.safetensors"
LORA_B = "patchbay-lora-r16.safetensors"
STEPS = 2
GRAPH_CODE_LOG = "torch._dynamo.output_graph.__graph_code"  # torch's "graph_code" log artifact


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.text: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.text.append(record.getMessage())


def graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


class Rig:
    def __init__(self, comfy, backend: str):
        self.n = n = comfy.nodes.NODE_CLASS_MAPPINGS
        self.he = comfy.pack.hooks.enable
        self.model, clip, _vae = n["CheckpointLoaderSimple"]().load_checkpoint(CKPT)
        texts = ("a knight in armor", "blurry", "a red castle", "a green forest")
        self.pos, self.neg, self.left, self.right = (n["CLIPTextEncode"]().encode(clip, t)[0] for t in texts)
        (self.latent,) = n["EmptyLatentImage"]().generate(64, 64, 1)
        self.backend = backend
        self.compiled = n["TorchCompileModel"].execute(with_pytorch_attention(self.model), backend)[0]
        self.fast = self.he.enable_hook_engine(self.compiled)  # Fast Hooks after TorchCompileModel
        self.eager = self.he.enable_hook_engine(self.model)

    def sample(self, model, pos=None, neg=None, seed: int = 1) -> torch.Tensor:
        import comfy.model_management as mm

        mm.unload_all_models()
        (out,) = self.n["KSampler"]().sample(model, seed, STEPS, 7.0, "euler", "normal",
                                             self.regions() if pos is None else pos,
                                             self.neg if neg is None else neg, self.latent)
        return out["samples"]

    def hook(self, lora: str, schedule=None):
        (hooks,) = self.n["CreateHookLora"]().create_hook(lora, 1.0, 1.0)
        return hooks if schedule is None else self.keyframes(hooks, schedule)

    def keyframes(self, hooks, schedule):
        (kf,) = self.n["CreateHookKeyframesFromFloats"]().create_hook_keyframes(list(schedule), 0.0, 1.0)
        return self.n["SetHookKeyframes"]().set_hook_keyframes(hooks, kf)[0]

    def on(self, cond, hooks, mask=None):
        props = self.n["ConditioningSetProperties"]()
        return props.set_properties(cond, 1.0, "default", mask=mask, hooks=hooks)[0]

    def regions(self, hooks_left=None, hooks_right=None):
        """Two prompts on the left and right halves, each with its hooks (or none)."""
        left = torch.zeros((1, 64, 64))
        left[:, :, :32] = 1.0
        a, b = self.on(self.left, hooks_left, left), self.on(self.right, hooks_right, 1.0 - left)
        return self.n["ConditioningCombine"]().combine(a, b)[0]

    def everywhere(self, hooks):
        """(positive, negative) with ``hooks`` on every prompt: what LoraLoader computes."""
        return self.regions(hooks, hooks), self.on(self.neg, hooks)


@pytest.fixture(scope="module")
def rig(comfy, compile_backend):
    import comfy.model_management as mm

    torch._dynamo.reset()
    rig = Rig(comfy, compile_backend)
    rig.plain = rig.sample(rig.model)
    (lora,) = rig.n["LoraLoaderModelOnly"]().load_lora_model_only(rig.model, LORA_A, 1.0)
    # before compiling: unpatching leaves requires_grad=False weights, which an earlier graph guards on
    rig.with_lora = rig.sample(lora)
    rig.effect = (rig.with_lora - rig.plain).abs().max().item()
    rig.plain_compiled = rig.sample(rig.compiled)  # core's graph, compiled before any hook exists
    rig.graphs_plain = graphs()
    rig.hook_a = rig.hook(LORA_A)
    with graph_code_lines() as code:
        rig.lora = rig.sample(rig.fast, *rig.everywhere(rig.hook_a))
    rig.graph_code, rig.graphs_lora = code, graphs()
    yield rig
    mm.unload_all_models()
    torch._dynamo.reset()


@contextlib.contextmanager
def graph_code_lines():
    """The code of every graph dynamo compiles meanwhile (torch's ``graph_code`` log), as a list."""
    handler = _Lines()
    logger = logging.getLogger(GRAPH_CODE_LOG)
    torch._logging.set_logs(graph_code=True)
    logger.addHandler(handler)
    try:
        yield handler.text
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()


def assert_within_lora_effect(rig, actual, expected, what: str) -> None:
    err = (actual - expected).abs().max().item()
    assert err <= 1e-3 * rig.effect, f"{what}: error {err:.3g} > 1e-3 of the LoRA's effect {rig.effect:.3g}"


def test_lora_hook_runs_inside_graphs_of_its_own(rig):
    assert rig.effect > 1.0, "the LoRA has no visible effect on the tiny model"
    assert rig.graphs_plain > 0, "the plain compiled UNet never ran"
    assert rig.graphs_lora > rig.graphs_plain, "the hooked run reused core's plain graphs"
    assert any("factors" in code and "repeat_interleave" in code for code in rig.graph_code), \
        "no compiled graph holds the per-row LoRA deltas"
    assert_within_lora_effect(rig, rig.lora, rig.with_lora, "compiled Fast Hooks vs LoraLoader")
    eager = rig.sample(rig.eager, *rig.everywhere(rig.hook_a))
    assert_within_lora_effect(rig, rig.lora, eager, "compiled vs uncompiled Fast Hooks")


def test_new_seed_and_new_keyframes_compile_nothing(rig):
    before = graphs()
    out = rig.sample(rig.fast, *rig.everywhere(rig.hook_a), seed=2)
    assert graphs() == before, "a new seed compiled again"
    assert_within_lora_effect(rig, out, rig.sample(rig.eager, *rig.everywhere(rig.hook_a), seed=2), "seed 2")
    outs = []
    for schedule in ([1.0, 0.5, 0.25], [0.25, 1.0, 0.5]):  # other strengths, changing between the steps
        scheduled = rig.regions(rig.keyframes(rig.hook_a, schedule), None)
        outs.append(rig.sample(rig.fast, scheduled))
        assert graphs() == before, f"keyframes {schedule} compiled again"
        expected = rig.sample(rig.eager, scheduled)
        assert_within_lora_effect(rig, outs[-1], expected, f"scheduled {schedule} vs uncompiled Fast Hooks")
    assert (outs[0] - outs[1]).abs().max().item() > 0.1 * rig.effect, "the keyframes changed nothing"


def test_two_regional_loras_match_uncompiled_and_compile_nothing(rig):
    """Another set of LoRAs (two hooks, ranks 4 + 16 on each module) runs in the same graphs: the
    strengths are padded to 8 hook columns and the summed rank is a dynamic size."""
    before = graphs()
    regions = rig.regions(rig.hook_a, rig.hook(LORA_B))
    for seed in (1, 3):
        out = rig.sample(rig.fast, regions, seed=seed)
        assert graphs() == before, f"two regional LoRAs (seed {seed}) compiled again"
        expected = rig.sample(rig.eager, regions, seed=seed)
        assert_within_lora_effect(rig, out, expected, f"regional, seed {seed}, vs uncompiled Fast Hooks")


def test_plain_runs_of_the_compiled_model_keep_core_graphs(rig):
    """The hooked graphs stay apart from core's: the plain model samples its plain latent, no new graph."""
    before = graphs()
    out = rig.sample(rig.compiled)
    assert graphs() == before, "the plain run compiled again"
    assert_within_lora_effect(rig, out, rig.plain_compiled, "plain compiled after the hooked runs")
    assert_within_lora_effect(rig, rig.plain_compiled, rig.plain, "plain compiled vs plain")


def test_torch_compile_model_on_the_fast_hooks_model_reuses_the_hooked_graph(rig):
    """TorchCompileModel after Fast Hooks (here: run again on the Fast Hooks model, a new compiled
    module): core's wrapper nests outside the engine's (else core's plain graph would run, without
    the LoRA), and the hooked graph is reused (one twin per compiled module and settings)."""
    again = rig.n["TorchCompileModel"].execute(rig.fast, rig.backend)[0]
    before = graphs()
    out = rig.sample(again, *rig.everywhere(rig.hook_a))
    assert graphs() == before, "a new TorchCompileModel on the same model compiled the hooked graph again"
    assert_within_lora_effect(rig, out, rig.lora, "Fast Hooks, then TorchCompileModel")
