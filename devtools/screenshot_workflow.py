"""A README picture: a bundled workflow after a run in the real frontend, on a 1920x1080 screen.

    python devtools/screenshot_workflow.py merge_two_checkpoints docs/merge_two_checkpoints.png

The workflow (``workflows/<title>.json`` of source ``<name>``, devtools/workflow_catalog.py) is
loaded into the frontend served by a live ComfyServer (tiny models, CPU), queued as the Queue button
queues it, and photographed when the server has run it: images and node texts shown, the UI around
the graph hidden, cut to the nodes (what ``build_workflows``' graph thumbnails show, at full size).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from comfy_server import ComfyServer
from frontend import HEADLESS_SETTINGS, Frontend
from workflow_catalog import bundled_path

SCREEN = (1920, 1080)


def screenshot(name: str, target: Path) -> Path:
    """Run the bundled workflow of source ``name`` (workflow_catalog.bundled_path) in the frontend and
    save the graph after the run as ``target``."""
    workflow = json.loads(bundled_path(name).read_text())
    with tempfile.TemporaryDirectory() as scratch, \
            ComfyServer(Path(scratch), settings=HEADLESS_SETTINGS) as server, \
            Frontend(server.url, viewport=SCREEN) as frontend:
        frontend.load_workflow(workflow, name)
        if errors := frontend.error_messages():
            raise RuntimeError(f"{name}: the frontend reported {errors} when loading it")
        server.wait(frontend.queue_graph())
        return frontend.screenshot_graph(target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", help="a bundled workflow's source name (workflow_sources/<name>.json)")
    parser.add_argument("target", type=Path, help="the PNG to write")
    args = parser.parse_args(argv)
    try:
        print(f"wrote {screenshot(args.name, args.target)}")
    except (OSError, RuntimeError) as err:  # ComfyServerError, ExecutionError, FrontendError
        print(f"screenshot_workflow: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
