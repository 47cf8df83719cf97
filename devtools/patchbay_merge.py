"""Console entry of the merge engine: ``patchbay_merge.py {merge,extract,show,validate,methods} ...``.

The same command as ``patchbay-merge`` after ``pip install`` of the repo, without installing: it imports
this checkout's merge/ under the installed name, ``patchbay_merge`` (devtools/pack_imports.py), and never
puts the pack folder on ``sys.path``.
"""

from __future__ import annotations

import sys
from pathlib import Path

DEVTOOLS = str(Path(__file__).resolve().parent)
if DEVTOOLS not in sys.path:  # `python <this file>` puts it first; runpy.run_path does not
    sys.path.insert(0, DEVTOOLS)
import pack_imports  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    pack_imports.use_standalone_names()
    from patchbay_merge import cli

    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
