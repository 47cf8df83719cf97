"""LoRA extraction: a delta recipe (``subtract(tuned, base)``, or any recipe in delta space) to a kohya LoRA
(truncated SVD) or a LoKr, named as ComfyUI's LoraLoader maps them.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import io as mio
from .context import KeyContext, checked_steps
from .executable import check_maps, compile_recipe, recipe_text
from .io import ARCHITECTURE_POLICIES, OUT_DTYPES
from .lora_keys import TEXT_ENCODERS
from .methods.kronecker import kronecker_factors
from .plan import NO_RUNTIME, MergeRuntime
from .stream import Evaluator

_TE_LINEAR = re.compile(r"text_model\.encoder\.layers\.\d+\.(self_attn\.(q|k|v|out)_proj|mlp\.fc[12])$")


@dataclass(frozen=True)
class ExtractOptions:
    """``rank`` (or ``energy`` in (0, 1]) per module, ``conv_rank`` for k x k convolutions (k > 1);
    ``kronecker_ratio`` in [0, 1] writes a rank-1 LoKr instead (0: w1 as small as can be, 1 as large).

    ``architecture_policy`` as in ``MergeOptions``: inputs of different families or block counts are
    refused unless it is ``"allow"``. A run's ``resolve``, ``check`` and ``on_progress`` (keys done, keys
    in all) come in a ``MergeRuntime``.
    """

    rank: int | None = 32
    energy: float | None = None
    conv_rank: int | None = None
    dtype: str = "fp16"
    device: str = "cpu"
    overwrite: bool = False
    search_dirs: tuple[Path, ...] = ()
    threads: int = 1  # torch threads for the SVDs (0 keeps torch's setting), as MergeOptions.threads
    architecture_policy: str = "refuse"
    kronecker_ratio: float | None = None

    def __post_init__(self) -> None:
        check_size(self.rank, self.energy, self.dtype)
        if self.kronecker_ratio is not None and not 0 <= self.kronecker_ratio <= 1:
            raise ValueError(f"kronecker_ratio={self.kronecker_ratio}: give a fraction in [0, 1] (0.5: w1 "
                             f"and w2 of similar size), or none for a LoRA")
        if self.architecture_policy not in ARCHITECTURE_POLICIES:
            raise ValueError(f"ExtractOptions.architecture_policy={self.architecture_policy!r}; choose one "
                             f"of {', '.join(ARCHITECTURE_POLICIES)}")


def check_size(rank: int | None, energy: float | None, dtype: str) -> None:
    """Refuse a LoRA size that is neither a rank >= 1 nor an energy in (0, 1], and an unknown dtype."""
    if energy is not None and not 0 < energy <= 1:
        raise ValueError(f"energy={energy}: give a fraction in (0, 1], e.g. 0.9")
    if energy is None and (rank is None or rank < 1):
        raise ValueError(f"rank={rank}: give a rank >= 1 or an energy fraction")
    if dtype not in OUT_DTYPES:
        raise ValueError(f"dtype={dtype!r}; choose one of {', '.join(OUT_DTYPES)}")


@dataclass
class ExtractReport:
    """The LoRA written: modules, their ranks, mean relative Frobenius error, what was left out, and
    what the architecture check let through (``warnings``, architecture_policy ``"allow"``)."""

    path: Path
    modules: int = 0
    ranks: dict[str, int] = field(default_factory=dict)
    mean_error: float = 0.0
    dropped: list[str] = field(default_factory=list)
    seconds: float = 0.0
    arch: str = "unknown"
    warnings: list[str] = field(default_factory=list)


def kohya_name(key: str) -> str | None:
    """The module name ComfyUI's LoraLoader maps onto ``key``, or None when LoRA cannot target it."""
    if not key.endswith(".weight"):
        return None
    module = key.removesuffix(".weight")
    if module.startswith(mio.UNET_PREFIX):
        return "lora_unet_" + module[len(mio.UNET_PREFIX):].replace(".", "_")
    for prefix, kohya in TEXT_ENCODERS:
        if module.startswith(prefix) and _TE_LINEAR.search(module):
            return kohya + module[len(prefix):].replace(".", "_")
    return None


