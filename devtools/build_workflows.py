"""Build the bundled UI-format workflows from hand-written API-format sources, with the real frontend.

    python devtools/build_workflows.py            # every devtools/workflow_sources/*.json -> workflows/
    python devtools/build_workflows.py NAME ...   # only these (a leading "_" marks a builder test source)
    python devtools/build_workflows.py --check    # exit 1 if workflows/ is not what the sources give

Why: a workflow file is only as good as the frontend's opinion of it. Writing the UI format by hand
(widget order, hidden control widgets, slot lists, link tables) invites files that load wrong, so
each source prompt is loaded into the real frontend (``app.loadApiJson``) in headless Chromium
against a live ComfyServer, laid out (devtools/workflow_layout.py: by dependency, no overlaps), loaded again
(``app.loadGraphData``) and exported as the frontend exports it (``app.graphToPrompt().workflow``).
The builder then checks that the frontend would queue exactly the source prompt, and saves it as
``workflows/<title>.json`` with a small ``<title>.jpg`` thumbnail for the template browser (the title,
the file name the browser shows, comes from devtools/workflow_catalog.py). Output is deterministic:
stable link ids, a workflow id derived from the source's name, seeds set to "fixed", no saved viewport.

A source may hold note nodes (``{"class_type": "MarkdownNote", "inputs": {"text": ...}}``, or
``Note``): the frontend builds them like any node and never queues them, so they are left out of the
queued-prompt check and checked on their own: same id, title and text in the built workflow. A
SaveImage node whose ``_meta`` has ``"thumbnail": true`` makes the thumbnail the image it saves when
the source runs (the outcome: a plot, a region diagram); ``"thumbnail": "graph"`` makes it the graph
after a run in the frontend, images and node texts shown (where the image alone says little: a tiny
model's sample); without either the thumbnail is the graph before a run.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import devpaths
from comfy_server import ComfyServer
from frontend import HEADLESS_SETTINGS, Frontend
from widget_layout import EXTENSION_WIDGETS
from workflow_api import FRONTEND_ONLY_TYPES
from workflow_catalog import bundled_path, template
from workflow_layout import layout

SOURCES_DIR = devpaths.ROOT / "devtools" / "workflow_sources"
LAYOUT_ROUNDS = 3  # lay out, load, export again while the frontend changes node sizes
THUMBNAIL_WIDTH = 640
CAPTION_SIZE, CAPTION_PAD, CAPTION_COLORS = 28, 14, ((30, 34, 40), (240, 240, 240))
ID_NAMESPACE = uuid.UUID("6f0d3c1e-2a57-4c7e-9a43-5b2f7a1d0c11")


class BuildError(RuntimeError):
    """A source cannot become a bundled workflow; the message names the source and the problem."""


# -- normalisation -------------------------------------------------------------------------------


def normalize(workflow: dict[str, Any], name: str) -> dict[str, Any]:
    """Stable ids (workflow id from the name, links 1..n by target), no saved viewport."""
    workflow["id"] = str(uuid.uuid5(ID_NAMESPACE, name))
    workflow["revision"] = 0
    (workflow.get("extra") or {}).pop("ds", None)
    links = sorted(workflow.get("links") or [], key=lambda link: (link[3], link[4], link[1], link[2]))
    new_id = {link[0]: index for index, link in enumerate(links, start=1)}
    workflow["links"] = [[new_id[link[0]], *link[1:]] for link in links]
    for node in workflow["nodes"]:
        for entry in node.get("inputs") or []:
            if entry.get("link") is not None:
                entry["link"] = new_id[entry["link"]]
        for entry in node.get("outputs") or []:
            if entry.get("links"):
                entry["links"] = sorted(new_id[link] for link in entry["links"])
    workflow["last_link_id"] = len(links)
    workflow["last_node_id"] = max((int(node["id"]) for node in workflow["nodes"]), default=0)
    return workflow


# -- one workflow --------------------------------------------------------------------------------


def _check_queues_source(name: str, source: dict[str, Any], output: dict[str, Any]) -> None:
    """The frontend must queue exactly the source prompt (titles only where the source sets them).

    Values of widgets that a frontend extension adds (PreviewAny's ``preview``, which frontend 1.32.9
    sends and ComfyUI ignores) are left out of the comparison: which of them a frontend sends varies.
    """
    def core(prompt: dict[str, Any]) -> dict[str, Any]:
        return {nid: (node["class_type"], {key: value for key, value in node["inputs"].items()
                                           if key not in _extension_widget_names(node["class_type"])})
                for nid, node in prompt.items()}

    source = {nid: node for nid, node in source.items() if node["class_type"] not in FRONTEND_ONLY_TYPES}

    if core(output) != core(source):
        diff = [nid for nid in sorted(set(source) | set(output), key=str)
                if core(source).get(nid) != core(output).get(nid)]
        raise BuildError(f"{name}: the built workflow would not queue its source prompt; nodes {diff} "
                         f"differ:\n source: {[source.get(n) for n in diff]}"
                         f"\n frontend: {[output.get(n) for n in diff]}")
    for nid, node in source.items():
        title = (node.get("_meta") or {}).get("title")
        if title and output[nid]["_meta"]["title"] != title:
            raise BuildError(f"{name}: node {nid} lost its title {title!r}")


def _check_notes(name: str, source: dict[str, Any], workflow: dict[str, Any]) -> None:
    """Every note of the source is in the built workflow: same id, type, title and text."""
    built = {str(node["id"]): node for node in workflow["nodes"]}
    for nid, entry in source.items():
        if entry["class_type"] not in FRONTEND_ONLY_TYPES:
            continue
        node = built.get(nid)
        text = entry["inputs"].get("text")
        title = (entry.get("_meta") or {}).get("title")
        if (node is None or node["type"] != entry["class_type"] or (title and node.get("title") != title)
                or (text is not None and text not in (node.get("widgets_values") or []))):
            raise BuildError(f"{name}: note node {nid} ({entry['class_type']}) did not come through the "
                             f"frontend with its title and text; built: {node}")


def _extension_widget_names(node_type: str) -> set[str]:
    return {widget.name for versions in EXTENSION_WIDGETS.get(node_type, ()) for widget in versions}


def _fit_titles(workflow: dict[str, Any], widths: dict[str, float]) -> None:
    """Widen each node whose title the frontend would cut off ("Trace Timeline (runs af...")."""
    for node in workflow["nodes"]:
        need = widths.get(str(node["id"]), 0.0)
        if node["size"][0] < need:
            node["size"] = [round(need), node["size"][1]]


def _sizes(workflow: dict[str, Any]) -> dict[Any, list]:
    return {node["id"]: node["size"] for node in workflow["nodes"]}


def build_one(frontend: Frontend, name: str, source: dict[str, Any]) -> dict[str, Any]:
    """The UI-format workflow for one API-format source, built and checked by the frontend."""
    known = frontend.registered_node_types()
    missing = sorted({node["class_type"] for node in source.values()} - known)
    if missing:
        raise BuildError(f"{name}: node types {missing} are unknown to the server; is the pack loaded "
                         f"(see the server log) and are the type names right?")
    frontend.load_api_prompt(source, name)
    frontend.set_widget_values("control_after_generate", "fixed")
    result = frontend.graph_to_prompt()
    for _ in range(LAYOUT_ROUNDS):  # a node loaded from a draft may take another size than in it
        _fit_titles(result["workflow"], frontend.title_widths())
        try:
            draft = normalize(layout(result["workflow"]), name)
        except ValueError as err:  # a cycle
            raise BuildError(f"{name}: {err}") from None
        frontend.load_workflow(draft, name)
        errors = frontend.error_messages()
        if errors:
            raise BuildError(f"{name}: the frontend reported {errors} when loading the built workflow")
        result = frontend.graph_to_prompt()
        if _sizes(result["workflow"]) == _sizes(draft):
            break
    _check_queues_source(name, source, result["output"])
    _check_notes(name, source, result["workflow"])
    return normalize(result["workflow"], name)


def thumbnail(frontend: Frontend, target: Path, caption: str = "") -> Path:
    """A small JPEG of the graph currently loaded (the template browser's picture)."""
    from PIL import Image  # ComfyUI's own dependency

    with tempfile.TemporaryDirectory() as tmp:
        shot = frontend.screenshot_graph(Path(tmp) / "shot.png")
        image = Image.open(shot).convert("RGB")
    return _save_thumbnail(image, target, enlarge=False, caption=caption)


def _save_thumbnail(image: Any, target: Path, *, enlarge: bool, caption: str = "") -> Path:
    """``image`` (PIL) THUMBNAIL_WIDTH wide (smaller ones kept unless ``enlarge``) as a JPEG, under a
    band with ``caption`` where one is given."""
    from PIL import Image

    if image.width > THUMBNAIL_WIDTH or enlarge:
        image = image.resize((THUMBNAIL_WIDTH, round(image.height * THUMBNAIL_WIDTH / image.width)),
                             Image.Resampling.LANCZOS)
    if caption:
        image = captioned(image, caption)
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, "JPEG", quality=85, optimize=True)
    target.write_bytes(buffer.getvalue())
    return target


