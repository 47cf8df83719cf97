"""A stack of LoRA files merged into one LoRA: the factors concatenated exactly, then truncated by SVD
without ever forming the full delta.
"""

from __future__ import annotations

import fnmatch
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import architectures as archs
from . import blocks
from . import io as mio
from .context import checked_steps
from .extract import check_size, truncate
from .io import OUT_DTYPES
from .lora import module_delta, module_factors, patched_shape
from .lora_keys import TEXT_ENCODERS, block_key
from .names import did_you_mean
from .plan import NO_RUNTIME, MergeRuntime

# tensor name suffix -> the part name merge/lora.py reads (PEFT/diffusers up/down read as kohya's)
PARTS = {".lora_up.weight": "lora_up.weight", ".lora_down.weight": "lora_down.weight",
         ".lora_B.weight": "lora_up.weight", ".lora_A.weight": "lora_down.weight",
         ".lora.up.weight": "lora_up.weight", ".lora.down.weight": "lora_down.weight",
         "_lora.up.weight": "lora_up.weight", "_lora.down.weight": "lora_down.weight",
         ".lora_linear_layer.up.weight": "lora_up.weight",
         ".lora_linear_layer.down.weight": "lora_down.weight",
         ".alpha": "alpha", ".diff": "diff", **{f".{p}": p for p in (
             "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "lokr_w1", "lokr_w1_a", "lokr_w1_b",
             "lokr_w2", "lokr_w2_a", "lokr_w2_b")}}
REFUSED = {".lora_mid.weight": "a Tucker core (LoCon lora_mid)", ".hada_t1": "a Tucker core (LoHa hada_t1)",
           ".hada_t2": "a Tucker core (LoHa hada_t2)", ".lokr_t2": "a Tucker core (LoKr lokr_t2)",
           ".dora_scale": "DoRA (its delta is not linear in the factors, so no sum of LoRAs equals it)",
           ".diff_b": "a bias delta (a LoRA file carries no bias)", ".set_weight": "a replaced weight"}
_TEXT = tuple(kohya for _, kohya in TEXT_ENCODERS) + ("lora_te2_", "text_encoder")


class StackError(ValueError):
    """A stack that cannot be merged; the message names the file, module or value and the fix."""


@dataclass(frozen=True)
class StackEntry:
    """One LoRA of the stack: its file, strength (``clip_strength`` on text-encoder modules; None: the
    same) and optional block weights (merge/blocks.py names, globs on module names, ``default``)."""

    path: str | Path
    strength: float = 1.0
    clip_strength: float | None = None
    blocks: Mapping[str, float] | None = field(default=None, hash=False)


@dataclass(frozen=True)
class StackOptions:
    """``rank`` per module, or the smallest rank keeping ``energy`` of each module's squared singular
    values. A run's ``check`` and ``on_progress`` (modules done, modules in all) come in a
    ``MergeRuntime``."""

    rank: int | None = 32
    energy: float | None = None
    dtype: str = "fp16"
    device: str = "cpu"
    overwrite: bool = False
    threads: int = 1  # torch threads for the QRs and SVDs (0 keeps torch's setting), as in ExtractOptions

    def __post_init__(self) -> None:
        check_size(self.rank, self.energy, self.dtype)


@dataclass(frozen=True)
class ModuleReport:
    """One module of the merged LoRA: the rank kept of the stack's ``full_rank`` (the sum of the
    LoRAs' ranks, at most the weight's), the relative Frobenius error of the truncation
    (``|sum - merged| / |sum|``), and the pairs of LoRAs (1-based stack positions) whose deltas on it
    point in opposite directions (cosine < 0: they partly cancel here)."""

    name: str
    rank: int
    full_rank: int
    error: float
    opposed: tuple[tuple[int, int, float], ...] = ()


