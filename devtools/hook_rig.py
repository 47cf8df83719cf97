"""The t1 hook tests' shared rig: the tiny SD1.5 checkpoint, prompts, a 4-step euler sampler, hooked
conditioning built with core's own nodes, and the tolerance they compare latents with (1e-4 x max
|latent|, fp32). tests/test_t1_hook_engine.py, test_t1_hook_nodes.py and test_t1_merge_hook.py use it;
the compile tests use devtools/compile_attention.py.
"""

from __future__ import annotations

import torch

CKPT = "patchbay-sd15-tiny-a.safetensors"
STEPS = 4


class Rig:
    """The tiny checkpoint, prompts and a 4-step euler sampler; builds hooked conditioning."""

    def __init__(self, comfy):
        self.comfy = comfy
        self.n = comfy.nodes.NODE_CLASS_MAPPINGS
        self._encoded: dict = {}  # text -> conditioning (encode)
        self._plain = None  # the unhooked latent (plain)
        self.model, self.clip, _ = self.n["CheckpointLoaderSimple"]().load_checkpoint(CKPT)
        self.pos = self.encode("a knight in armor")
        self.neg = self.encode("blurry")
        self.left = self.encode("a red castle")
        self.right = self.encode("a green forest")
        (self.latent,) = self.n["EmptyLatentImage"]().generate(64, 64, 1)
        self.engine_module = comfy.pack.hooks.enable

    def encode(self, text):
        """CLIPTextEncode of ``text`` with the rig's CLIP, encoded once per text (nodes copy a
        conditioning before they change it)."""
        if text not in self._encoded:
            self._encoded[text] = self.n["CLIPTextEncode"]().encode(self.clip, text)[0]
        return self._encoded[text]

    def fast(self, model=None, cache_mb=2048.0):
        return self.n["PatchbayHookEngine"]().execute(model or self.model, cache_mb)[0]

    def engine(self, model):
        return self.engine_module.hook_engine_of(model)

    def sample(self, model, pos, neg=None, seed=7, steps=STEPS):
        neg = self.neg if neg is None else neg
        sampler = self.n["KSampler"]()
        (out,) = sampler.sample(model, seed, steps, 7.0, "euler", "normal", pos, neg, self.latent)
        return out["samples"]

    def plain(self):
        """The unhooked model's latent for the positive prompt: sampled once per rig (a fixed seed gives
        the same latent bit for bit on the CPU), a copy each call."""
        if self._plain is None:
            self._plain = self.sample(self.model, self.pos)
        return self._plain.clone()

    def hook(self, lora, strength=1.0, schedule=None):
        (hooks,) = self.n["CreateHookLora"]().create_hook(lora, strength, strength)
        if schedule is not None:
            (kf,) = self.n["CreateHookKeyframesFromFloats"]().create_hook_keyframes(list(schedule), 0.0, 1.0)
            (hooks,) = self.n["SetHookKeyframes"]().set_hook_keyframes(hooks, kf)
        return hooks

    def with_hooks(self, cond, hooks, mask=None):
        props = self.n["ConditioningSetProperties"]()
        return props.set_properties(cond, 1.0, "default", mask=mask, hooks=hooks)[0]

    def regions(self, hooks_a, hooks_b):
        left = torch.zeros((1, 64, 64))
        left[:, :, :32] = 1.0
        a = self.with_hooks(self.left, hooks_a, mask=left)
        b = self.with_hooks(self.right, hooks_b, mask=1.0 - left)
        return self.n["ConditioningCombine"]().combine(a, b)[0]


def assert_close(actual, expected, what):
    tolerance = 1e-4 * expected.abs().max().item()
    diff = (actual - expected).abs().max().item()
    assert diff <= tolerance, f"{what}: max |diff| {diff:.3g} > {tolerance:.3g}"