def captioned(image: Any, caption: str) -> Any:
    """``image`` under a dark band that says what the workflow does (its catalogue description).

    A pack's template card shows only its file name (devtools/workflow_catalog.py), and look-alike
    graphs (three FLOATS schedules) make look-alike thumbnails: the band tells them apart. The card
    shows the whole picture (``object-contain``), about half size: CAPTION_SIZE stays readable there.
    """
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default(size=CAPTION_SIZE)  # Pillow's own font: the same on every machine
    width = max(image.width, THUMBNAIL_WIDTH)
    lines: list[str] = []
    for word in caption.split():
        line = f"{lines[-1]} {word}" if lines else word
        if lines and font.getlength(line) <= width - 2 * CAPTION_PAD:
            lines[-1] = line
        else:
            lines.append(word)
    line_height = round(CAPTION_SIZE * 1.25)
    band = 2 * CAPTION_PAD + line_height * len(lines)
    out = Image.new("RGB", (width, image.height + band), CAPTION_COLORS[0])
    out.paste(image.convert("RGB"), ((width - image.width) // 2, band))
    draw = ImageDraw.Draw(out)
    for index, line in enumerate(lines):
        draw.text((CAPTION_PAD, CAPTION_PAD + index * line_height), line, font=font, fill=CAPTION_COLORS[1])
    return out


def _thumbnail_node(source: dict[str, Any]) -> str | None:
    """The id of the image-saving node whose ``_meta`` says ``"thumbnail": true`` (or ``"graph"``), if any."""
    marked = [nid for nid, node in source.items() if (node.get("_meta") or {}).get("thumbnail")]
    if len(marked) > 1:
        raise BuildError(f"nodes {marked} are all marked as the thumbnail; mark one")
    return marked[0] if marked else None


def _thumbnail_kind(source: dict[str, Any]) -> str:
    """"image" (the marked node's saved image), "graph" (the graph after a run) or "draft" (before one)."""
    nid = _thumbnail_node(source)
    mark = None if nid is None else source[nid]["_meta"]["thumbnail"]
    if mark not in (None, True, "graph"):
        raise BuildError(f"node {nid}: thumbnail is {mark!r}; use true (its image) or \"graph\"")
    return {None: "draft", True: "image", "graph": "graph"}[mark]


def graph_thumbnail(server: ComfyServer, frontend: Frontend, name: str, target: Path,
                    caption: str = "") -> Path:
    """The template browser's picture as the graph after a run: queue the loaded graph in the frontend,
    wait until the server has run it (its images and texts then show in their nodes), screenshot it."""
    try:
        server.wait(frontend.queue_graph())
        return thumbnail(frontend, target, caption)
    except RuntimeError as err:  # ExecutionError, ComfyServerError, FrontendError
        raise BuildError(f"{name}: running it in the frontend for its thumbnail failed: {err}") from err
    finally:
        frontend.reload()  # the run's images must not reach the next workflow built on this page


def output_thumbnail(server: ComfyServer, name: str, source: dict[str, Any], target: Path,
                     caption: str = "") -> Path:
    """The template browser's picture as the outcome: run the source and shrink the image that its
    thumbnail node saved (a schedule plot, a region diagram), instead of a picture of the graph."""
    from PIL import Image

    nid = _thumbnail_node(source)
    prefix = str(source[nid]["inputs"].get("filename_prefix", ""))
    prompt = {key: {"class_type": node["class_type"], "inputs": node["inputs"]}
              for key, node in source.items() if node["class_type"] not in FRONTEND_ONLY_TYPES}
    result = server.run(prompt)
    if not result.ok:
        raise BuildError(f"{name}: running it for its thumbnail failed: {result.error}")
    saved = [path for path in result.outputs if path.name.startswith(Path(prefix).name + "_")]
    if not saved:
        raise BuildError(f"{name}: thumbnail node {nid} saved no image named {prefix}_*; it must be a "
                         f"SaveImage whose filename_prefix is unique in the workflow")
    with Image.open(saved[0]) as image:
        return _save_thumbnail(image, target, enlarge=True, caption=caption)


def dumps(workflow: dict[str, Any]) -> str:
    return json.dumps(workflow, indent=2, ensure_ascii=False) + "\n"


# -- command line --------------------------------------------------------------------------------


def _sources(names: list[str], folder: Path) -> list[Path]:
    if not names:
        return sorted(p for p in folder.glob("*.json") if not p.name.startswith("_"))
    paths = [folder / f"{name.removesuffix('.json')}.json" for name in names]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise BuildError(f"no such source: {missing}; sources live in {folder}")
    return paths


def build(names: list[str], sources_dir: Path, out_dir: Path, check: bool) -> int:
    sources = _sources(names, sources_dir)
    try:  # every source named in the catalogue before a server starts
        targets = {path: bundled_path(path.stem, out_dir) for path in sources}
    except KeyError as err:
        raise BuildError(err.args[0]) from None
    stale = []
    with tempfile.TemporaryDirectory() as scratch, \
            ComfyServer(Path(scratch), settings=HEADLESS_SETTINGS) as server, \
            Frontend(server.url) as frontend:
        for path in sources:
            name = path.stem
            workflow = dumps(build_one(frontend, name, json.loads(path.read_text())))
            target = targets[path]
            if check:
                if not target.is_file() or json.loads(target.read_text()) != json.loads(workflow):
                    stale.append(name)
                continue
            out_dir.mkdir(parents=True, exist_ok=True)
            target.write_text(workflow)
            source = json.loads(path.read_text())
            kind, jpg = _thumbnail_kind(source), target.with_suffix(".jpg")
            caption = "" if name.startswith("_") else template(name).caption
            if kind == "image":
                output_thumbnail(server, name, source, jpg, caption)
            elif kind == "graph":
                graph_thumbnail(server, frontend, name, jpg, caption)
            else:
                thumbnail(frontend, jpg, caption)
            print(f"built {target.relative_to(out_dir.parent)} (+ .jpg) from {path.name}")
    if stale:
        print(f"out of date: {stale}; run 'python devtools/build_workflows.py'", file=sys.stderr)
    return 1 if stale else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="source names (default: all not starting with '_')")
    parser.add_argument("--sources", type=Path, default=SOURCES_DIR, help="folder of API-format sources")
    parser.add_argument("--out", type=Path, default=devpaths.WORKFLOWS_DIR, help="where workflows go")
    parser.add_argument("--check", action="store_true", help="only report workflows that are out of date")
    args = parser.parse_args(argv)
    try:
        return build(args.names, args.sources, args.out, args.check)
    except RuntimeError as err:  # BuildError, ComfyServerError, FrontendError
        print(f"build_workflows: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