@dataclass
class StackReport:
    """The LoRA written, its family, every module's report, modules left out (zero delta)."""

    path: Path
    arch: str = archs.UNKNOWN
    modules: dict[str, ModuleReport] = field(default_factory=dict)
    zero: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def max_error(self) -> float:
        return max((m.error for m in self.modules.values()), default=0.0)

    def lines(self, shown: int = 5) -> list[str]:
        """A summary: the file, ranks, errors, then the most opposed modules."""
        ranks = sorted({m.rank for m in self.modules.values()}) or [0]
        errors = [m.error for m in self.modules.values()]
        out = [f"{self.path.name}: {len(self.modules)} modules ({self.arch}), rank "
               f"{ranks[0]}-{ranks[-1]}, relative truncation error mean "
               f"{sum(errors) / max(1, len(errors)):.4f}, max {self.max_error:.4f}"]
        opposed = sorted((c, m.name, i, j) for m in self.modules.values() for i, j, c in m.opposed)
        if opposed:
            out.append(f"{len({o[1] for o in opposed})} modules where LoRAs pull in opposite directions "
                       f"(cosine < 0 between their deltas; they partly cancel there):")
            out += [f"  {name}: LoRA {i} vs LoRA {j}, cosine {c:.3f}" for c, name, i, j in opposed[:shown]]
        return out + [f"warning: {w}" for w in self.warnings]


@dataclass
class _Lora:
    entry: StackEntry
    position: int
    file: mio.SafetensorsFile
    modules: dict[str, dict[str, str]]  # module -> part -> tensor name
    shapes: dict[str, tuple[int, int]]  # module -> (out, in * kh * kw) of the weight it patches
    arch: str


def merge_lora_stack(entries: Sequence[StackEntry], out_path: str | Path, options: StackOptions | None = None,
                     runtime: MergeRuntime = NO_RUNTIME) -> StackReport:
    """Merge ``entries`` into one LoRA at ``out_path`` (see the module docstring); nothing is written
    unless every module merged with finite values.

        merge_lora_stack([StackEntry("ink.safetensors", 0.8), StackEntry("style.safetensors", -0.5,
                          blocks={"OUT*": 0, "default": 1})], "ink-style.safetensors", StackOptions(rank=32))
            -> StackReport: per module the rank kept, the relative truncation error, opposed LoRAs

    Per module (a layer some LoRA of the stack patches), LoRA i adds ``s_i * up_i @ down_i``, where ``s_i``
    is its strength (``clip_strength`` on text-encoder modules) x its block weight x ``alpha_i / r_i``, as
    ComfyUI's LoraLoader applies it. The stack's delta is the sum, held as two factors: the ups side by
    side (``U``, out x R) and the scaled downs stacked (``D``, R x in), R = the sum of the ranks, so
    ``U @ D`` is the sum exactly. Truncation never forms it: QR of ``U`` and of ``D^T``, SVD of the small
    core ``R_u @ R_d^T``, the top singular vectors rotated back (merge/extract.py's ``truncate`` splits the
    singular values between up and down). LoHa and LoKr join as exact factors too (lora.module_factors);
    a full ``diff`` module has none: its exact delta (``module_delta``) joins the sum, SVD'd whole. LoCon
    convolutions are flattened to ``out x in*kh*kw`` and written back as ``up (out, r, 1, 1)``,
    ``down (r, in, kh, kw)``. Tucker cores and DoRA are refused by module.

    The file is kohya's format (``<module>.lora_up.weight``, ``.lora_down.weight``, ``.alpha`` = rank, so
    the scale is 1), written to a temporary file and renamed (merge/io.py). Everything that can be checked
    from the headers (files, families, shapes, the rank, block maps) is checked before a tensor is read.
    """
    options = options or StackOptions()
    start = time.perf_counter()
    out_path = Path(out_path)
    mio.check_output_path(out_path, options.overwrite)
    if not entries:
        raise StackError("the stack is empty: give at least one LoRA")
    loras: list[_Lora] = []
    try:
        for n, entry in enumerate(entries, start=1):
            loras.append(_open(entry, n))
        report = StackReport(out_path, arch=_common_arch(loras))
        modules = list(dict.fromkeys(m for lora in loras for m in lora.modules))
        _check_plan(loras, modules, report, options)
        previous_threads = torch.get_num_threads()
        if options.threads > 0:
            torch.set_num_threads(options.threads)
        try:
            tensors = _merge_modules(loras, modules, report, options, runtime)
        finally:
            torch.set_num_threads(previous_threads)
    finally:
        for lora in loras:
            lora.file.close()
    if not tensors:
        raise StackError("every module of the stack adds zero (strengths or block weights 0): nothing to "
                         "write")
    ranks = [m.rank for m in report.modules.values()]
    stack = [{"file": Path(e.path).name, "strength": e.strength, "clip_strength": e.clip_strength,
              "blocks": dict(e.blocks or {})} for e in entries]
    metadata = {"ss_network_module": "networks.lora", "ss_network_dim": str(max(ranks)),
                "ss_network_alpha": str(max(ranks)), "patchbay.lora_stack": json.dumps(stack),
                "patchbay.generator": "ComfyUI-Patchbay lora-stack"}
    mio.save_file(dict(sorted(tensors.items())), out_path, metadata, overwrite=options.overwrite)
    report.seconds = time.perf_counter() - start
    return report


