"""Tiny GGUF-quantized diffusion models, laid out the way ComfyUI-GGUF's own tools make them.

Fast Hooks must be checked on UNets loaded by ComfyUI-GGUF (its ``UnetLoaderGGUF`` node), and no GGUF
file can be downloaded, so this module quantizes two of the tiny models (devtools/tiny_models.py,
tiny_arch.py) into ``diffusion_models/``:

- ``patchbay-sd15-tiny-a-{Q8_0,Q4_K}.gguf``: the UNet of ``patchbay-sd15-tiny-a`` (key prefix
  ``model.diffusion_model.`` stripped, as ComfyUI-GGUF's tools/convert.py strips it);
- ``patchbay-flux-tiny-{Q8_0,Q4_K}.gguf``: the one-block Flux transformer.

What the real pipeline does, and what is reproduced here: ComfyUI-GGUF's ``tools/convert.py`` writes
an F16 GGUF (``general.architecture`` ``sd1``/``flux``; fp16 inputs stay F16, 1-D tensors too; for
SD1/SDXL every tensor of 512+ values whose last dimension is not a multiple of 256 is reshaped to rows
of 256, its shape kept in ``comfy.gguf.orig_shape.<key>``), then llama.cpp's ``llama-quantize`` with
ComfyUI-GGUF's ``tools/lcpp.patch`` quantizes every tensor of two or more dimensions whose name ends
in ``weight``, except the input and output layers the patch lists per architecture (``conv_in``,
``time_embed``, ``input_blocks.0.0``, ``out.2`` for SD1; ``img_in``, ``txt_in``, ``time_in``,
``vector_in``, ``guidance_in``, ``final_layer`` for Flux), and keeps F16 where rows do not divide
into the quantization's blocks. Q4_K is made as ``llama-quantize --pure`` makes it (every quantized
tensor Q4_K; without ``--pure``, Q4_K_S lifts attention ``to_v`` weights to Q5_K).

Quantizers: Q8_0 is the gguf package's (``gguf.quants.quantize``). gguf ships no Q4_K quantizer (only
its dequantizer), so ``quantize_q4_k`` below writes Q4_K blocks (256 values: fp16 ``d`` and ``dmin``,
eight 6-bit sub-block scales and mins, 4-bit values) with plain min/max rounding instead of
llama.cpp's iterative scale search; ``gguf.quants.dequantize`` reads them back (tests check it).
Everything is elementwise float32 arithmetic, min and max, so files are byte-identical everywhere
and pinned in ``models.sha256`` like the others.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SD15_SOURCE, SD15_PREFIX = "checkpoints/patchbay-sd15-tiny-a.safetensors", "model.diffusion_model."
FLUX_SOURCE = "diffusion_models/patchbay-flux-tiny.safetensors"
QTYPES = ("Q8_0", "Q4_K")
QK_K = 256  # values per K-quant super-block
SHAPE_FIX_ROW = 256  # convert.py's REARRANGE row length (and its minimum size, REARRANGE_THRESHOLD)
SHAPE_FIX_MIN = 512


@dataclass(frozen=True)
class GgufLayout:
    """One architecture as ComfyUI-GGUF's tools treat it (convert.py's ModelTemplate, lcpp.patch rules)."""

    arch: str  # general.architecture
    source: str  # the tiny safetensors model it is made from, relative to the models folder
    prefix: str  # key prefix convert.py strips
    shape_fix: bool  # convert.py reshapes SD1/SDXL tensors to rows of 256
    keep: tuple[str, ...]  # lcpp.patch: names containing one of these stay unquantized
    keep_exact: tuple[str, ...] = ()
    f32: tuple[str, ...] = ()  # names kept F32 (convert.py's keys_hiprec; fix_5d_tensors.py's 5-D tensors)

    def quantizable(self, key: str, shape: tuple[int, ...]) -> bool:
        """llama-quantize's choice before the block-size check: 2+ dims, a weight, not a kept layer."""
        kept = any(part in key for part in self.keep) or key in self.keep_exact
        return len(shape) >= 2 and key.endswith("weight") and not kept


LAYOUTS = {
    "patchbay-sd15-tiny-a": GgufLayout(
        "sd1", SD15_SOURCE, SD15_PREFIX, True,
        ("class_embedding.", "time_embedding.", "add_embedding.", "time_embed.", "label_emb.", "conv_in.",
         "conv_out."), ("input_blocks.0.0.weight", "out.2.weight")),
    "patchbay-flux-tiny": GgufLayout(
        "flux", FLUX_SOURCE, "", False,
        ("txt_in.", "img_in.", "time_in.", "vector_in.", "guidance_in.", "final_layer.")),
}


def gguf_rel(stem: str, qtype: str) -> str:
    return f"diffusion_models/{stem}-{qtype}.gguf"


def all_rels() -> list[str]:
    return [gguf_rel(stem, qtype) for stem in LAYOUTS for qtype in QTYPES]


