"""Shared fixtures for the four test tiers (markers t0..t3, see pyproject.toml).

- Import names (devtools/pack_imports.py): T0, T2 and T3's test processes import the merge library as
  ``patchbay_merge`` (``from patchbay_merge import recipe``); T1 loads the pack into its process as
  ComfyUI does and reaches the library only as ``comfy.pack.merge``, so T1 runs in a pytest process of
  its own and every session fails if it holds a file of this repo under two names.
- ``pack``: the pack's other pure modules (hooks, patcher, nodes/search_terms.py) as the package
  ``patchbay``, without its ``__init__`` (T0; nothing from ComfyUI is imported).
- ``models``: the tiny generated models (devtools/tiny_models.py), made once per session.
- ``comfy``: ComfyUI in-process (T1): core and extra nodes initialised, this pack loaded through
  ComfyUI's own ``nodes.load_custom_node`` from a ``custom_nodes/ComfyUI-Patchbay`` link.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import shutil
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "devtools"))

import devpaths  # noqa: E402
import lane_gate  # noqa: E402
import memwatch  # noqa: E402
import pack_imports  # noqa: E402

pack_imports.use_standalone_names()


@pytest.fixture(scope="session")
def pack() -> types.ModuleType:
    """The pack's ComfyUI-free files as ``patchbay`` (devtools/standalone/patchbay): T0 imports
    ``patchbay.hooks.floats`` and ``patchbay.patcher.trace`` without the pack's registration loops."""
    import patchbay

    return patchbay


@pytest.fixture(scope="session")
def models():
    import tiny_models

    return tiny_models.ensure_models(devpaths.models_dir())


_PACK_LOCK: list = []  # the open lock file of the shared pack folder, held for the whole session


def _pack_parent() -> Path:
    """Where the in-process ComfyUI loads the pack from: a folder that stays the same from run to run
    and from clone to clone (one per ComfyUI environment, beside the environments), not a temporary one.

    The pack's module names hold that path, and so do the names dynamo gives the sizes it makes dynamic
    in Fast Hooks' compiled graphs (a hash of the source name): a new path each run misses inductor's
    graph cache and compiles the hooked UNet again (about 60 s per version, test_t1_compile_hooks.py).
    A session holds the folder's lock while it runs; a second session at the same time (another clone,
    another worktree) takes a folder inside its own clone instead, so it never loads the other's code.
    """
    import fcntl

    name = devpaths.comfyui_dir().resolve().parent.name
    shared = devpaths.env_cache_dir() / "test-pack" / name
    shared.mkdir(parents=True, exist_ok=True)
    handle = open(shared / ".lock", "w")  # noqa: SIM115 - held until the process ends
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        return devpaths.cache_dir() / "test-pack" / name
    _PACK_LOCK.append(handle)
    return shared


@pytest.fixture(scope="session")
def comfy(models, tmp_path_factory):
    """ComfyUI imported in-process on the CPU with this pack loaded as a custom node."""
    import comfy_inprocess

    nodes = comfy_inprocess.start_comfy(output_dir=tmp_path_factory.mktemp("comfy_output"))
    pack = comfy_inprocess.load_pack(nodes, _pack_parent())
    import folder_paths

    gc.collect()
    gc.freeze()  # what import made lives as long as the process: no collection walks it again
    return types.SimpleNamespace(nodes=nodes, folder_paths=folder_paths, pack=pack)


@pytest.fixture(scope="session")
def compile_backend() -> str:
    """The torch.compile backend of Fast Hooks' compile tests (test_t1_compile_hooks.py):
    $PATCHBAY_COMPILE_BACKEND, else inductor. `make test` runs inductor on the last (newest) ComfyUI
    version and dynamo's eager backend on the others (devtools/test_versions.sh).

    What those tests assert differs by ComfyUI version only where ComfyUI's wrappers and Fast Hooks meet
    dynamo: which graphs dynamo captures, what they hold, what they guard on (no recompiles), and that
    the latents match; the eager backend runs the captured graphs as they are. Inductor's code
    generation is torch's, the same under every ComfyUI version, and costs about 2.5 minutes on 2 cores
    on a fresh machine (no inductor cache; the eager backend: 30 s), so it runs on one version."""
    return os.environ.get("PATCHBAY_COMPILE_BACKEND") or "inductor"