def _open(entry: StackEntry, position: int) -> _Lora:
    path = Path(entry.path)
    if not path.is_file():
        siblings = [p.name for p in path.parent.glob("*.safetensors")] if path.parent.is_dir() else []
        raise StackError(f"LoRA {position} {str(path)!r}: no such file{did_you_mean(path.name, siblings)}")
    for value in (entry.strength, entry.clip_strength, *(entry.blocks or {}).values()):
        if value is not None and not math.isfinite(value):
            raise StackError(f"LoRA {position} ({path.name}): strength or block weight {value} is not a "
                             f"finite number; give e.g. 0.8")
    file = mio.SafetensorsFile(path)
    modules: dict[str, dict[str, str]] = {}
    for key in file.tensors:
        suffix = next((s for s in (*PARTS, *REFUSED) if key.endswith(s)), None)
        if suffix in REFUSED:
            raise StackError(f"{path}: module {key.removesuffix(suffix)} is {REFUSED[suffix]}; it cannot be "
                             f"merged into a plain LoRA. Leave this LoRA out of the stack, or apply it "
                             f"with LoraLoader beside the merged one")
        if suffix is None and key.endswith((".scale", "_norm.weight", ".norm.weight")):
            raise StackError(f"{path}: tensor {key} is a weight the LoRA sets (a norm scale: LoraLoader "
                             f"replaces it instead of adding to it), which a merged LoRA of deltas cannot "
                             f"carry; leave this LoRA out of the stack and apply it with LoraLoader beside "
                             f"the merged one")
        if suffix is None:
            raise StackError(f"{path}: tensor {key} is no LoRA part this merge knows (kohya lora_up/"
                             f"lora_down, PEFT lora_A/lora_B, LoCon, LoHa, LoKr); is it a LoRA file?")
        modules.setdefault(key.removesuffix(suffix), {})[PARTS[suffix]] = key
    info = {m: {part: file.tensors[key].shape for part, key in parts.items()} for m, parts in modules.items()}
    try:
        shapes = {m: patched_shape(parts) for m, parts in info.items()}
    except (KeyError, IndexError) as error:
        raise StackError(f"{path}: a module lacks its factor {error} (an incomplete LoRA); re-save "
                         f"it") from None
    return _Lora(entry, position, file, modules, shapes, archs.detect_lora(shapes))


def _common_arch(loras: list[_Lora]) -> str:
    """The family of the stack; LoRAs of two known families are refused."""
    known = [lora for lora in loras if lora.arch != archs.UNKNOWN]
    for lora in known[1:]:
        if lora.arch != known[0].arch:
            first = known[0]
            raise StackError(f"LoRA {lora.position} ({lora.file.path.name}) is a {lora.arch} LoRA but LoRA "
                             f"{first.position} ({first.file.path.name}) is {first.arch}: LoRAs made for "
                             f"different base models cannot be merged into one; stack only LoRAs of one "
                             f"model family")
    return known[0].arch if known else archs.UNKNOWN


