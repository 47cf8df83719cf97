"""The merge engine inside ComfyUI: its options with ComfyUI's interrupt and progress bar, the
process-wide merge cache, the resolver of recipe paths, and a recipe built into MODEL, CLIP, VAE.
Data flow: docs/architecture.md (One merge, end to end) and docs/design-merge-nodes.md.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import logging
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import comfy.model_management
import comfy.sd
import comfy.utils
import folder_paths
import torch

from ..merge.cache import MergeCache
from ..merge.checks import NonFiniteError
from ..merge.extract import ExtractOptions
from ..merge.plan import MergeOptions, MergeRuntime
from . import files, graph_model

if TYPE_CHECKING:
    from ..merge.session import MergeSession

UNET = "model.diffusion_model."
# The default budget of the nodes' cache_mb. The cache keeps fp32 copies of merged tensors next to the
# merged model itself: an SD1.5 checkpoint merged is about 4.3 GB in fp32, so the earlier 4096 doubled
# a merge's memory on a 16 GB machine (and held a live ComfyUI at 9 GB running the bundled workflows on
# tiny models, 4.8 GB at 1024). Raise it on the node to re-run large merges faster.
DEFAULT_CACHE_MB = 1024
CACHE = MergeCache(budget_mb=DEFAULT_CACHE_MB)
LOG = logging.getLogger("patchbay.merge")


class MergeBuildError(ValueError):
    """ComfyUI's loader laid the merged model out in a way the Merge node cannot fill in place."""


class MergeValueError(ValueError):
    """A merge whose values cannot be used (inf or NaN); the message names the key and the fix."""


def resolve(path: str) -> Path:
    """A recipe's model ``path`` -> a checked file (files.py: folders, security). A graph MODEL is a
    recipe leaf of its own (graph_model.py), never a path: a path naming one is refused with the fix."""
    graph_model.refuse_graph_name(path)
    return files.model_file(path)


def use_cache(cache_mb: float) -> MergeCache | None:
    """The shared cache with budget ``cache_mb`` (0: emptied and not used)."""
    CACHE.set_budget(max(0.0, cache_mb))
    return CACHE if cache_mb > 0 else None


def _progress() -> Any:
    bar = comfy.utils.ProgressBar(100)
    return lambda done, total: bar.update_absolute(done, max(total, 1))


def node_runtime(cache_mb: float = 0, cache_keep: Any = None) -> MergeRuntime:
    """A node's ``MergeRuntime``: the resolver, ComfyUI's interrupt (checked between keys and inside long
    keys), its progress bar and the process-wide ``CACHE`` (``cache_mb`` sets its budget; ``cache_keep``
    as ``MergeRuntime.cache_keep``)."""
    return MergeRuntime(cache=use_cache(cache_mb), cache_keep=cache_keep, resolve=resolve,
                        check=comfy.model_management.throw_exception_if_processing_interrupted,
                        on_progress=_progress())


def merge_run(*, cache_mb: float = 0, cache_keep: Any = None,
              **fields: Any) -> tuple[MergeOptions, MergeRuntime]:
    """A node's merge: ``MergeOptions`` of ``fields`` (no progress bar in the console; intermediates over
    the memory budget spill into ComfyUI's temp folder, made if missing: ComfyUI removes it at startup)
    and ``node_runtime(cache_mb, cache_keep)``."""
    spill = Path(folder_paths.get_temp_directory())
    spill.mkdir(parents=True, exist_ok=True)
    return MergeOptions(progress=False, spill_dir=spill, **fields), node_runtime(cache_mb, cache_keep)