@pytest.fixture(scope="session")
def merge_library(comfy) -> types.ModuleType:
    """T1's merge library: the loaded pack's ``merge`` (``comfy.pack.merge``, the one name it has in a
    ComfyUI process), every module of it imported, so that ``merge_library.cli`` is there too."""
    import importlib
    import pkgutil

    package = comfy.pack.merge
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(module.name)
    return package


# ---- the tiny SD1.5 scene that the t1 modules sampling a checkpoint share --------------------------

@pytest.fixture(scope="module")
def sd15(comfy, models) -> types.SimpleNamespace:
    """The tiny SD1.5 checkpoint through ComfyUI's own nodes, one per module (freed with it):
    ``nodes`` (node classes by id), ``model``, ``clip``, ``vae`` (CheckpointLoaderSimple of
    ``tiny_models.SD15_CHECKPOINT``, or of ``checkpoint(name)`` for another one), ``encode(text)``
    (CLIPTextEncode), ``latent`` (EmptyLatentImage 64 x 64: an 8 x 8 latent), ``lora_hooks(model_strength=1,
    clip_strength=1)`` (CreateHookLora of ``tiny_models.SD15_LORA``) and ``hooked(cond, hooks)``
    (ConditioningSetProperties: the hooks on the whole cond). A module's own sampler settings stay in
    the module."""
    from tiny_models import SD15_CHECKPOINT, SD15_LORA

    n = comfy.nodes.NODE_CLASS_MAPPINGS

    def checkpoint(name: str = SD15_CHECKPOINT) -> tuple:
        return n["CheckpointLoaderSimple"]().load_checkpoint(name)

    def lora_hooks(model_strength: float = 1.0, clip_strength: float = 1.0):
        return n["CreateHookLora"]().create_hook(SD15_LORA, model_strength, clip_strength)[0]

    model, clip, vae = checkpoint()
    return types.SimpleNamespace(
        nodes=n, model=model, clip=clip, vae=vae, checkpoint=checkpoint, lora_hooks=lora_hooks,
        encode=lambda text: n["CLIPTextEncode"]().encode(clip, text)[0],
        latent=n["EmptyLatentImage"]().generate(64, 64, 1)[0],
        hooked=lambda cond, hooks: n["ConditioningSetProperties"]().set_properties(cond, 1.0, "default",
                                                                                  hooks=hooks)[0])


# The per-process model caches of devtools (module, function): emptied after each test function.
SHARED_MODELS = (("arch_sampling", "shared_model"), ("gguf_sampling", "shared_gguf"))


