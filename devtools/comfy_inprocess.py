"""ComfyUI imported into this process on the CPU, as main.py would set it up (tests' T1 tier, benchmarks).

Order matters: ``args.cpu`` before anything imports comfy.model_management, and the ``utils`` package
before ``nodes`` (which puts comfy/, with its own utils.py, first on sys.path), or
comfy_extras/nodes_images.py fails to import.
"""

from __future__ import annotations

import asyncio
import sys
import types
from pathlib import Path

import devpaths


def start_comfy(output_dir: Path | None = None, cpu: bool = True) -> types.ModuleType:
    """Import ComfyUI with the tiny models' folders and core + extra nodes; returns ``nodes``.

    On the CPU unless ``cpu`` is False (benchmarks on a GPU); main.py is not run, so ComfyUI 0.33's
    dynamic VRAM (comfy-aimdo) stays off there and models load through the plain ModelPatcher."""
    comfy_dir = devpaths.comfyui_dir()
    if str(comfy_dir) not in sys.path:
        sys.path.insert(0, str(comfy_dir))
    from comfy.cli_args import args

    args.cpu = cpu
    import folder_paths
    import utils.extra_config  # noqa: F401  (before nodes, as main.py does)

    base = devpaths.models_dir()
    folder_paths.add_model_folder_path("checkpoints", str(base / "checkpoints"), is_default=True)
    folder_paths.add_model_folder_path("loras", str(base / "loras"), is_default=True)
    folder_paths.add_model_folder_path("diffusion_models", str(base / "diffusion_models"), is_default=True)
    folder_paths.add_model_folder_path("controlnet", str(base / "controlnet"), is_default=True)
    folder_paths.add_model_folder_path("vae", str(base / "vae"), is_default=True)
    if output_dir is not None:
        folder_paths.set_output_directory(str(output_dir))
    import nodes

    asyncio.run(nodes.init_extra_nodes(init_custom_nodes=False, init_api_nodes=False))
    return nodes


def load_pack(nodes: types.ModuleType, parent: Path) -> types.ModuleType:
    """Load this repo through ComfyUI's own loader from ``parent/custom_nodes/ComfyUI-Patchbay``."""
    module_path = str(devpaths.make_custom_nodes_dir(parent) / devpaths.PACK_NAME)
    if not asyncio.run(nodes.load_custom_node(module_path)):
        raise RuntimeError("ComfyUI failed to load the pack; see the log above for the traceback")
    return sys.modules[module_path.replace(".", "_x_")]  # where load_custom_node registers a folder


class InGraph:
    """A node instance whose methods run as ComfyUI's executor runs them: under torch.inference_mode
    (a model built there holds inference tensors, which only code in inference mode may write)."""

    def __init__(self, instance: object) -> None:
        self.instance = instance

    def __getattr__(self, name: str):
        import torch

        method = getattr(self.instance, name)

        def run(*args, **kwargs):
            with torch.inference_mode():
                return method(*args, **kwargs)
        return run
