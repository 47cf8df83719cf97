"""T0: what the merge library needs for LoRAs of the 2026 families (issue 31, item 6; checked against
ComfyUI in tests/test_t1_merge_new_families.py).

- A PEFT LoRA in ComfyUI's own module names (``diffusion_model.blocks.0.self_attn.q.lora_A.weight``:
  ai-toolkit's Wan and Flux.2 LoRAs, LTX-Video-Trainer's) is a merge input: its delta is ``B @ A`` on the
  key it names; diffusers names (``transformer.blocks...``) are still refused, naming lora_A/lora_B.
- Extraction carries a Conv3d weight (Wan's and HunyuanVideo's patch embedding, 5-D) as a LoCon whose
  factors ComfyUI multiplies back into the weight's shape.
"""

from __future__ import annotations

import pytest
import tiny_families as tf
import torch
from safetensors.torch import save_file

pytestmark = pytest.mark.t0

Q = "blocks.1.self_attn.q"


def test_a_peft_lora_in_comfyuis_names_is_a_delta_on_the_key_it_names(tmp_path):
    from patchbay_merge import io, lora

    base = io.SafetensorsFile(tf.write(tmp_path / "wan.safetensors", "wan21", 2))
    gen = torch.Generator().manual_seed(0)
    down, up = torch.randn(4, 8, generator=gen), torch.randn(8, 4, generator=gen)
    save_file({f"diffusion_model.{Q}.lora_A.weight": down, f"diffusion_model.{Q}.lora_B.weight": up},
              str(tmp_path / "peft.safetensors"))
    source = lora.LoraSource(io.SafetensorsFile(tmp_path / "peft.safetensors"), base)
    assert source.keys() == [f"model.diffusion_model.{Q}.weight"] and not source.unmapped
    torch.testing.assert_close(source.delta(source.keys()[0]), up @ down)
    save_file({f"transformer.{Q}.lora_A.weight": down, f"transformer.{Q}.lora_B.weight": up},
              str(tmp_path / "diffusers.safetensors"))
    with pytest.raises(io.ModelFileError, match="lora_A/lora_B"):
        lora.LoraSource(io.SafetensorsFile(tmp_path / "diffusers.safetensors"), base)


def test_a_conv3d_delta_is_extracted_as_factors_of_its_shape():
    from patchbay_merge import extract

    delta = torch.randn((8, 16, 1, 2, 2), generator=torch.Generator().manual_seed(1))
    up, down, rank, error = extract.decompose(delta, 64, None)
    assert up.shape == (8, rank, 1, 1, 1) and down.shape == (rank, 16, 1, 2, 2) and rank == 8
    torch.testing.assert_close((up.flatten(1) @ down.flatten(1)).reshape(delta.shape), delta, rtol=1e-4,
                               atol=1e-5)
    assert error < 1e-6
