"""T0: one import name per file of this repo (devtools/pack_imports.py): outside ComfyUI merge/ is
``patchbay_merge`` and the pure pack files are ``patchbay.*``, never a second name; the check that every
session ends with finds a file loaded twice; T1 is refused beside another tier in one pytest process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from progress import run_watched

pytestmark = pytest.mark.t0

ROOT = Path(__file__).resolve().parent.parent
DEVTOOLS = ROOT / "devtools"


def run_isolated(code: str, tmp_path: Path) -> dict:
    """``code`` in a fresh interpreter (no PYTHONPATH, no current folder on sys.path) with devtools/ on
    sys.path; its last line of output, read as JSON."""
    prelude = f"import json, sys\nsys.path.insert(0, {str(DEVTOOLS)!r})\nimport pack_imports\n"
    result = run_watched([sys.executable, "-I", "-c", prelude + textwrap.dedent(code)], capture_output=True,
                         text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_standalone_names_load_the_repos_files_once_and_nothing_of_comfyui(tmp_path):
    seen = run_isolated("""
        pack_imports.use_standalone_names()
        import patchbay.hooks.floats, patchbay.nodes.search_terms, patchbay.patcher.trace
        import patchbay_merge.execute, patchbay_merge.recipe
        try:
            import patchbay.merge
        except ImportError as error:
            refused = str(error)
        names = ("patchbay_merge.recipe", "patchbay.nodes.search_terms", "patchbay.hooks.floats")
        print(json.dumps({"files": [sys.modules[n].__file__ for n in names], "refused": refused,
                          "twice": pack_imports.loaded_under_two_names(),
                          "others": sorted(m for m in sys.modules if m.split(".")[0] in
                                           ("merge", "nodes", "hooks", "patcher", "comfy", "folder_paths"))}))
    """, tmp_path)
    assert seen["files"] == [str(ROOT / "merge" / "recipe.py"), str(ROOT / "nodes" / "search_terms.py"),
                             str(ROOT / "hooks" / "floats.py")]
    assert "outside ComfyUI the merge library is patchbay_merge" in seen["refused"]
    assert seen["twice"] == {} and seen["others"] == []  # nodes/__init__.py's registration loop did not run


def test_a_file_loaded_under_two_names_is_found(tmp_path):
    """The pack folder on sys.path (what README once told) beside the standalone names: merge/recipe.py
    becomes two modules, and their classes differ."""
    seen = run_isolated(f"""
        pack_imports.use_standalone_names()
        sys.path.insert(0, {str(ROOT)!r})
        import merge.recipe, patchbay_merge.recipe
        twice = pack_imports.loaded_under_two_names()
        print(json.dumps({{"recipe": twice.get("merge/recipe.py"), "files": len(twice),
                          "same_class": merge.recipe.ModelNode is patchbay_merge.recipe.ModelNode}}))
    """, tmp_path)
    assert seen["recipe"] == ["merge.recipe", "patchbay_merge.recipe"] and seen["files"] > 1
    assert seen["same_class"] is False


def test_t1_beside_another_tier_is_refused_before_a_test_runs(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PATCHBAY_TIERS", "PATCHBAY_TEST_REPORT")}
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q",
                             "tests/test_t0_floats.py", "tests/test_t1_docs_examples.py"],
                            capture_output=True, text=True, cwd=ROOT, env=env, check=False, timeout=300)
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    assert "T1 runs in a pytest process of its own" in result.stderr