def _check_plan(loras: list[_Lora], modules: list[str], report: StackReport, options: StackOptions) -> None:
    """Shapes agree per module, the rank fits every module, block maps name blocks: from headers only."""
    shape: dict[str, tuple[int, int]] = {}
    owner: dict[str, _Lora] = {}
    for lora in loras:
        if lora.entry.blocks:
            blocks.check_map(lora.entry.blocks, report.arch)
        for module, here in lora.shapes.items():
            if shape.setdefault(module, here) != here:
                raise StackError(f"LoRA {lora.position} ({lora.file.path.name}) patches module {module} as a "
                                 f"{here[0]} x {here[1]} weight, LoRA {owner[module].position} "
                                 f"({owner[module].file.path.name}) as {shape[module][0]} x "
                                 f"{shape[module][1]}: they are made for different base models; stack only "
                                 f"LoRAs of one model")
            owner.setdefault(module, lora)
    for lora in loras[1:]:
        if report.arch == archs.UNKNOWN and not set(lora.modules) & set(loras[0].modules):
            report.warnings.append(f"LoRA {lora.position} ({lora.file.path.name}) shares no module with "
                                   f"LoRA 1 and their family is unknown: check that both are for the same "
                                   f"model")
    if options.rank is not None and options.energy is None:
        bound, module = min((min(s), m) for m, s in shape.items())
        if options.rank > bound:
            raise StackError(f"rank {options.rank} is larger than module {module} can hold (its weight is "
                             f"{shape[module][0]} x {shape[module][1]}, so at most rank {bound}, the "
                             f"smallest of this stack); give a rank <= {bound}, or an energy fraction "
                             f"such as 0.99")


def _merge_modules(loras: list[_Lora], modules: list[str], report: StackReport, options: StackOptions,
                   runtime: MergeRuntime) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    dtype = OUT_DTYPES[options.dtype]
    for module in checked_steps(modules, runtime.check, runtime.on_progress):
        terms = [t for lora in loras if module in lora.modules
                 and (t := _term(lora, module, report.arch, options.device)) is not None]
        if not terms:
            report.zero.append(module)
            continue
        merged = _truncated(module, terms, options)
        if merged is None:
            report.zero.append(module)
            continue
        up, down, module_report = merged
        for part, tensor in (("lora_up.weight", up), ("lora_down.weight", down)):
            out = tensor.to(dtype).cpu()
            if not torch.isfinite(out).all():
                raise StackError(f"module {module}: the merged {part} has inf or NaN in {options.dtype} "
                                 f"(values up to {tensor.abs().max().item():.3g}); write fp32 or bf16, or "
                                 f"lower the strengths. Nothing was written")
            tensors[f"{module}.{part}"] = out
        tensors[f"{module}.alpha"] = torch.tensor(float(module_report.rank), dtype=dtype)
        report.modules[module] = module_report
    return tensors


@dataclass
class _Term:
    position: int
    up: torch.Tensor  # (out, r); a full (out, in) delta when ``down`` is None
    down: torch.Tensor | None  # (r, in * kh * kw), scaled
    tail: tuple[int, ...] = ()  # (in, kh, kw) of a convolution


def _term(lora: _Lora, module: str, arch: str, device: str) -> _Term | None:
    """LoRA ``lora``'s delta on ``module`` at its strength x block weight; None when that is 0."""
    entry = lora.entry
    text = module.startswith(_TEXT)
    scale = entry.clip_strength if text and entry.clip_strength is not None else entry.strength
    if entry.blocks:
        scale *= _block_weight(entry.blocks, arch, module)
    if scale == 0:
        return None
    t = {part: lora.file.read(key).to(device).float() for part, key in lora.modules[module].items()}
    for part, tensor in t.items():
        if not torch.isfinite(tensor).all():
            raise StackError(f"{lora.file.path}: module {module} has inf or NaN in its {part}; the file is "
                             f"broken: re-save or re-download it, or leave it out of the stack")
    factors = module_factors(t)
    if factors is None:
        return _Term(lora.position, module_delta(t).reshape(lora.shapes[module][0], -1) * scale, None)
    return _Term(lora.position, factors[0], factors[1] * scale, _kernel(t))


