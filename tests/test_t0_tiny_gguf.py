"""T0: the tiny GGUF models (devtools/tiny_gguf.py): the Q4_K quantizer read back by the gguf package's
own dequantizer, the file layout ComfyUI-GGUF's tools write, and byte-identical regeneration."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import tiny_gguf
import tiny_models

pytestmark = pytest.mark.t0

Q4_K = gguf.GGMLQuantizationType.Q4_K


def test_q4_k_blocks_read_back_by_gguf_within_the_step_bound():
    """gguf.quants.dequantize reads our blocks back: each value within half a quantization step plus half
    the offset's step (d * scale / 2 + dmin / 2) of the input, in every sub-block."""
    rng = np.random.default_rng(0)
    scales = np.array([1e-3, 1e-2, 0.1, 1.0, 10.0, 1.0])[:, None]
    x = (rng.standard_normal((6, 512)) * scales).astype(np.float32)
    x[5, :32] = 0.0  # an all-zero sub-block
    x[5, 256:] = 0.0  # an all-zero super-block
    x[4, 64:96] = np.abs(x[4, 64:96])  # a sub-block without negative values
    blocks = tiny_gguf.quantize_q4_k(x)
    assert blocks.dtype == np.uint8 and blocks.shape == (6, 2 * 144)
    back = gguf.quants.dequantize(blocks, Q4_K)
    sub = x.reshape(-1, 8, 32)
    step = (sub.max(-1) - np.minimum(sub.min(-1), 0)) / 15  # the step each sub-block needs
    d_half = blocks.reshape(-1, 144)[:, 0:4].copy().view(np.float16).astype(np.float32)  # d, dmin
    bound = step.max(-1, keepdims=True) / 63 * 0.51 + step / 2 + d_half[:, 1:2] / 2 + 1e-7
    error = np.abs(back - x).reshape(-1, 8, 32).max(-1)
    assert (error <= bound * 1.001).all(), np.argwhere(error > bound)
    assert np.all(back[5, 256:] == 0) and np.all(back[5, :32] == 0)


def test_q4_k_uses_the_four_bit_range():
    """A ramp over a sub-block uses all 16 levels (no level lost to the scale rounding)."""
    x = np.tile(np.linspace(-1.0, 2.0, 32, dtype=np.float32), 8)[None]
    blocks = tiny_gguf.quantize_q4_k(x)
    nibbles = blocks[0, 16:]
    levels = set((nibbles & 0x0F).tolist()) | set((nibbles >> 4).tolist())
    assert levels == set(range(16))
    assert np.abs(gguf.quants.dequantize(blocks, Q4_K) - x).max() <= 3.0 / 15


@pytest.fixture(scope="module")
def sd15_files(models, tmp_path_factory):
    """The SD1.5 GGUF files regenerated from the shared source into a temporary folder."""
    out = tmp_path_factory.mktemp("gguf")
    source = out / tiny_gguf.SD15_SOURCE
    source.parent.mkdir(parents=True)
    source.symlink_to(models.root / tiny_gguf.SD15_SOURCE)
    (out / "diffusion_models").mkdir()
    rels = [tiny_gguf.gguf_rel("patchbay-sd15-tiny-a", qtype) for qtype in tiny_gguf.QTYPES]
    return out, {rel: tiny_gguf.GgufModels().write(out, rel) for rel in rels}


def test_gguf_files_regenerate_byte_for_byte(sd15_files):
    _out, sums = sd15_files
    pinned = tiny_models.read_manifest(tiny_models.MANIFEST)
    assert sums == {rel: pinned[rel] for rel in sums}


def test_gguf_layout_follows_comfyui_gguf_tools(sd15_files):
    """convert.py's layout (arch sd1, rows of 256 with the original shape kept) and llama-quantize's
    choice (2-D weights quantized, the input/output layers and 1-D tensors left F16)."""
    out, sums = sd15_files
    for rel in sums:
        qtype = rel.removesuffix(".gguf").rsplit("-", 1)[1]
        reader = gguf.GGUFReader(out / rel)
        arch = reader.get_field("general.architecture")
        assert bytes(arch.parts[arch.data[-1]]).decode() == "sd1"
        types = {t.name: t.tensor_type.name for t in reader.tensors}
        assert types["input_blocks.0.0.weight"] == types["out.2.weight"] == "F16"
        assert types["time_embed.0.weight"] == types["input_blocks.1.1.norm.bias"] == "F16"
        assert types["input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight"] == qtype
        assert types["input_blocks.1.0.in_layers.2.weight"] == qtype  # a 3x3 conv, as rows of 256
        shape = reader.get_field("comfy.gguf.orig_shape.input_blocks.1.0.in_layers.2.weight")
        assert [int(shape.parts[i][0]) for i in shape.data] == [320, 320, 3, 3]
