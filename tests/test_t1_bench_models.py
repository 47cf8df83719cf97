"""T1: the hook benchmark's full-size models (devtools/bench_models.py) are what ComfyUI takes them for.

Built on the meta device (no weights are generated here): each UNet config is what ComfyUI's
detection reports for its layout, with the documented parameter count, and the kohya LoRA names
reach every attention, feed-forward and proj_in/proj_out weight through comfy.lora's own key map,
in the naming sd-scripts uses for that model (diffusers-style for SD1.5, LDM-style for SDXL); Wan
2.1 14B's two blocks: every self-, cross-attention and feed-forward linear, as musubi-tuner names them;
Flux.1 [dev]'s double and single block: every attention and MLP linear of both streams and the single
block's linear1 / linear2, as sd-scripts names them.
"""

from __future__ import annotations

import bench_models
import pytest

pytestmark = pytest.mark.t1

# transformer blocks x (4 attn1 + 4 attn2 + 2 ff) + 2 proj per spatial transformer
NAME_PARTS = {"diffusers": ("down_blocks", "mid_block", "up_blocks"),
              "ldm": ("input_blocks", "middle_block", "output_blocks")}
TARGETS = {"sd15-full": 16 * 10 + 2 * 16, "sdxl-full": 70 * 10 + 2 * 11, "sdxl-small": 13 * 10 + 2 * 2,
           "wan-full": 2 * 10,  # Wan: blocks x (4 self-attention + 4 cross-attention + 2 feed-forward)
           "flux-full": 1 * 8 + 1 * 2}  # Flux: double blocks x 2 streams x (qkv, proj, 2 MLP) + singles x 2
PARTS = {"sd15-full": NAME_PARTS["diffusers"], "sdxl-full": NAME_PARTS["ldm"],
         "sdxl-small": NAME_PARTS["ldm"], "wan-full": ("blocks",),
         "flux-full": ("double_blocks", "single_blocks")}


@pytest.mark.parametrize("arch", sorted(TARGETS))
def test_full_size_unets_are_detected_and_their_lora_names_reach_every_target(comfy, arch):
    import comfy.lora

    spec = bench_models.ARCHES[arch]
    model = bench_models.meta_model(spec)  # raises unless detection gives spec's class and size
    targets = bench_models.kohya_targets(model, spec.lora_names, spec.lora_targets)
    key_map = comfy.lora.model_lora_keys_unet(model, {})
    weights = model.state_dict()
    expected = sorted(k for k in weights if k.endswith(spec.lora_targets))
    assert len(targets) == len(expected) == TARGETS[arch]
    assert sorted(key_map[name] for name in targets) == expected  # every name loads, one target each
    assert all(tuple(weights[key_map[name]].shape) == shape for name, shape in targets.items())
    parts = PARTS[arch]
    assert all(name.startswith(tuple(f"lora_unet_{part}_" for part in parts)) for name in targets)
    assert all(any(name.startswith(f"lora_unet_{part}_") for name in targets) for part in parts)