def extract_lora(recipe: object, out_path: str | Path, options: ExtractOptions | None = None,
                 runtime: MergeRuntime = NO_RUNTIME) -> ExtractReport:
    """Decompose every LoRA-able key of ``recipe``'s output into a kohya LoRA at ``out_path``.

    Each 2-D weight (linear) and 3-D to 5-D weight (a 1-D, 2-D or 3-D convolution, flattened to
    ``out x in*k...``: Wan's and HunyuanVideo's Conv3d patch embeddings too) of the diffusion model and of
    the text encoder's attention/MLP linears is decomposed by SVD and truncated to ``rank``
    (``conv_rank`` for kernels larger than 1x1) or to the smallest rank that keeps ``energy`` of the
    squared singular values. The singular values are split evenly between ``lora_up`` and
    ``lora_down`` (balanced fp16 ranges) and ``alpha`` equals the rank, so ComfyUI's LoraLoader adds
    exactly ``up @ down`` at strength 1: the best rank-r approximation of the delta (Eckart-Young).

    Names are those ComfyUI's LoraLoader maps without warnings: ``lora_unet_`` + the LDM module path
    (``input_blocks_1_1_proj_in``) and ``lora_te_`` / ``lora_te1_`` + the CLIP-L module path. Deltas that
    LoRA cannot carry (biases, norms, embeddings: listed in ``ExtractReport.dropped``, not evaluated)
    and all-zero deltas are left out.

    With ``kronecker_ratio`` it writes a LoKr instead (LyCORIS ``lokr_w1`` / ``lokr_w2`` per module, no
    alpha: ComfyUI adds ``kron(w1, w2)``): the nearest single Kronecker product to each delta, w1 sized by
    the ratio (merge/methods/kronecker.py, the factors of sd-mecha's ``extract_lycoris_lokr``).
    """
    options = options or ExtractOptions()
    start = time.perf_counter()
    out_path = Path(out_path)
    mio.check_output_path(out_path, options.overwrite)
    graph = compile_recipe(recipe, options.search_dirs, resolve=runtime.resolve)
    sources = graph.open_sources(options.architecture_policy)
    report = ExtractReport(out_path, warnings=list(graph.notes))
    previous_threads = torch.get_num_threads()
    if options.threads > 0:
        torch.set_num_threads(options.threads)
    try:
        tensors, errors = _modules(graph, sources, options, report, runtime)
    finally:
        torch.set_num_threads(previous_threads)
        for source in sources:
            source.close()
    if not tensors:
        raise ValueError("the recipe's delta is zero on every key LoRA can carry: nothing to extract "
                         "(is it a delta, e.g. subtract(tuned, base)?)")
    ranks = sorted(set(report.ranks.values()))
    network = {"ss_network_module": "networks.lora", "ss_network_dim": str(max(ranks)),
               "ss_network_alpha": str(max(ranks))} if options.kronecker_ratio is None else \
        {"ss_network_module": "lycoris.kohya", "ss_network_args": '{"algo": "lokr"}'}
    metadata = {**network, "patchbay.recipe": recipe_text(recipe, report.arch),
                "patchbay.generator": "ComfyUI-Patchbay extract"}
    mio.save_file(dict(sorted(tensors.items())), out_path, metadata, overwrite=options.overwrite)
    report.modules = len(report.ranks)
    report.mean_error = sum(errors) / len(errors)
    report.seconds = time.perf_counter() - start
    return report


