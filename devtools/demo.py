"""Run every bundled workflow on a real ComfyUI (CPU, tiny models), or keep that ComfyUI up for a person.

    python devtools/demo.py            # make demo: run workflows/*.json, print a table, exit 1 on failure
    python devtools/demo.py --serve    # make run: start the same server, print its URL, run until Ctrl-C

Why: this is the pack's main job in one command, with nothing to download and no GPU. The tiny
models are generated (or reused) first, ComfyUI starts with the pack loaded from this repo
(devtools/comfy_server.py), each UI-format workflow is converted to an API prompt
(devtools/workflow_api.py) and queued over HTTP, and the images land in ``output/``. With
``--serve`` the pack's workflows are in the frontend's template browser (Templates > ComfyUI-Patchbay).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import devpaths
import tiny_models
from comfy_server import ComfyServer, RunResult, free_port
from stand_ins import PACKS, replace_text_encoders
from workflow_api import WorkflowConversionError, workflow_to_prompt


@dataclass(frozen=True)
class Row:
    """One line of the demo table."""

    workflow: str
    result: RunResult


def bundled_workflows() -> list[Path]:
    return sorted(devpaths.WORKFLOWS_DIR.glob("*.json"))


def run_workflow(server: ComfyServer, path: Path, object_info: dict, frontend: str) -> RunResult:
    """Convert one UI-format workflow and run it; conversion errors and missing files fail the row."""
    try:
        prompt = workflow_to_prompt(json.loads(path.read_text()), object_info, frontend=frontend)
        prompt = replace_text_encoders(prompt)  # a text encoder that cannot be tiny (Wan's umT5-XXL)
    except (WorkflowConversionError, ValueError) as err:
        return RunResult(0.0, [], False, f"conversion failed: {err}")
    result = server.run(prompt)
    missing = [str(p) for p in result.outputs if not p.is_file()]
    if result.ok and missing:
        return RunResult(result.seconds, result.outputs, False, f"reported but not written: {missing}",
                         result.prompt_id)
    return result


def print_table(rows: list[Row], root: Path) -> None:
    width = max([len("workflow")] + [len(row.workflow) for row in rows])
    print(f"\n{'workflow':<{width}}  {'seconds':>7}  {'ok':<4}  outputs")
    print(f"{'-' * width}  {'-' * 7}  {'-' * 4}  {'-' * 7}")
    for row in rows:
        result = row.result
        files = ", ".join(_short(p, root) for p in result.outputs) or "-"
        print(f"{row.workflow:<{width}}  {result.seconds:7.2f}  {'yes' if result.ok else 'NO':<4}  {files}")
    for row in rows:
        if not row.result.ok:
            print(f"\n{row.workflow} failed:\n  {row.result.error}")


def _short(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def demo() -> int:
    workflows = bundled_workflows()
    if not workflows:
        print(f"no workflows in {devpaths.WORKFLOWS_DIR}; build them with devtools/build_workflows.py")
        return 1
    tiny_models.ensure_models(devpaths.models_dir())
    output = devpaths.output_dir()
    log = output / "logs" / f"demo-comfyui-{devpaths.comfyui_version()}.log"
    version = devpaths.comfyui_version()
    print(f"starting ComfyUI {version} (log: {_short(log, devpaths.ROOT)}) ...", flush=True)
    with ComfyServer(output, log_path=log, extra_packs=PACKS) as server:
        object_info, frontend = server.object_info(), server.frontend_version()
        rows = []
        for path in workflows:
            print(f"running {path.name} ...", flush=True)
            rows.append(Row(path.stem, run_workflow(server, path, object_info, frontend)))
    print_table(rows, devpaths.ROOT)
    failed = [row.workflow for row in rows if not row.result.ok]
    print(f"\n{len(rows) - len(failed)}/{len(rows)} workflows ok; images in {_short(output, devpaths.ROOT)}/")
    return 1 if failed else 0


def serve(port: int) -> int:
    tiny_models.ensure_models(devpaths.models_dir())
    output = devpaths.output_dir()
    log = output / "logs" / f"serve-comfyui-{devpaths.comfyui_version()}.log"
    print(f"starting ComfyUI {devpaths.comfyui_version()} with {devpaths.PACK_NAME} "
          f"(log: {_short(log, devpaths.ROOT)}) ...", flush=True)
    with ComfyServer(output, port=port, log_path=log) as server:
        templates = server.get_json("/api/workflow_templates").get(devpaths.PACK_NAME, [])
        print(f"\nComfyUI is running at {server.url}/")
        print(f"Templates > {devpaths.PACK_NAME}: {', '.join(sorted(templates)) or '(none)'}")
        print(f"Images go to {output}/. Press Ctrl-C to stop.", flush=True)
        while server.running:
            time.sleep(0.5)
        print(f"ComfyUI stopped by itself.\n{server.log_tail()}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", action="store_true", help="keep the server running for a person")
    parser.add_argument("--port", type=int, default=8188, help="port for --serve (default: %(default)s, "
                                                                "or a free one if it is taken)")
    args = parser.parse_args(argv)
    try:
        return serve(_usable_port(args.port)) if args.serve else demo()
    except KeyboardInterrupt:
        print("\nstopped.")
        return 130
    except RuntimeError as err:  # ComfyServerError, ModelDeterminismError, an unset PATCHBAY_COMFYUI
        print(f"demo: {err}", file=sys.stderr)
        return 1


def _usable_port(port: int) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        if sock.connect_ex(("127.0.0.1", port)) != 0:
            return port
    other = free_port()
    print(f"port {port} is taken; using {other}")
    return other


if __name__ == "__main__":
    sys.exit(main())