@pytest.fixture(scope="module", autouse=True)
def _memory_back_after_each_module():
    """After each test module: the models it loaded are freed and their memory goes back to the system.

    Module fixtures hold a module's models (torn down before this fixture, which is set up first);
    ``arch_sampling.shared_model`` keeps the tiny Flux (2.3 GB in fp32) and SDXL loaded for the tests
    that only clone them (``gguf_sampling.shared_gguf`` their GGUF files, 1.1 GB), and the Merge node's
    process-wide cache keeps up to ``cache_mb`` of merge results: all are emptied here, so the next
    module that needs them loads them again (seconds) instead of the whole session, servers and
    browser included, running beside them. glibc keeps freed tensor memory in the heap for the process
    to reuse (about 1 GB per loaded checkpoint, never given back: one version's T1 grew to 12 GB);
    ``malloc_trim`` returns it. Measured on T1: 6.8 GB held after the merge-hook module, 3.4 GB after
    gc and malloc_trim, 1.0 GB with the shared models freed. What survives the collection (torch's and
    dynamo's caches: 220k objects after the compile tests) is frozen out of later collections, each of
    which walked it after every test that held more than GC_ABOVE_BYTES: 0.17-0.45 s per test (measured
    on 0.33's T1), 5 ms frozen (a frozen object that later becomes garbage is freed by its reference
    count, not by the collector).
    """
    yield
    _free_shared_models()
    for name, module in list(sys.modules.items()):
        if name.endswith(".comfy_merge.runtime") and hasattr(module, "CACHE"):
            module.CACHE.clear()
    gc.collect()
    gc.freeze()  # what outlived its module is not walked again by every later collection
    _return_freed_memory()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After each test, ComfyUI's folder listings are dropped (a passed test's ``tmp_path`` is deleted at
    its teardown, and a cached listing that names a deleted folder raises on its next use). After the
    last test of a function (all its parameters), its shared models are freed: a module
    that samples the tiny Flux in one test otherwise holds its 2.3 GB through every later test of the
    module (the next function that needs it loads it again, in seconds). A process that holds more than
    GC_ABOVE_BYTES after a test collects its garbage and trims its heap: ComfyUI's patchers and models
    sit in reference cycles that Python's collector reaches only now and then (measured on 0.33's T1:
    a test module's peak 5.7 GB without, 4.3 GB with; 4.6 GB held into the next module without,
    1.7 GB with). Then the heavy-test gate opens unless the next test is heavy too (HEAVY_GATE)."""
    folder_paths = sys.modules.get("folder_paths")
    if folder_paths is not None:  # ComfyUI's folder listings: a test's temporary model folders are
        folder_paths.filename_list_cache.clear()  # deleted after it, and a listing stats its folders
    same_function = (nextitem is not None and nextitem.module is item.module
                     and getattr(nextitem, "originalname", None) == getattr(item, "originalname", None))
    freed = not same_function and _free_shared_models()
    if freed or memwatch.resident_bytes(os.getpid()) > GC_ABOVE_BYTES:
        gc.collect()
        _return_freed_memory()
    if not (_is_heavy(nextitem) and nextitem.module is item.module):
        HEAVY_GATE.leave()
    if _LIVE_SERVER and nextitem is not None and (_tier_of(item.keywords), _tier_of(nextitem.keywords)) == \
            ("t2", "t3"):
        _LIVE_SERVER[0].restart()  # T3 starts without T2's models (comfy_server)


def _free_shared_models() -> bool:
    """Empty the devtools model caches (SHARED_MODELS); whether any held a model."""
    held = False
    for module_name, cached in SHARED_MODELS:
        module = sys.modules.get(module_name)
        if module is not None:
            function = getattr(module, cached)
            held |= function.cache_info().currsize > 0
            function.cache_clear()
    return held


def _return_freed_memory() -> None:
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


GC_ABOVE_BYTES = 2500 << 20  # T1's process holds about 1 GB with ComfyUI and the pack loaded


def _is_heavy(item) -> bool:
    """Marked ``heavy``: the test peaks above about 4.3 GB (the tiny Flux in fp32 and a patched copy;
    measured per test). `make test` runs its lanes side by side and sets $PATCHBAY_HEAVY_LOCK, one file
    for all lanes: two heavy tests at once in two lanes would take the run past the suite's 10 GB, and
    every other T1 test stays under about 4.3 GB. The gate is taken before a heavy test's fixtures are
    set up, and given back after its teardown has freed its models, or after the last of a run of heavy
    tests in one module. Unset (pytest by hand): no gate."""
    return item is not None and item.get_closest_marker("heavy") is not None


HEAVY_GATE = lane_gate.LaneGate(os.environ.get("PATCHBAY_HEAVY_LOCK"))


@pytest.fixture(scope="session")
def weights_digest():
    """sha256 over a patcher's model state dict (names and raw bytes): equal means byte-identical.
    The bytes are hashed in place (no copy: the tiny Flux is 2.3 GB in fp32)."""
    import hashlib

    import torch

    def digest(patcher) -> str:
        h = hashlib.sha256()
        for key, tensor in sorted(patcher.model.state_dict().items()):
            h.update(key.encode())
            h.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        return h.hexdigest()

    return digest


# ---- tier accounting: every tier must run, and nothing may be skipped on CI ----------------------

TIERS = ("t0", "t1", "t2", "t3")
_tier_outcomes: dict[str, dict[str, int]] = {tier: {} for tier in TIERS}
_tier_seconds: dict[str, float] = {tier: 0.0 for tier in TIERS}


def _selected_tiers() -> tuple[str, ...]:
    """$PATCHBAY_TIERS (e.g. "t1 t2 t3", what `make test` gives every ComfyUI version after the first:
    t0 imports no ComfyUI, so it runs once); unset or empty: every tier (but T1 runs only in a process of
    its own: _refuse_t1_beside_other_tiers)."""
    named = tuple(os.environ.get("PATCHBAY_TIERS", "").replace(",", " ").split()) or TIERS
    unknown = sorted(set(named) - set(TIERS))
    if unknown:
        raise pytest.UsageError(f"PATCHBAY_TIERS names {unknown}; the tiers are {' '.join(TIERS)}")
    return named


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.hookimpl(trylast=True)  # after -k and -m deselect: the tiers that will run
def pytest_collection_modifyitems(config, items):
    untiered = [item.nodeid for item in items if not any(item.get_closest_marker(t) for t in TIERS)]
    if untiered:
        raise pytest.UsageError(f"tests without a tier marker (t0..t3): {untiered}")
    selected = _selected_tiers()
    left_out = [item for item in items if not any(item.get_closest_marker(t) for t in selected)]
    # Tests marked gpu (a tier marker too) need a CUDA device: where there is none they are deselected,
    # like the tiers not asked for, so a CPU run shows no skip (`make test-gpu` runs them on a GPU).
    gpu = [item for item in items if item.get_closest_marker("gpu") and item not in left_out]
    if gpu and not _has_cuda():
        left_out += gpu
    # Tests marked once give the same answer on every ComfyUI version (their docstring says why);
    # `make test` sets PATCHBAY_ONCE_DONE for the versions after the first.
    if os.environ.get("PATCHBAY_ONCE_DONE"):
        left_out += [item for item in items if item.get_closest_marker("once") and item not in left_out]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if item not in left_out]
    _refuse_t1_beside_other_tiers(items)


def _refuse_t1_beside_other_tiers(items) -> None:
    """T1 holds the pack under the name ComfyUI gives it; T0, T2 and T3 import ``patchbay_merge`` and
    ``patchbay``: in one process merge/'s files would be loaded under two names (devtools/pack_imports.py)."""
    tiers = {tier for item in items for tier in TIERS if item.get_closest_marker(tier)}
    if "t1" in tiers and len(tiers) > 1:
        raise pytest.UsageError(
            f"tests of tiers {sorted(tiers)} selected: T1 runs in a pytest process of its own (it loads the "
            "pack as ComfyUI does; the others import the merge library as patchbay_merge). Set "
            "PATCHBAY_TIERS=t1, then PATCHBAY_TIERS=\"t0 t2 t3\", or run `make test`")