def _kernel(t: dict[str, torch.Tensor]) -> tuple[int, ...]:
    """(in, kh, kw) of a convolution's weight where the factors tell it (LoCon, LoKr); else ()."""
    down, w2 = t.get("lora_down.weight"), t.get("lokr_w2")
    if down is not None and down.dim() == 4:
        return tuple(down.shape[1:])
    if w2 is not None and w2.dim() == 4:
        w1 = t["lokr_w1"] if "lokr_w1" in t else t["lokr_w1_b"]
        return (w1.shape[1] * w2.shape[1], *w2.shape[2:])
    return ()


def _block_weight(mapping: Mapping[str, float], arch: str, module: str) -> float:
    """The module's weight in a block map: its exact name, its block, the first glob matching its block
    or its name (``OUT*``, ``*attn2*``), ``default``, else 1."""
    if module in mapping:
        return mapping[module]
    block = blocks.block_of(arch, block_key(arch, module, archs.LORA_PREFIXES))
    if block is not None and block in mapping:
        return mapping[block]
    for pattern, value in mapping.items():
        if pattern != "default" and any(fnmatch.fnmatchcase(name, pattern) for name in (block or "", module)):
            return value
    return mapping.get("default", 1.0)


def _truncated(module: str, terms: list[_Term], options: StackOptions
               ) -> tuple[torch.Tensor, torch.Tensor, ModuleReport] | None:
    """(up, down, report) of the sum of ``terms`` truncated to the options' rank or energy."""
    factored = [t for t in terms if t.down is not None]
    full = [t.up for t in terms if t.down is None]
    out, cols = terms[0].up.shape[0], (factored[0].down if factored else terms[0].up).shape[1]
    if factored:
        ups = torch.cat([t.up for t in factored], 1)
        downs = torch.cat([t.down for t in factored], 0)
    if not full:
        q_up, r_up = torch.linalg.qr(ups)
        q_down, r_down = torch.linalg.qr(downs.T)
        u_core, s, vh_core = torch.linalg.svd(r_up @ r_down.T, full_matrices=False)
        u, vh = q_up @ u_core, vh_core @ q_down.T
        full_rank = min(out, cols, ups.shape[1])
    else:
        total = torch.stack(full).sum(0) + (ups @ downs if factored else 0)
        u, s, vh = torch.linalg.svd(total, full_matrices=False)
        full_rank = min(out, cols)
    if not torch.isfinite(s).all():
        raise StackError(f"module {module}: the stack's sum has inf or NaN (strengths too large?); lower "
                         f"them")
    if not torch.any(s > 0):
        return None
    tail = next((t.tail for t in factored if t.tail), ())
    up, down, rank, error = truncate(u, s, vh, options.rank if options.energy is None else None,
                                     options.energy, (out, *tail))
    return up, down, ModuleReport(module, rank, full_rank, error, _opposed(terms))


def _opposed(terms: list[_Term]) -> tuple[tuple[int, int, float], ...]:
    """(position i, position j, cosine) for each pair of terms whose deltas have a negative cosine."""
    norms = [_inner(t, t) ** 0.5 for t in terms]
    found = []
    for i, a in enumerate(terms):
        for j in range(i + 1, len(terms)):
            if norms[i] > 0 and norms[j] > 0:
                cosine = _inner(a, terms[j]) / (norms[i] * norms[j])
                if cosine < 0:
                    found.append((a.position, terms[j].position, round(cosine, 6)))
    return tuple(found)


def _inner(a: _Term, b: _Term) -> float:
    """Frobenius inner product of two terms' deltas, from their factors when both have them, in float64
    (in fp32 a LoRA against itself at another strength came out at cosines like -0.999998, depending
    on the threads' summation order)."""
    a_up, b_up = a.up.double(), b.up.double()
    if a.down is not None and b.down is not None:
        return float(((a_up.T @ b_up) * (a.down.double() @ b.down.double().T)).sum())
    if a.down is None and b.down is None:
        return float((a_up * b_up).sum())
    if a.down is None:  # a full, b low-rank
        return float(((a_up @ b.down.double().T) * b_up).sum())
    return float(((b_up @ a.down.double().T) * a_up).sum())
