"""T0: merge/ is a library of its own: README's import runs with only devtools/standalone on sys.path, the
built-in methods are all there or the import fails, elementwise methods are elementwise, and the
CLI's defaults are MergeOptions'."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from progress import run_watched
from safetensors.torch import save_file

pytestmark = pytest.mark.t0

ROOT = Path(__file__).resolve().parent.parent
PACK_PACKAGES = ("comfy", "folder_paths", "nodes", "comfy_merge", "hooks", "patcher", "patchbay", "merge")


def readme_merge_example() -> str:
    """The Python block of README's "Merge models" section, with the pack folder it names."""
    section = (ROOT / "README.md").read_text().split("## Merge models", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S)[1]


def run_isolated(code: str, cwd: Path) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter: no PYTHONPATH, no current folder, no user site on sys.path."""
    return run_watched([sys.executable, "-I", "-c", code], capture_output=True, text=True, cwd=cwd)


def test_readme_import_merges_with_only_the_standalone_folder_on_sys_path(tmp_path):
    for name, seed in (("a", 1), ("b", 2)):
        gen = torch.Generator().manual_seed(seed)
        save_file({"model.diffusion_model.out.2.weight": torch.randn(4, 6, generator=gen)},
                  str(tmp_path / f"{name}.safetensors"))
    example = readme_merge_example()
    assert "from patchbay_merge import recipe" in example
    assert "ComfyUI/custom_nodes/ComfyUI-Patchbay" in example
    code = example.replace("ComfyUI/custom_nodes/ComfyUI-Patchbay", str(ROOT)) + textwrap.dedent(f"""
        leaked = sorted(m for m in sys.modules if m.split(".")[0] in {PACK_PACKAGES!r})
        assert not leaked, leaked
        assert sys.modules["patchbay_merge"].__path__ == [{str(ROOT / "merge")!r}]
    """)
    result = run_isolated(code, tmp_path)
    assert result.returncode == 0, result.stderr
    keys, warnings = result.stdout.strip().split(" ", 1)  # a file of no known family merges by key, saying so
    assert keys == "1" and "a.safetensors is of no known family" in warnings, result.stdout
    assert (tmp_path / "out.safetensors").is_file()


def test_a_failing_builtin_method_module_fails_the_import_every_time(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT / "devtools" / "standalone")!r})
        sys.modules["patchbay_merge.methods.ties"] = None  # as if ties.py raised on import
        for attempt in range(2):
            try:
                from patchbay_merge import recipe
            except ImportError as error:
                print(error)
            else:
                raise SystemExit("imported with a partial registry")
    """)
    result = run_isolated(code, tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and all("the built-in merge methods failed to load" in line for line in lines)
    assert "patchbay_merge.methods.ties" in lines[0]


def test_methods_flagged_elementwise_give_each_slice_of_their_whole_result():
    from patchbay_merge import method_registry as registry
    from patchbay_merge.context import KeyContext

    flagged = [m for m in registry.all_methods() if m.elementwise]
    assert {"weighted_sum", "add_difference", "n_average"} <= {m.name for m in flagged}
    gen = torch.Generator().manual_seed(0)
    for method in flagged:
        tensors = [torch.randn(6, 7, generator=gen) for _ in range(len(method.inputs) + method.variadic)]
        whole = method.fn(*tensors, ctx=KeyContext(key="k")).reshape(-1)
        part = method.fn(*(t.reshape(-1)[5:19] for t in tensors), ctx=KeyContext(key="k"))
        torch.testing.assert_close(part, whole[5:19], msg=method.name)


def test_cli_merge_flags_default_to_merge_options():
    from patchbay_merge import cli
    from patchbay_merge.plan import MergeOptions

    args = cli.build_parser().parse_args(["merge", "r.mecha", "out.safetensors"])
    defaults = MergeOptions()
    flags = [f.name for f in cli.merge_option_fields()]
    assert {name: getattr(args, name) for name in flags} == {name: getattr(defaults, name) for name in flags}
    assert args.overwrite is defaults.overwrite and args.progress is defaults.progress


def test_cli_merge_takes_every_merge_option():
    """The merge command's flags are generated from MergeOptions (issue 32): every field but search_dirs
    (--models-dir, every subcommand's) is a flag, and set flags reach the options."""
    import dataclasses

    from patchbay_merge import cli
    from patchbay_merge.plan import MergeOptions

    every = {f.name for f in dataclasses.fields(MergeOptions)}
    assert {f.name for f in cli.merge_option_fields()} == every - {"search_dirs"}
    args = cli.build_parser().parse_args([
        "merge", "r.mecha", "out.safetensors", "--overwrite", "--no-progress", "--no-fsync", "--prefetch",
        "5",
        "--chunk-elements", "1024", "--spill-dir", "spill", "--dtype", "bf16", "--workers", "3",
        "--nonfinite", "warn", "--models-dir", "models"])
    options = MergeOptions(**{f.name: getattr(args, f.name) for f in cli.merge_option_fields()},
                           search_dirs=cli._search_dirs(args))
    assert (options.overwrite, options.progress, options.fsync, options.prefetch, options.chunk_elements,
            options.spill_dir, options.dtype, options.workers, options.nonfinite) == (
        True, False, False, 5, 1024, Path("spill"), "bf16", 3, "warn")
    assert options.search_dirs[1:] == (Path("models"),)