def _tier_of(keywords) -> str | None:
    return next((tier for tier in TIERS if tier in keywords), None)


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures load its models
def pytest_runtest_setup(item):
    """Name the running tier in $PATCHBAY_MEM_LABEL's file, so devtools/memwatch.py (which `make test`
    runs beside the tests) attributes the memory it samples to this version and tier (and the test, on
    the file's second line, so the summary names what ran at the run's peak); a heavy test waits for the
    heavy-test gate (HEAVY_GATE)."""
    if _is_heavy(item):
        HEAVY_GATE.enter()
    tier = _tier_of(item.keywords)
    label_file = os.environ.get("PATCHBAY_MEM_LABEL")
    if tier and label_file:  # replaced whole (written beside the labels' folder): never read half written
        label = Path(label_file)
        staged = label.parent.parent / f".{label.name}.{os.getpid()}"
        staged.write_text(f"{_comfyui_version_or_none()} {tier}\n{item.nodeid}")
        os.replace(staged, label)


def pytest_runtest_logreport(report):
    tier = _tier_of(report.keywords)
    if tier is None:
        return
    _tier_seconds[tier] += report.duration
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        counts = _tier_outcomes[tier]
        counts[report.outcome] = counts.get(report.outcome, 0) + 1


def _comfyui_version_or_none() -> str:
    try:
        return devpaths.comfyui_version()
    except RuntimeError:  # T0 runs without a ComfyUI (PATCHBAY_COMFYUI unset)
        return "none"


def _comfyui_label() -> str:
    version = _comfyui_version_or_none()
    return "no ComfyUI" if version == "none" else f"ComfyUI {version}"


def pytest_report_header(config):
    return f"patchbay: {_comfyui_label()}"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    line = ", ".join(
        f"{tier}: " + (" ".join(f"{n} {o}" for o, n in sorted(c.items())) or "none")
        for tier, c in _tier_outcomes.items()
    )
    terminalreporter.write_line(f"tiers on {_comfyui_label()} -> {line}")
    ran = {tier: seconds for tier, seconds in _tier_seconds.items() if _tier_outcomes[tier]}
    terminalreporter.write_line("tier seconds (setup, call and teardown of its tests) -> "
                                + (", ".join(f"{t}: {s:.0f}" for t, s in ran.items()) or "none"))
    if HEAVY_GATE.waited >= 1:
        terminalreporter.write_line(f"heavy tests waited {HEAVY_GATE.waited:.0f} s for another lane's "
                                    "(the heavy-test gate, tests/conftest.py)")
    report = os.environ.get("PATCHBAY_TEST_REPORT")
    if report:  # read by devtools/test_versions.sh for its summary table
        Path(report).write_text(json.dumps({"version": _comfyui_version_or_none(), "exit": int(exitstatus),
                                            "tiers": {t: {"seconds": round(s, 1), **_tier_outcomes[t]}
                                                      for t, s in ran.items()}}))