class _DictSink:
    """Keys outside the diffusion model, copied (the pipeline reuses its buffers)."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def append(self, key: str, tensor: torch.Tensor) -> None:
        self.tensors[key] = tensor.clone()


class _ParamSink:
    """Diffusion-model weights copied into the parameters ComfyUI allocated (cast to their dtype)."""

    def __init__(self, targets: dict[str, torch.Tensor]) -> None:
        self.targets = targets

    def append(self, key: str, tensor: torch.Tensor) -> None:
        with torch.no_grad():
            self.targets[key].copy_(tensor)


def build_models(session: MergeSession, reuse: list | None = None) -> tuple[Any, Any, Any]:
    """(MODEL, CLIP or None, VAE or None) holding the merged weights: keys outside the diffusion model
    stream into a dict; ComfyUI's own loader builds MODEL, CLIP and VAE from it plus a stride-0
    placeholder per diffusion-model weight (no memory); then every diffusion-model weight streams
    straight into its parameter. Peak memory: one model, the small text encoders/VAE twice while they
    load, and the engine's bounded buffers.

    ``reuse``: a list holding the only reference to a MODEL an earlier merge built (Merge Grid's previous
    variant, no longer used): when the recipe gives only diffusion-model weights of its shapes, they
    stream into its parameters (no loader, no second model), all but the keys whose values it holds
    already (the same merge-cache id as the variant that filled it); else the list is emptied, freeing
    that model before a new one is built. ``session.unchanged_keys``: how many keys it kept."""
    spill = session.options.spill_dir
    in_place, rest = _split_plans(session)
    sink = _DictSink()
    session.stream(sink, rest, spill)
    state = sink.tensors
    session.unchanged_keys = 0
    if reuse:
        targets = None
        if not state:
            with contextlib.suppress(MergeBuildError):  # another family or shape: build anew
                targets = _targets(reuse[0], in_place)
        if targets is not None and len(targets) == len(reuse[0].model.diffusion_model.state_dict()):
            held, ids = getattr(reuse[0], _HELD, {}), _key_ids(session, in_place)
            todo = [plan for plan in in_place if held.get(plan.key) != ids[plan.key]]
            setattr(reuse[0], _HELD, {})  # unknown while it fills (a Cancel stops it part way)
            session.stream(_ParamSink(targets), todo, spill)
            setattr(reuse[0], _HELD, ids)
            session.unchanged_keys = len(in_place) - len(todo)
            return reuse[0], None, None
        reuse.clear()
        gc.collect()
    for plan in in_place:  # a stride-0 zero of the right shape: ComfyUI copies it, it costs nothing
        state[plan.key] = torch.zeros((), dtype=session.source_dtype(plan.key)).expand(plan.shape)
    model, clip, vae = _load(state, diffusion_only=all(key.startswith(UNET) for key in state))
    del state
    session.stream(_ParamSink(_targets(model, in_place)), in_place, spill)
    if reuse is not None:
        setattr(model, _HELD, _key_ids(session, in_place))
    return model, clip, vae


_HELD = "_patchbay_merge_ids"  # on a MODEL build_models may reuse: key -> id of the value it holds


def _split_plans(session: MergeSession) -> tuple[list, list]:
    """(diffusion-model weights streamed into the model's parameters, the other keys: streamed into a
    dict in their stored dtype, as loading the first input gives them)."""
    in_place = [p for p in session.plans if p.key.startswith(UNET) and p.passthrough is None]
    rest = [replace(p, dtype=session.source_dtype(p.key)) for p in session.plans
            if not (p.key.startswith(UNET) and p.passthrough is None)]
    return in_place, rest


def release(results: Iterable = ()) -> None:
    """Between two merges of one node (Merge Grid's variants): the merge cache's ``results`` that nothing
    reads again dropped now, not when a newcomer needs their room."""
    CACHE.discard(results)


def cache_wants(recipes: list, **fields: Any) -> list[frozenset] | None:
    """For recipes merged in this order by ``merge_models(recipe, reuse=...)`` (Merge Grid's variants),
    the results each should leave in the merge cache (``MergeRuntime.cache_keep``): those a later one
    merges (merge/grid.cache_wants), each after the first filling the previous one's model (a recipe of
    diffusion-model weights; the grid caches everything again when its first merge built a text encoder
    or VAE). Planned from the files' headers, nothing merged; None without a cache."""
    from ..merge.grid import cache_wants as wants
    from ..merge.pipeline import root_id
    from ..merge.plan import cache_salt
    from ..merge.session import MergeSession

    if fields.get("cache_mb", 0) <= 0:
        return None
    ids = []
    for recipe in recipes:
        options = MergeOptions(dtype="fp32", **{k: v for k, v in fields.items() if k != "cache_mb"})
        with MergeSession(recipe, options, runtime=MergeRuntime(resolve=resolve)) as session:
            unet, _ = _split_plans(session)
            salt = cache_salt(options)
            ids.append({p.key: root_id(session.graph, p, salt, session.arch) for p in unet})
    return wants(ids, [False] + [True] * (len(ids) - 1))


def _key_ids(session: MergeSession, plans: list) -> dict[str, tuple]:
    """What each key's merged value depends on (merge/pipeline.root_id, the merge cache's id): equal ids,
    equal values, so a reused model keeps a key whose id did not change (a block map's other blocks, an
    alpha's blocks at 0) without it being read, computed or copied again."""
    from ..merge.pipeline import root_id
    from ..merge.plan import cache_salt

    salt = cache_salt(session.options)
    return {plan.key: root_id(session.graph, plan, salt, session.arch) for plan in plans}


def _load(state: dict, diffusion_only: bool) -> tuple[Any, Any, Any]:
    if diffusion_only:
        loader = comfy.sd.load_diffusion_model_state_dict
        model = loader(state, **_no_dynamic(loader))
        return model, None, None
    loader = comfy.sd.load_state_dict_guess_config
    out = loader(state, output_vae=True, output_clip=True,
                 embedding_directory=folder_paths.get_folder_paths("embeddings"), **_no_dynamic(loader))
    if out is None or out[0] is None:
        raise MergeBuildError("ComfyUI did not recognise the merged model's architecture; save the merge "
                              "with Save Merge and load the file instead")
    return out[0], out[1], out[2]


def _no_dynamic(loader: Any) -> dict:
    """``disable_dynamic=True`` where the loader has it (0.33+): weights copied, never assigned."""
    return {"disable_dynamic": True} if "disable_dynamic" in inspect.signature(loader).parameters else {}


def _targets(model: Any, plans: list) -> dict[str, torch.Tensor]:
    if model is None:
        raise MergeBuildError("ComfyUI could not build a model from the merged weights; save the merge with "
                              "Save Merge and load the file instead")
    params = model.model.diffusion_model.state_dict()
    targets = {}
    for plan in plans:
        target = params.get(plan.key.removeprefix(UNET))
        if target is None or tuple(target.shape) != tuple(plan.shape) or (0 in target.stride() and
                                                                          target.numel() > 1):
            raise MergeBuildError(f"{plan.key}: ComfyUI's loader renamed or reshaped this weight, so the "
                                  f"Merge node cannot fill it in place; save the merge with Save Merge and "
                                  f"load it")
        targets[plan.key] = target
    return targets


def merge_models(recipe: object, reuse: list | None = None, **fields: Any) -> tuple[Any, Any, Any, list[str]]:
    """The Merge node: ``recipe`` merged into a fresh MODEL, CLIP and VAE (fp32 math, no file), and the
    report's lines for the node (its warnings also go to the log). ``reuse``: see ``build_models``."""
    from ..merge.session import MergeSession

    options, runtime = merge_run(dtype="fp32", **fields)
    with MergeSession(recipe, options, runtime=runtime) as session, _stopped_on_nonfinite("Merge"):
        model, clip, vae = build_models(session, reuse)
        report = session.finish()
    kept, unchanged = len(session.plans) - len(report.skipped), session.unchanged_keys
    note = f" ({unchanged} unchanged in the previous variant's model, not rewritten)" if unchanged else ""
    lines = [f"merged {kept} keys ({report.arch}), {report.cached_keys + unchanged} from the merge cache"
             f"{note}",
             *(f"warning: {w}" for w in report.warnings)]
    for warning in report.warnings:
        LOG.warning("Merge (Patchbay): %s", warning)
    return model, clip, vae, lines


def save_merge(recipe: object, filename: str, if_exists: str, **fields: Any) -> tuple[Path, Any]:
    """The Save node: ``recipe`` streamed into a checkpoint under the output folder; (path, report)."""
    from ..merge.execute import merge

    path = files.output_file(filename, if_exists)
    with _stopped_on_nonfinite("Save Merge"):
        report = merge(recipe, path, *merge_run(overwrite=if_exists == "overwrite", **fields))
    for warning in report.warnings:
        LOG.warning("Save Merge (Patchbay): %s", warning)
    return path, report


@contextlib.contextmanager
def _stopped_on_nonfinite(node: str) -> Iterator[None]:
    """The engine's inf/NaN error in a node's words: what stopped, where it comes from, what to change
    in the graph (the command line's --nonfinite flag has no widget here, on purpose)."""
    try:
        yield
    except NonFiniteError as error:
        raise MergeValueError(f"{node}: {error.key}: the merged values hold inf or NaN, so the merge stopped "
                              f"before a broken model reached the sampler or a file; {error.origin}. Change "
                              f"the method or its parameters (a <parameter>_map input sets them per block), "
                              f"or replace the input") from None


def extract(recipe: object, filename: str, if_exists: str, **fields: Any) -> tuple[str, Any]:
    """The Extract LoRA node: (the LoRA's name in the loras list, report); the list is refreshed."""
    from ..merge.extract import extract_lora

    path = files.lora_file(filename, if_exists)
    options = ExtractOptions(overwrite=if_exists == "overwrite", **fields)
    report = extract_lora(recipe, path, options, node_runtime())
    return _listed_lora(path), report


def merge_lora_stack(text: str, stack: Any, filename: str, if_exists: str, **fields: Any) -> tuple[str, Any]:
    """The Merge LoRA Stack node: the LoRAs of ``text`` (one a line, ``name: strength[, clip strength]
    [| block map]``) and of a LORA_STACK merged into one LoRA of the loras folder; (its name in the
    loras list, merge/stack_to_lora.py's report)."""
    from ..merge import stack_to_lora as lora_stack

    entries = [*_text_entries(text), *_stack_entries(stack)]
    path = files.lora_file(filename, if_exists)
    options = lora_stack.StackOptions(overwrite=if_exists == "overwrite", **fields)
    return _listed_lora(path), lora_stack.merge_lora_stack(entries, path, options, node_runtime())


def _text_entries(text: str) -> list[Any]:
    from ..hooks.block_weights import parse_block_map
    from ..merge.stack_to_lora import StackEntry, StackError

    entries = []
    for number, line in enumerate(text.splitlines(), start=1):
        body, _, blocks = line.split("#", 1)[0].partition("|")
        name, _, numbers = body.strip().rpartition(":") if ":" in body else (body.strip(), "", "1")
        if not name.strip():
            continue
        try:
            strengths = [float(n) for n in numbers.split(",")]
        except ValueError:
            strengths = []
        if not 1 <= len(strengths) <= 2:
            raise StackError(f"LoRA line {number} {line.strip()!r}: write name.safetensors: strength[, clip "
                             f"strength] [| block map], e.g. ink.safetensors: 0.8 | OUT*=0, default=1")
        block_map = parse_block_map(blocks) if blocks.strip() else None
        path = files.model_file(f"loras/{name.strip()}")
        entries.append(StackEntry(path, *strengths, blocks=block_map))
    return entries


def _stack_entries(stack: Any) -> list[Any]:
    from ..hooks.lora_stack import stack_entries
    from ..merge.stack_to_lora import StackEntry

    return [StackEntry(files.model_file(f"loras/{e.name}"), e.strength_model, e.strength_clip)
            for e in stack_entries(stack)]


def _listed_lora(path: Path) -> str:
    """``path``'s name in the loras list, which is refreshed so the new file shows at the next queue."""
    getattr(folder_paths, "filename_list_cache", {}).pop("loras", None)
    root = Path(folder_paths.get_folder_paths("loras")[0])
    return path.relative_to(root).as_posix()


def apply_lora(model: Any, clip: Any, name: str, strength_model: float, strength_clip: float) -> tuple:
    """(model, clip) with LoRA ``name`` of the loras folder applied, exactly as LoraLoader applies it."""
    lora = comfy.utils.load_torch_file(folder_paths.get_full_path_or_raise("loras", name), safe_load=True)
    return comfy.sd.load_lora_for_models(model, clip, lora, strength_model, strength_clip)


def recipe_hook(recipe: object, base: object | None, strength_model: float, *, keyframes: Any = None,
                prev: Any = None, seed: int = 0, cache_mb: float = 0, architecture_policy: str = "refuse"
                ) -> Any:
    """The Recipe Hook node: HOOKS adding ``strength_model * (recipe - base)`` to the diffusion model's
    weights, each key's delta merged on first use (merge/delta.py, hooks/recipe_hook.py). The recipe's
    inputs are opened and checked here (one architecture); nothing is merged yet."""
    from ..hooks.recipe_hook import recipe_hook as make_hook
    from ..merge.delta import RecipeDeltas, delta_recipe

    options, runtime = merge_run(dtype="fp32", seed=seed, cache_mb=cache_mb,
                                 architecture_policy=architecture_policy)
    deltas = RecipeDeltas(delta_recipe(recipe, base), options, runtime)
    shapes = {graph_model.comfy_key(key): shape for key, shape in deltas.shapes.items()
              if key.startswith(UNET)}
    if not shapes:
        raise MergeBuildError(f"recipe hook: the recipe ({deltas.arch}) has no diffusion-model weight, so "
                              f"the hook would change nothing; give it a recipe over checkpoints or "
                              f"diffusion models")

    def fetch(key: str) -> torch.Tensor | None:
        return deltas.delta(graph_model.canonical_key(key))
    return make_hook(fetch, shapes, strength_model, keyframes, prev, name="recipe hook")
