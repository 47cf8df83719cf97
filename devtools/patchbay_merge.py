"""Console entry of the merge engine: ``patchbay_merge.py {merge,extract,show,validate,methods} ...``.

The pack's ``merge/`` package uses relative imports and must not be imported through the pack root
(its ``__init__`` needs ComfyUI, and the repo root on ``sys.path`` would let our ``nodes/`` shadow
ComfyUI's), so it is loaded by path under the name ``patchbay.merge``, as tests/conftest.py does.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_merge_package() -> types.ModuleType:
    """``patchbay.merge`` imported from this checkout without running the pack's ``__init__``."""
    if "patchbay" not in sys.modules:
        package = types.ModuleType("patchbay")
        package.__path__ = [str(ROOT)]
        sys.modules["patchbay"] = package
    return importlib.import_module("patchbay.merge")


def main(argv: list[str] | None = None) -> int:
    load_merge_package()
    from patchbay.merge import cli

    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
