"""Console entry of the merge engine: ``patchbay_merge.py {merge,extract,show,validate,methods} ...``.

``merge/`` is a standalone package: a script with the pack folder on ``sys.path`` writes
``from merge import recipe`` (README). This entry and the tests import it under that same name
without putting the pack folder on ``sys.path``, where the pack's ``nodes/`` would shadow
ComfyUI's ``nodes`` module for whatever imports it later in the process.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

MERGE_DIR = Path(__file__).resolve().parent.parent / "merge"


def load_merge_package() -> types.ModuleType:
    """This checkout's ``merge/`` as the top-level package ``merge``, as ``import merge`` gives it."""
    if "merge" in sys.modules:
        return sys.modules["merge"]
    spec = importlib.util.spec_from_file_location("merge", MERGE_DIR / "__init__.py",
                                                  submodule_search_locations=[str(MERGE_DIR)])
    package = importlib.util.module_from_spec(spec)
    sys.modules["merge"] = package
    spec.loader.exec_module(package)
    return package


def main(argv: list[str] | None = None) -> int:
    load_merge_package()
    from merge import cli

    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