def pytest_sessionfinish(session, exitstatus):
    twice = pack_imports.loaded_under_two_names()
    if twice:  # one file, two modules: two classes of one name (devtools/pack_imports.py)
        print("\nfiles of this repo loaded under two module names in this process: "
              + "; ".join(f"{file}: {', '.join(names)}" for file, names in twice.items()))
        session.exitstatus = 1
    if os.environ.get("CI") and not session.config.option.markexpr and exitstatus == 0:
        empty = [t for t, c in _tier_outcomes.items() if t in _selected_tiers() and not c.get("passed")]
        skipped = [t for t, c in _tier_outcomes.items() if c.get("skipped")]
        if empty or skipped:
            print(f"\nCI requires every tier to run: no passing test in {empty}, skips in {skipped}")
            session.exitstatus = 1


# ---- T2/T3: one live ComfyUI server per session --------------------------------------------------


@pytest.fixture(scope="session")
def comfy_server(models):
    """ComfyUI in a subprocess with this pack loaded (devtools/comfy_server.py), shared by T2 and T3.

    The real AnimateDiff-Evolved and Advanced-ControlNet are loaded next to it, as the vendor folder
    pins them for this ComfyUI version (devtools/vendor_packs.py), and the test-only stand-in nodes
    (devtools/stand_ins.py: conditioning for a text encoder that cannot be tiny). Images go to
    output/test-comfyui-<version>/, emptied when the server starts (a run keeps the previous run's
    files for a look, not every run's: each adds about 3 GB of saved merges and LoRAs), the server log
    to output/logs/test-comfyui-<version>.log; the frontend settings keep first-run popups out of the
    browser tests' way. Between T2 and T3 the server restarts: it holds every model T2 loaded and the
    merge cache (4.1 GB on 0.3.75, which ComfyUI's ``/free`` did not lower), and T3 runs beside the
    other version's tiers.
    """
    from comfy_server import ComfyServer
    from frontend import HEADLESS_SETTINGS
    from stand_ins import PACKS
    from vendor_packs import ensure_packs

    version, outputs = devpaths.comfyui_version(), devpaths.output_dir()
    log = outputs / "logs" / f"test-comfyui-{version}.log"
    # one output folder per version: `make test` runs the versions' servers side by side, and ComfyUI
    # numbers a saved file by the files already in its folder
    output = outputs / f"test-comfyui-{version}"
    shutil.rmtree(output, ignore_errors=True)
    with ComfyServer(output, log_path=log, settings=HEADLESS_SETTINGS,
                     extra_packs={**ensure_packs(version), **PACKS}) as server:
        _LIVE_SERVER[:] = [server]
        try:
            yield server
        finally:
            _LIVE_SERVER.clear()


_LIVE_SERVER: list = []  # the running comfy_server, restarted between T2 and T3


@pytest.fixture(scope="session")
def object_info(comfy_server) -> dict:
    """The live server's ``/object_info``."""
    return comfy_server.object_info()


@pytest.fixture(scope="session")
def frontend_version(comfy_server) -> str:
    """The version of the frontend the live server serves (workflow_api's rules follow it)."""
    return comfy_server.frontend_version()


# ---- the repo root is a ComfyUI pack, not a test package -------------------------------------------


class _PackRootIsADirectory:
    """Collect the repo root as a plain directory. As a Package (it has an ``__init__.py``) pytest would
    import the pack's ``__init__.py`` before the first test, outside ComfyUI, where ``comfy`` is not
    importable; the pack is imported only as ComfyUI imports it (fixture ``comfy``). Registered as a
    plugin, not a conftest hook, because conftest hooks are not asked about their parent directory."""

    @staticmethod
    def pytest_collect_directory(path, parent):
        if path == ROOT:
            return pytest.Dir.from_parent(parent, path=path)
        return None


def pytest_configure(config):
    config.pluginmanager.register(_PackRootIsADirectory(), "patchbay-pack-root-is-a-directory")
