"""One import name per module: which name this repo's files have in which process, and the loader.

A file imported under two names is two modules: two classes that ``isinstance`` tells apart, two
registries (merge methods, the hook claimer), two caches. So a process gives every file one name:

  process                                       merge/                the pack's other files
  ComfyUI: a user's, T1's in-process one,       <pack>.merge          <pack>.nodes, <pack>.hooks, ...
    T2/T3's server                              (<pack>: the name ComfyUI's loader gives the folder)
  standalone: devtools/patchbay_merge.py (CLI), patchbay_merge        patchbay.hooks, patchbay.patcher,
    bench_merge.py, build_merge_docs.py, T0,                          patchbay.nodes.search_terms (T0)
    T2/T3's test process, a user's script
  ``pip install`` of the repo (pyproject.toml)  patchbay_merge        (not installed)

Inside ComfyUI the pack reaches merge/ by relative imports only, so ``<pack>.merge`` is the one name
there; a T1 test takes it from the loaded pack (``comfy.pack.merge``; the fixture ``merge_library`` is
that package with every module imported, ``merge_library.cli`` too) and never imports ``patchbay_merge``.
Everywhere else the library is ``patchbay_merge``, the name ``pip install`` gives it: a script of this
repo calls ``use_standalone_names()``, which puts devtools/standalone/ first on
``sys.path``. That folder holds only shim packages, whose ``__init__`` sets ``__path__`` (the documented
way a package names the folders of its submodules): ``patchbay_merge`` -> merge/, ``patchbay`` -> the repo
root, and ``patchbay.nodes`` -> nodes/ without its registration loop (which imports ComfyUI);
``patchbay.merge`` raises ImportError, so merge/ has no third name there. The
library's files are merge/'s own (``patchbay_merge.recipe.__file__`` is merge/recipe.py), loaded by
Python's ordinary path finder.

Not done, and why: the pack folder on ``sys.path`` (``import merge``) would make ``merge`` a name of its
own and its ``nodes/`` shadow ComfyUI's ``nodes`` module; ``pip install -e`` points a shared environment
(cached outside the clone, used by every clone) at one clone; loading by ``spec_from_file_location`` and
assigning into ``sys.modules`` (what devtools/patchbay_merge.py did) or a meta-path finder is the import
system done by hand, where two loaders can disagree on a name.

T1 loads the pack into its pytest process while T0, T2 and T3 import the standalone names, so
tests/conftest.py runs T1 in a pytest process of its own (as ``make test`` does), and every session
ends by failing if ``loaded_under_two_names()`` finds a file of this repo under two names.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STANDALONE = ROOT / "devtools" / "standalone"
MERGE_DIR = ROOT / "merge"


def use_standalone_names() -> None:
    """Make ``patchbay_merge`` (merge/) and ``patchbay`` (hooks/, patcher/, nodes/search_terms.py) importable
    in a process without ComfyUI: devtools/standalone/ first on ``sys.path``, ahead of an installed copy, and
    ``patchbay_merge`` bound now, so that devtools/ put ahead of it later (where the script
    devtools/patchbay_merge.py lies) changes nothing."""
    if str(STANDALONE) not in sys.path:
        sys.path.insert(0, str(STANDALONE))
    import patchbay_merge

    if list(getattr(patchbay_merge, "__path__", [])) != [str(MERGE_DIR)]:
        raise RuntimeError(f"patchbay_merge was imported from {patchbay_merge.__file__}, not from this "
                           f"checkout's merge/ ({MERGE_DIR}), before devtools/standalone/ was on sys.path")


def loaded_under_two_names(modules: dict | None = None) -> dict[str, list[str]]:
    """``{file of this repo: its names}`` for every file that ``modules`` (``sys.modules``) holds under
    more than one name. Files are compared resolved: ComfyUI loads the pack through a link."""
    names: dict[str, list[str]] = {}
    for name, module in list((sys.modules if modules is None else modules).items()):
        file = getattr(module, "__file__", None)
        if not isinstance(file, str):
            continue
        path = Path(file).resolve()
        if path.is_relative_to(ROOT):
            names.setdefault(path.relative_to(ROOT).as_posix(), []).append(name)
    return {file: sorted(found) for file, found in sorted(names.items()) if len(found) > 1}
