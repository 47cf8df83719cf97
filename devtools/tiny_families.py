"""Key layouts of every family in merge/architectures.py at a tiny width, for the merge tests.

Each family's diffusion model as its real files name it (``double_blocks.N.img_attn.qkv.weight``,
``blocks.N.ffn.0.weight``, ...): a few keys per block, the modules before and after the blocks, and the
keys ComfyUI's ``comfy/model_detection.py`` reads, with the shape relations detection depends on
(the SD UNets' cross-attention context width, Wan 2.2 5B's 48-channel head, HunyuanVideo 1.5's 1152-wide
vision input). Everything else is 8 wide. Block counts are arguments, so a test builds Flux.2 [dev]
(8 + 48) and Klein (5 + 20), Wan 1.3B (30) and 14B (40), SD3.5 Medium (24) and Large (38) in
milliseconds. ``checkpoint=True`` gives a whole ComfyUI checkpoint (``model.diffusion_model.`` prefix,
a text encoder and VAE key) instead of a diffusion-model-only file.

These files are no models: ComfyUI would not load most of them (the t1 check only runs its detection).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

W = 8  # hidden width
Shape = tuple[int, ...]


def _blocks(template: str, count: int, parts: dict[str, Shape]) -> dict[str, Shape]:
    return {f"{template.format(n=n)}.{part}": shape for n in range(count) for part, shape in parts.items()}


def _unet(context: int, levels: int, extra: dict[str, Shape]) -> dict[str, Shape]:
    """An LDM UNet: ``levels`` * 3 input and output blocks, cross-attention of ``context`` width."""
    count = levels * 3
    keys = {
        "input_blocks.0.0.weight": (W, 4, 3, 3),
        "time_embed.0.weight": (4 * W, W),
        "out.2.weight": (4, W, 3, 3),
        "middle_block.0.in_layers.0.weight": (W,),
        "middle_block.1.proj_in.weight": (W, W),
        **_blocks("input_blocks.{n}", count, {"0.in_layers.0.weight": (W,)}),
        **_blocks("output_blocks.{n}", count, {"0.in_layers.0.weight": (W,)}),
        **extra,
    }
    for n in (1, 2, count - 2, count - 1):
        for side in ("input_blocks", "output_blocks"):
            keys[f"{side}.{n}.1.transformer_blocks.0.attn2.to_k.weight"] = (W, context)
            keys[f"{side}.{n}.1.proj_in.weight"] = (W, W)
    return keys


def _flux_blocks(double: int, single: int) -> dict[str, Shape]:
    return {
        **_blocks(
            "double_blocks.{n}",
            double,
            {
                "img_attn.qkv.weight": (3 * W, W),
                "txt_attn.qkv.weight": (3 * W, W),
                "img_attn.norm.key_norm.scale": (4,),
            },
        ),
        **_blocks("single_blocks.{n}", single, {"linear1.weight": (7 * W, W), "norm.key_norm.scale": (4,)}),
        "final_layer.linear.weight": (64, W),
        "final_layer.adaLN_modulation.1.weight": (2 * W, W),
    }


def _hunyuan(double: int, single: int, extra: dict[str, Shape]) -> dict[str, Shape]:
    return {
        "txt_in.input_embedder.weight": (W, 32),
        "txt_in.individual_token_refiner.blocks.0.norm1.weight": (W,),
        "time_in.in_layer.weight": (W, 256),
        **_flux_blocks(double, single),
        **extra,
    }


def _lumina(layers: int, modulation: str, extra: dict[str, Shape]) -> dict[str, Shape]:
    block = {
        "attention.qkv.weight": (3 * W, W),
        "attention.k_norm.weight": (4,),
        "ffn_norm1.weight": (W,),
        f"adaLN_modulation.{modulation}.weight": (4 * W, W),
    }
    return {
        "x_embedder.weight": (W, 64),
        "t_embedder.mlp.0.weight": (W, 256),
        "cap_embedder.0.weight": (32,),
        "cap_embedder.1.weight": (W, 32),
        **_blocks("noise_refiner.{n}", 2, block),
        **_blocks("context_refiner.{n}", 2, {"attention.qkv.weight": (3 * W, W)}),
        **_blocks("layers.{n}", layers, block),
        "final_layer.linear.weight": (64, W),
        **extra,
    }


def _cosmos2(blocks: int, extra: dict[str, Shape]) -> dict[str, Shape]:
    return {
        "x_embedder.proj.1.weight": (W, 68),
        "t_embedder.1.linear_1.weight": (W, W),
        **_blocks("blocks.{n}", blocks, {"mlp.layer1.weight": (4 * W, W), "self_attn.q_proj.weight": (W, W)}),
        "final_layer.linear.weight": (64, W),
        **extra,
    }


def _wan(blocks: int, channels: int) -> dict[str, Shape]:
    return {
        "patch_embedding.weight": (W, channels, 1, 2, 2),
        "text_embedding.0.weight": (W, 32),
        "time_embedding.0.weight": (W, 256),
        "time_projection.1.weight": (6 * W, W),
        **_blocks(
            "blocks.{n}",
            blocks,
            {"self_attn.q.weight": (W, W), "ffn.0.weight": (4 * W, W), "modulation": (1, 6, W)},
        ),
        "head.head.weight": (channels * 4, W),
        "head.modulation": (1, 2, W),
    }


def _ltx(blocks: int, extra: dict[str, Shape]) -> dict[str, Shape]:
    return {
        "patchify_proj.weight": (32, 128),
        "adaln_single.emb.timestep_embedder.linear_1.bias": (32,),
        "adaln_single.linear.weight": (192, 32),
        "caption_projection.linear_1.weight": (32, 64),
        **_blocks(
            "transformer_blocks.{n}", blocks, {"attn1.to_q.weight": (32, 32), "attn2.to_k.weight": (32, 64)}
        ),
        "scale_shift_table": (2, 32),
        "proj_out.weight": (128, 32),
        **extra,
    }


# family -> (keys at the default block counts) as a function of its block counts
FAMILIES = {
    "sd15": lambda levels=4: _unet(768, levels, {}),
    "sd2": lambda levels=4: _unet(1024, levels, {}),
    "sdxl": lambda levels=3: _unet(2048, levels, {"label_emb.0.0.weight": (W, 2816)}),
    "sd3": lambda depth=24: {
        "x_embedder.proj.weight": (64, 16, 2, 2),
        "pos_embed": (1, 16, 64),
        "t_embedder.mlp.0.weight": (64, 256),
        "y_embedder.mlp.0.weight": (64, 2048),
        "context_embedder.weight": (64, 32),
        "final_layer.linear.weight": (64, 64),
        **_blocks(
            "joint_blocks.{n}",
            depth,
            {"context_block.attn.qkv.weight": (192, 64), "x_block.attn.qkv.weight": (192, 64)},
        ),
    },
    "flux": lambda double=19, single=38: {
        "img_in.weight": (W, 64),
        "txt_in.weight": (W, 32),
        "time_in.in_layer.weight": (W, 256),
        "vector_in.in_layer.weight": (W, 768),
        "guidance_in.in_layer.weight": (W, 256),
        **_flux_blocks(double, single),
    },
    "flux2": lambda double=8, single=48: {
        "img_in.weight": (W, 128),
        "txt_in.weight": (W, 32),
        "time_in.in_layer.weight": (W, 256),
        "double_stream_modulation_img.lin.weight": (6 * W, W),
        "double_stream_modulation_txt.lin.weight": (6 * W, W),
        "single_stream_modulation.lin.weight": (3 * W, W),
        **_flux_blocks(double, single),
    },
    "chroma": lambda double=19, single=38: {
        "img_in.weight": (W, 64),
        "txt_in.weight": (W, 32),
        "distilled_guidance_layer.in_proj.weight": (W, 64),
        "distilled_guidance_layer.norms.0.scale": (W,),
        **_flux_blocks(double, single),
    },
    "hunyuan_video": lambda double=20, single=40: _hunyuan(
        double,
        single,
        {
            "img_in.proj.weight": (W, 16, 1, 2, 2),
            "vector_in.in_layer.weight": (W, 768),
            "guidance_in.in_layer.weight": (W, 256),
        },
    ),
    "hunyuan_video15": lambda double=54, single=0: _hunyuan(
        double,
        single,
        {
            "img_in.proj.weight": (W, 65, 1, 1, 1),
            "vision_in.proj.0.weight": (1152,),
            "cond_type_embedding.weight": (3, W),
            "byt5_in.fc1.weight": (W, 32),
        },
    ),
    "hunyuan_image21": lambda double=20, single=40: _hunyuan(
        double, single, {"img_in.proj.weight": (W, 64, 1, 1)}
    ),
    "ltxv": lambda blocks=28: _ltx(blocks, {}),
    "ltxav": lambda blocks=48: _ltx(
        blocks, {"audio_adaln_single.linear.weight": (192, 32), "audio_patchify_proj.weight": (32, 128)}
    ),
    "cosmos": lambda blocks=28: {
        "x_embedder.proj.1.weight": (W, 68),
        "t_embedder.1.linear_1.weight": (W, W),
        **_blocks("blocks.block{n}", blocks, {"blocks.0.block.attn.to_q.0.weight": (W, W)}),
        "final_layer.linear.weight": (64, W),
    },
    "cosmos_predict2": lambda blocks=28: _cosmos2(blocks, {}),
    "anima": lambda blocks=28: _cosmos2(
        blocks, {"llm_adapter.blocks.0.cross_attn.q_proj.weight": (W, W), "llm_adapter.embed.weight": (64, W)}
    ),
    "lumina2": lambda layers=26: _lumina(layers, "1", {}),
    "z_image": lambda layers=30: _lumina(layers, "0", {"x_pad_token": (1, W), "cap_pad_token": (1, W)}),
    "hidream": lambda double=16, single=32: {
        "t_embedder.timestep_embedder.linear_1.weight": (W, 256),
        "x_embedder.proj.weight": (W, 64),
        "p_embedder.pooled_embedder.linear_1.weight": (W, 32),
        **_blocks("caption_projection.{n}", 48, {"linear.weight": (W, 32)}),
        **_blocks("double_stream_blocks.{n}", double, {"block.attn1.to_q.weight": (W, W)}),
        **_blocks("single_stream_blocks.{n}", single, {"block.attn1.to_q.weight": (W, W)}),
        "final_layer.linear.weight": (64, W),
    },
    "qwen_image": lambda blocks=60: {
        "img_in.weight": (W, 64),
        "txt_norm.weight": (32,),
        "txt_in.weight": (W, 32),
        "time_text_embed.timestep_embedder.linear_1.weight": (W, 256),
        **_blocks(
            "transformer_blocks.{n}", blocks, {"img_mod.1.weight": (6 * W, W), "attn.to_q.weight": (W, W)}
        ),
        "norm_out.linear.weight": (2 * W, W),
        "proj_out.weight": (64, W),
    },
    "wan21": lambda blocks=30: _wan(blocks, 16),
    "wan22_5b": lambda blocks=30: _wan(blocks, 48),
    "unknown": lambda blocks=4: {  # no family of the table, nor of ComfyUI
        "trunk.stem.weight": (W, 16),
        **_blocks("trunk.layers.{n}", blocks, {"mix.weight": (3 * W, W)}),
    },
}
OUTSIDE = {
    "text_encoders.t5xxl.transformer.shared.weight": (16, W),
    "vae.decoder.conv_in.weight": (W, 4, 3, 3),
}
UNET_OUTSIDE = {
    "cond_stage_model.transformer.text_model.final_layer_norm.weight": (W,),
    "first_stage_model.decoder.conv_in.weight": (W, 4, 3, 3),
}


def shapes(family: str, *counts: int, checkpoint: bool = False) -> dict[str, Shape]:
    """``{key: shape}`` of a tiny ``family`` file with the given block counts (the family's defaults
    when none are given)."""
    body = FAMILIES[family](*counts)
    if not checkpoint:
        return body
    outside = UNET_OUTSIDE if family in ("sd15", "sd2", "sdxl") else OUTSIDE
    return {**{f"model.diffusion_model.{k}": s for k, s in body.items()}, **outside}


def state_dict(family: str, *counts: int, checkpoint: bool = False, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp16 tensors in the layout of ``shapes``."""
    gen = torch.Generator().manual_seed(seed)
    return {
        k: torch.randn(s, generator=gen).half()
        for k, s in shapes(family, *counts, checkpoint=checkpoint).items()
    }


def write(path: Path, family: str, *counts: int, checkpoint: bool = False, seed: int = 0) -> Path:
    """A tiny ``family`` file at ``path``."""
    save_file(state_dict(family, *counts, checkpoint=checkpoint, seed=seed), str(path))
    return path
