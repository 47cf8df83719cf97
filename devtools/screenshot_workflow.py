"""A README picture: a bundled workflow after a run in the real frontend, on a 1920x1080 screen.

    python devtools/screenshot_workflow.py merge_two_checkpoints docs/merge_two_checkpoints.png
    python devtools/screenshot_workflow.py --newest --nodes-2 NAME TARGET   # 1.58.1, Nodes 2.0

The workflow (``workflows/<title>.json`` of source ``<name>``, devtools/workflow_catalog.py) is
loaded into the frontend served by a live ComfyServer (tiny models, CPU), queued as the Queue button
queues it, and photographed when the server has run it: images and node texts shown, the UI around
the graph hidden, cut to the nodes (what ``build_workflows``' graph thumbnails show, at full size).
The README's pictures are taken with ``--newest`` (the frontend users have, 1.58.1:
devtools/newest_frontend.py) on ComfyUI 0.33, in the classic design unless ``--nodes-2``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from comfy_server import ComfyServer
from frontend import HEADLESS_SETTINGS, Frontend
from newest_frontend import ensure_static
from workflow_catalog import bundled_path

SCREEN = (1920, 1080)


def screenshot(name: str, target: Path, *, newest: bool = False, nodes_2: bool = False) -> Path:
    """Run the bundled workflow of source ``name`` (workflow_catalog.bundled_path) in the frontend and
    save the graph after the run as ``target``; ``newest``: on the newest frontend instead of the one
    ComfyUI pins, ``nodes_2`` in its Nodes 2.0 design."""
    workflow = json.loads(bundled_path(name).read_text())
    extra = ("--front-end-root", str(ensure_static())) if newest else ()
    with tempfile.TemporaryDirectory() as scratch, \
            ComfyServer(Path(scratch), settings=HEADLESS_SETTINGS, extra_args=extra) as server, \
            Frontend(server.url, viewport=SCREEN) as frontend:
        if nodes_2:
            frontend.set_nodes_2(True)
        frontend.load_workflow(workflow, name)
        if errors := frontend.error_messages():
            raise RuntimeError(f"{name}: the frontend reported {errors} when loading it")
        server.wait(frontend.queue_graph())
        return frontend.screenshot_graph(target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", help="a bundled workflow's source name (workflow_sources/<name>.json)")
    parser.add_argument("target", type=Path, help="the PNG to write")
    parser.add_argument("--newest", action="store_true", help="serve the newest frontend (1.58.1)")
    parser.add_argument("--nodes-2", action="store_true", help="the Nodes 2.0 design (needs --newest)")
    args = parser.parse_args(argv)
    try:
        print(f"wrote {screenshot(args.name, args.target, newest=args.newest, nodes_2=args.nodes_2)}")
    except (OSError, RuntimeError) as err:  # ComfyServerError, ExecutionError, FrontendError
        print(f"screenshot_workflow: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