def quantize_q4_k(rows: np.ndarray) -> np.ndarray:
    """Q4_K blocks of ``rows`` (..., k), k a multiple of 256: uint8 (..., k // 256 * 144).

    Per sub-block of 32 values: step (max - min(0, min)) / 15 and offset -min(0, min), stored as
    6-bit multiples of the super-block's fp16 ``d`` and ``dmin`` (``d`` rounded up, scales rounded up,
    so a step never shrinks below the sub-block's range / 15); values ``round((x + offset) / step)``
    clipped to 0..15. Dequantized: ``d * scale * q - dmin * min``.
    """
    import gguf

    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q4_K]
    shape = rows.shape
    x = rows.astype(np.float32).reshape(-1, block_size // 32, 32)
    offset = -np.minimum(x.min(axis=-1), 0.0)  # (blocks, 8), >= 0
    step = (x.max(axis=-1) + offset) / 15.0
    d = _fp16_at_least(step.max(axis=-1) / 63.0)
    dmin = _fp16_at_least(offset.max(axis=-1) / 63.0)
    scales = np.minimum(np.ceil(_divide(step, d.astype(np.float32)[:, None])), 63).astype(np.uint8)
    mins = np.minimum(np.rint(_divide(offset, dmin.astype(np.float32)[:, None])), 63).astype(np.uint8)
    step_q = d.astype(np.float32)[:, None] * scales
    offset_q = dmin.astype(np.float32)[:, None] * mins
    q = np.clip(np.rint(_divide(x + offset_q[..., None], step_q[..., None])), 0, 15).astype(np.uint8)
    packed_scales = np.concatenate([
        scales[:, :4] | ((scales[:, 4:] >> 4) << 6),
        mins[:, :4] | ((mins[:, 4:] >> 4) << 6),
        (scales[:, 4:] & 0x0F) | ((mins[:, 4:] & 0x0F) << 4),
    ], axis=-1)
    pairs = q.reshape(-1, 4, 2, 32)  # sub-blocks 2j (low nibble) and 2j + 1 (high nibble)
    nibbles = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    halves = [a.astype("<f2").view(np.uint8).reshape(-1, 2) for a in (d, dmin)]
    blocks = np.concatenate([*halves, packed_scales, nibbles], axis=-1)
    assert blocks.shape[-1] == type_size
    return blocks.reshape(*shape[:-1], shape[-1] // block_size * type_size)


def _fp16_at_least(values: np.ndarray) -> np.ndarray:
    """``values`` as fp16, rounded up where fp16 rounding went below them."""
    half = values.astype(np.float16)
    low = half.astype(np.float32) < values
    half[low] = np.nextafter(half[low], np.float16(np.inf))
    return half


def _divide(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / b, 0 where b is 0 (an all-zero block or sub-block)."""
    return np.divide(a, b, out=np.zeros(np.broadcast_shapes(a.shape, b.shape), np.float32), where=b != 0)


def quantize(data: np.ndarray, qtype: str) -> np.ndarray:
    """``data`` (rows in the last dimension) quantized to ``qtype``: raw GGUF bytes, one row per row."""
    import gguf

    if qtype == "Q4_K":
        rows = 4096
        flat = data.reshape(-1, data.shape[-1])
        out = [quantize_q4_k(flat[i:i + rows]) for i in range(0, flat.shape[0], rows)]
        return np.concatenate(out).reshape(*data.shape[:-1], -1)
    return gguf.quants.quantize(data, gguf.GGMLQuantizationType[qtype])


class GgufModels:
    """Writes the GGUF files from their safetensors sources (made before them: ``all_rels`` order)."""

    def write(self, out_dir: Path, rel: str) -> str:
        """Write ``out_dir / rel`` (a temporary file renamed into place) and return its sha256."""
        from safetensors.torch import load_file

        stem, qtype = Path(rel).stem.rsplit("-", 1)
        layout = LAYOUTS[stem]
        source = out_dir / layout.source
        if not source.is_file():
            raise FileNotFoundError(f"{rel} is made from {source}, which is missing: generate it first "
                                    f"(python devtools/tiny_models.py --out {out_dir}).")
        tensors = {k.removeprefix(layout.prefix): v for k, v in sorted(load_file(source).items())
                   if k.startswith(layout.prefix)}
        path = out_dir / rel
        write_gguf(path, tensors, layout, qtype)
        import tiny_models

        return tiny_models.sha256(path)


def write_gguf(path: str | Path, tensors: dict, layout: GgufLayout, qtype: str) -> None:
    """Write ``tensors`` (key -> torch tensor, prefix already stripped; written in their order) as
    ComfyUI-GGUF's tools would (``layout``, ``qtype``) to ``path``: a temporary file renamed into place."""
    import gguf

    path = Path(path)
    writer = gguf.GGUFWriter(path=None, arch=layout.arch)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    file_type = {"Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "Q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_S}[qtype]
    writer.add_file_type(file_type)  # what llama-quantize records (--pure keeps Q4_K_S's file type)
    for key, tensor in tensors.items():
        data, kind = _tensor(layout, key, tensor.numpy(), qtype, writer)
        writer.add_tensor(key, data, raw_dtype=gguf.GGMLQuantizationType[kind])
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as handle:
        temporary = handle.name
    try:
        writer.write_header_to_file(path=temporary)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def _tensor(layout: GgufLayout, key: str, data: np.ndarray, qtype: str, writer) -> tuple[np.ndarray, str]:
    """(data as written, its GGML type name): convert.py's reshape, then llama-quantize's choice."""
    import gguf

    count = data.size
    if (layout.shape_fix and data.ndim > 1 and count >= SHAPE_FIX_MIN and count % SHAPE_FIX_ROW == 0
            and data.shape[-1] % SHAPE_FIX_ROW != 0):
        writer.add_array(f"comfy.gguf.orig_shape.{key}", [int(n) for n in data.shape])
        data = data.reshape(count // SHAPE_FIX_ROW, SHAPE_FIX_ROW)
    if any(part in key for part in layout.f32):
        return data.astype(np.float32), "F32"
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]
    if layout.quantizable(key, data.shape) and data.shape[-1] % block == 0:
        return quantize(data, qtype), qtype
    return data.astype(np.float16), "F16"