def _modules(graph: Any, sources: list, options: ExtractOptions, report: ExtractReport,
             runtime: MergeRuntime) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The LoRA's tensors (up, down, alpha per module) and each module's relative error."""
    tensors: dict[str, torch.Tensor] = {}
    errors: list[float] = []
    weights = [s for s in sources if s.space == "weight"] or sources
    keys = dict.fromkeys(key for source in weights for key in source.keys())  # noqa: SIM118
    evaluator = Evaluator(graph, "overlap", sources=sources)  # related= methods read other keys
    report.arch = weights[0].arch
    check_maps(graph, report.arch, [key for key in keys if kohya_name(key) is not None])
    dtype = OUT_DTYPES[options.dtype]
    for key in checked_steps(list(keys), runtime.check, runtime.on_progress):
        name = kohya_name(key)
        if name is None:
            report.dropped.append(key)
            continue
        delta = _delta(evaluator, graph, sources, key, report.arch, options.device)
        if delta is None or delta.dim() < 2 or not torch.any(delta):
            continue
        parts, rank, error = _module(delta, options)
        tensors |= {f"{name}.{part}": value.to(dtype).cpu() for part, value in parts.items()}
        report.ranks[name] = rank
        errors.append(error)
    return tensors, errors


def _module(delta: torch.Tensor, options: ExtractOptions) -> tuple[dict[str, torch.Tensor], int, float]:
    """One module's tensors by part name, its rank and its relative error: a LoRA or a LoKr."""
    if options.kronecker_ratio is not None:
        w1, w2 = kronecker_factors(delta, options.kronecker_ratio)
        kernel = (None,) * (delta.dim() - 2)
        error = float((delta - torch.kron(w1[(...,) + kernel], w2)).norm() / delta.norm())
        return {"lokr_w1": w1, "lokr_w2": w2}, 1, error
    up, down, rank, error = decompose(delta, _rank_for(delta, options), options.energy)
    return {"lora_up.weight": up, "lora_down.weight": down, "alpha": torch.tensor(float(rank))}, rank, error


def _delta(evaluator: Evaluator, graph: object, sources: list, key: str, arch: str,
           device: str) -> torch.Tensor | None:
    leaves = []
    for source in sources:
        if not source.has(key):
            leaves.append(None)
        elif hasattr(source, "read_into"):
            info = source.info(key)
            if not info.is_float:
                return None
            raw = source.read_into(key, torch.empty(info.nbytes, dtype=torch.uint8))
            leaves.append(raw.to(device).float())
        else:
            leaves.append(source.tensor(key).to(device).float())
    return evaluator.evaluate(graph.root, leaves, KeyContext(key=key, device=device, arch=arch))


def _rank_for(delta: torch.Tensor, options: ExtractOptions) -> int | None:
    if options.energy is not None:
        return None
    if delta.dim() > 2 and delta[0, 0].numel() > 1 and options.conv_rank is not None:
        return options.conv_rank
    return options.rank


def decompose(delta: torch.Tensor, rank: int | None, energy: float | None
              ) -> tuple[torch.Tensor, torch.Tensor, int, float]:
    """``(lora_up, lora_down, rank, relative error)`` of the best rank-r approximation of ``delta``.

    ``rank`` None: the smallest rank whose singular values keep ``energy`` of the squared total.
    Convolutions come back as ``up (out, r, 1, 1)`` and ``down (r, in, kh, kw)`` (kohya LoCon; a
    Conv3d's as ``(out, r, 1, 1, 1)`` and ``(r, in, kt, kh, kw)``).
    """
    matrix = delta.reshape(delta.shape[0], -1).float()
    if matrix.shape[0] < matrix.shape[1]:  # LAPACK's SVD of a wide matrix takes ~3x its transpose's
        v, s, uh = torch.linalg.svd(matrix.T, full_matrices=False)
        u, vh = uh.T, v.T
    else:
        u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    return truncate(u, s, vh, rank, energy, tuple(delta.shape))


def truncate(u: torch.Tensor, s: torch.Tensor, vh: torch.Tensor, rank: int | None, energy: float | None,
             shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, int, float]:
    """``decompose`` from an SVD ``u @ diag(s) @ vh`` of a delta of ``shape`` (2-D, or 3-D to 5-D for a
    convolution): the singular values split evenly between up and down, the relative Frobenius error
    ``sqrt(tail energy / total)``."""
    power = s.square()
    total = power.sum()
    if rank is None:
        kept = torch.cumsum(power, 0) / total
        rank = int(torch.searchsorted(kept, torch.tensor(energy * (1 - 1e-7), device=kept.device))) + 1
    rank = max(1, min(rank, s.numel()))
    root = s[:rank].sqrt()
    up, down = u[:, :rank] * root, root[:, None] * vh[:rank]
    error = math.sqrt(max(0.0, float(power[rank:].sum() / total))) if total > 0 else 0.0
    if len(shape) > 2:
        up = up.reshape(*up.shape, *(1,) * (len(shape) - 2))
        down = down.reshape(rank, *shape[1:])
    return up.contiguous(), down.contiguous(), rank, error
