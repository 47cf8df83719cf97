"""The real ComfyUI frontend in headless Chromium (playwright, sync API), driven from Python.

Why: the bundled workflows must be what the frontend itself writes and reads, so they are built
(devtools/build_workflows.py) and checked (tests/test_t3_frontend.py) by the frontend served by a
live ComfyServer, not by a re-implementation. This module owns the browser details: Debian's
``/usr/bin/chromium`` (playwright never downloads a browser here), a fresh profile per session,
the first-run popups kept out of the way, and the few ``window.app`` calls we rely on
(``loadGraphData``, ``loadApiJson``, ``graphToPrompt``, ``LiteGraph.registered_node_types``, the
``Comfy.QueuePrompt`` command), which frontends 1.32.9 (ComfyUI 0.3.75) and 1.49.6 (ComfyUI 0.33)
both have. No step sleeps a fixed time: each returns once the frontend is idle (the page's requests
answered, frames drawn, its main thread idle) or, after Fit View, once its animation has ended.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import frontend_checks as checks

__all__ = ["CHROMIUM", "Frontend", "FrontendError", "HEADLESS_SETTINGS"]

CHROMIUM = os.environ.get("PATCHBAY_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# Frontend settings for a clean canvas: no template browser on first run, no minimap, no overlays.
HEADLESS_SETTINGS: dict[str, Any] = {
    "Comfy.TutorialCompleted": True,
    "Comfy.Minimap.Visible": False,
    "Comfy.Graph.CanvasInfo": False,
    "Comfy.Graph.CanvasMenu": False,
    "Comfy.Notification.ShowVersionUpdates": False,
    "Comfy.Workflow.Persist": False,
    "LiteGraph.Canvas.MinFontSizeForLOD": 1,  # draw text and widgets even when zoomed out to fit
}
_READY = ("() => !!(window.app && window.app.graph && window.app.canvas && window.LiteGraph"
          " && Object.keys(window.LiteGraph.registered_node_types).length > 0 && window.app.vueAppReady)")
_INIT_SCRIPT = "try { localStorage.setItem('vueNodesBannerDismissed', 'true') } catch (e) {}"
# Visible error toasts (PrimeVue) and dialogs (PrimeVue's, and the role=dialog ones frontend 1.49.6
# shows errors in), after a workflow was loaded.
_ERRORS_JS = """() => {
  const visible = (el) => !!(el.offsetWidth || el.offsetHeight || el.getClientRects().length);
  const out = [];
  for (const el of document.querySelectorAll('.p-toast-message-error, .p-toast-message-warn'))
    if (visible(el)) out.push('toast: ' + el.innerText.trim().replace(/\\s+/g, ' '));
  for (const el of document.querySelectorAll('.p-dialog, [role=dialog], [role=alertdialog]'))
    if (visible(el)) out.push('dialog: ' + el.innerText.trim().replace(/\\s+/g, ' ').slice(0, 300));
  return out;
}"""
# Two animation frames (the canvas has drawn what changed, Vue has patched the DOM: a toast or dialog
# raised meanwhile is on the page), then a moment the main thread has nothing queued (no pending task:
# a fetch's callback, an image's onload).
_IDLE_JS = """() => new Promise((resolve) =>
  requestAnimationFrame(() => requestAnimationFrame(() => requestIdleCallback(resolve))))"""
# The view (zoom and offset) at rest: unchanged over a whole frame. Fit View animates it for a fixed
# time (350 ms in both frontends), moving it in every frame until the last.
_VIEW_AT_REST_JS = """() => new Promise((resolve) => {
  let last = null;
  const step = () => {
    const ds = app.canvas.ds, now = [ds.scale, ds.offset[0], ds.offset[1]].join();
    if (now === last) resolve(); else { last = now; requestAnimationFrame(step); }
  };
  requestAnimationFrame(step);
})"""
# Awaits one of the above (substituted for SCRIPT), rejecting after a deadline: a last resort, as
# Playwright's timeouts are.
_WITHIN_JS = """async (deadline) => {
  let late;
  const timeout = new Promise((_, reject) => {
    late = setTimeout(() => reject(new Error("timeout")), deadline);
  });
  try { await Promise.race([(SCRIPT)(), timeout]); } finally { clearTimeout(late); }
}"""
# The canvas has taken the window's new size (the frontend resizes it from a ResizeObserver).
_CANVAS_SIZED_JS = """([width, height]) => {
  const canvas = app.canvas.canvas, rect = canvas.getBoundingClientRect();
  const scale = Math.max(window.devicePixelRatio, 1);
  return window.innerWidth === width && window.innerHeight === height
    && canvas.width === Math.round(rect.width * scale) && canvas.height === Math.round(rect.height * scale);
}"""


class _Playwright:
    """One playwright driver for every open Frontend: its sync API refuses a second one in a thread
    (T3 holds the session's frontend and the newest frontend's at once)."""

    driver: Any = None
    users = 0

    @classmethod
    def acquire(cls) -> Any:
        if cls.driver is None:
            from playwright.sync_api import sync_playwright

            cls.driver = sync_playwright().start()
        cls.users += 1
        return cls.driver

    @classmethod
    def release(cls) -> None:
        cls.users -= 1
        if cls.users == 0 and cls.driver is not None:
            cls.driver.stop()
            cls.driver = None


class FrontendError(RuntimeError):
    """The browser or the frontend did not do what was asked; the message says what and where."""


class Frontend:
    """``with Frontend(server.url) as fe: fe.load_workflow(wf, "name")`` -- one page, one fresh profile."""

    def __init__(self, url: str, *, viewport: tuple[int, int] = (1280, 800), timeout: float = 120.0) -> None:
        self.url = url
        self.viewport = viewport
        self.timeout_ms = int(timeout * 1000)
        self.console_errors: list[str] = []
        self._requests: set[Any] = set()  # the page's requests in flight
        self._requests_started = 0
        self._profile: tempfile.TemporaryDirectory | None = None
        self._playwright = None
        self._context = None
        self.page = None
        self._run_picture: dict[str, str] | None = None

    def __enter__(self) -> Frontend:
        if not Path(CHROMIUM).exists():
            raise FrontendError(f"no browser at {CHROMIUM}: install Debian's chromium ('devtools/env.sh "
                                f"--browser' or 'apt-get install chromium') or set PATCHBAY_CHROMIUM")
        self._profile = tempfile.TemporaryDirectory(prefix="patchbay-chromium-")
        self._playwright = _Playwright.acquire()
        try:
            self._open()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _open(self) -> None:
        width, height = self.viewport
        self._context = self._playwright.chromium.launch_persistent_context(
            self._profile.name, executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True,
            viewport={"width": width, "height": height},
        )
        self._context.add_init_script(_INIT_SCRIPT)
        self.page = self._context.new_page()
        self.page.set_default_timeout(self.timeout_ms)
        self.page.on("console", self._on_console)
        self.page.on("pageerror", lambda err: self.console_errors.append(f"pageerror: {err}"))
        self.page.on("request", self._on_request)
        self.page.on("requestfinished", self._on_request_done)
        self.page.on("requestfailed", self._on_request_done)
        self.page.goto(self.url)
        try:
            self.page.wait_for_function(_READY, timeout=self.timeout_ms)
        except Exception as err:
            seconds = self.timeout_ms / 1000
            raise FrontendError(f"the frontend at {self.url} was not ready within {seconds:.0f} s; "
                                f"console errors: {self.console_errors[-5:]}") from err

    def reload(self) -> None:
        """Load the page again: a fresh frontend state (a run's images are kept per node id and would
        otherwise show in, and resize, the node of that id in the next graph loaded)."""
        self.page.reload()
        self.page.wait_for_function(_READY, timeout=self.timeout_ms)

    def _on_request(self, request: Any) -> None:
        self._requests.add(request)
        self._requests_started += 1

    def _on_request_done(self, request: Any) -> None:
        self._requests.discard(request)

    def _on_console(self, message: Any) -> None:
        if message.type == "error":
            self.console_errors.append(message.text)

    def __exit__(self, *exc: object) -> None:
        if self._context is not None:
            self._context.close()
            self._context = None
        if self._playwright is not None:
            _Playwright.release()
            self._playwright = None
        if self._profile is not None:
            self._profile.cleanup()
            self._profile = None

    # -- graphs ----------------------------------------------------------------------------------

    def evaluate(self, script: str, arg: Any = None) -> Any:
        return self.page.evaluate(script, arg)

    def registered_node_types(self) -> set[str]:
        return set(self.evaluate("() => Object.keys(LiteGraph.registered_node_types)"))

    def missing_node_types(self, workflow: dict[str, Any]) -> list[str]:
        """Node types the workflow uses that this frontend does not know."""
        known = self.registered_node_types()
        return sorted({node["type"] for node in workflow.get("nodes", []) if node["type"] not in known})

    def title_widths(self) -> dict[str, float]:
        """Per loaded node id: the width its whole title needs (title text as litegraph draws it, in
        its title font, plus the collapse dot's space on the left and a margin on the right)."""
        return self.evaluate("""() => { const ctx = document.createElement("canvas").getContext("2d");
            ctx.font = `${LiteGraph.NODE_TEXT_SIZE}px ${LiteGraph.NODE_FONT}`;
            const out = {};
            for (const node of app.graph.nodes)
                out[String(node.id)] = ctx.measureText(node.getTitle() ?? "").width
                                       + LiteGraph.NODE_TITLE_HEIGHT + 16;
            return out; }""")

    def nodes_with_errors(self) -> list[list[Any]]:
        """[id, type] of loaded nodes the frontend flagged (e.g. placeholders for missing types)."""
        return self.evaluate("() => app.graph.nodes.filter(n => n.has_errors).map(n => [n.id, n.type])")

    def load_workflow(self, workflow: dict[str, Any], name: str) -> None:
        """``app.loadGraphData`` a UI-format workflow as a new tab named ``name``, without dialogs."""
        self.console_errors.clear()
        self.evaluate("""async ([wf, name]) => { await app.loadGraphData(wf, true, true, name,
            {showMissingNodesDialog: false, showMissingModelsDialog: false}); }""", [workflow, name])
        self._settle()

    def load_api_prompt(self, prompt: dict[str, Any], name: str) -> None:
        """``app.loadApiJson``: build a graph from an API-format prompt, as dropping one in does."""
        self.console_errors.clear()
        self.evaluate("async ([prompt, name]) => { await app.loadApiJson(prompt, name); }", [prompt, name])
        self._settle()

    def graph_to_prompt(self) -> dict[str, Any]:
        """``await app.graphToPrompt()``: ``{"workflow": UI format as exported, "output": API prompt}``."""
        return self.evaluate("async () => JSON.parse(JSON.stringify(await app.graphToPrompt()))")

    def set_widget_values(self, name: str, value: Any) -> int:
        """Set every widget called ``name`` (e.g. control_after_generate) to ``value``; return how many."""
        return self.evaluate("""([name, value]) => { let n = 0;
            for (const node of app.graph.nodes) for (const w of node.widgets ?? [])
                if (w.name === name) { w.value = value; n++; }
            return n; }""", [name, value])

    def error_messages(self) -> list[str]:
        """Visible error/warning toasts and open dialogs."""
        return self.evaluate(_ERRORS_JS)

    def widget_layouts(self) -> dict[str, dict[str, Any]]:
        """For every registered node type: its widgets (name, stored, api) and input slots (name, type)."""
        return self.evaluate("""() => { const out = {};
          for (const type of Object.keys(LiteGraph.registered_node_types)) {
            const node = LiteGraph.createNode(type);
            if (!node) continue;
            out[type] = {
              widgets: (node.widgets ?? []).map(w => [w.name, w.serialize !== false,
                                                       !!w.name && w.options?.serialize !== false]),
              inputs: (node.inputs ?? []).map(i => [i.name, String(i.type)]),
            };
          }
          return out; }""")

    def queue_graph(self, timeout: float = 60.0) -> str:
        """Queue the loaded graph as the Queue button does; return the new prompt's id (wait for it with
        ``ComfyServer.wait``). FrontendError with the frontend's dialog text if it refused the graph."""
        before = set(self._prompt_ids())
        self.console_errors.clear()
        self.evaluate("async () => app.extensionManager.command.execute('Comfy.QueuePrompt')")
        deadline = time.monotonic() + timeout
        while not (new := [pid for pid in self._prompt_ids() if pid not in before]):
            if errors := self.error_messages():
                raise FrontendError(f"the frontend did not queue the graph: {errors}")
            if time.monotonic() > deadline:
                raise FrontendError(f"nothing was queued within {timeout:.0f} s; console errors: "
                                    f"{self.console_errors[-5:]}")
            time.sleep(0.2)
        return new[0]

    def _prompt_ids(self) -> list[str]:
        """Ids of the prompts the server has queued, running or in its history."""
        return self.evaluate("""async () => {
            const queue = await (await fetch('api/queue')).json();
            const history = await (await fetch('api/history')).json();
            return [...queue.queue_running, ...queue.queue_pending].map((e) => e[1])
                .concat(Object.keys(history)); }""")

    # -- designs and layout ----------------------------------------------------------------------

    def set_nodes_2(self, enabled: bool) -> None:
        """Switch the node design (frontend 1.58.1's setting ``Comfy.VueNodes.Enabled``, "Modern Node
        Design (Nodes 2.0)": nodes as DOM elements instead of drawn on the canvas), as the settings
        dialog does; the loaded graph is redrawn in it."""
        self.evaluate("async (on) => app.extensionManager.setting.set('Comfy.VueNodes.Enabled', on)", enabled)
        self._settle()

    def node_boxes(self) -> dict[str, tuple[float, float, float, float]]:
        """Per loaded node id: left, top, right, bottom of what it covers, in graph units, title bar
        included; in Nodes 2.0 its DOM element's box (its content decides its height)."""
        return {nid: tuple(box) for nid, box in self.evaluate(checks.NODE_BOXES_JS).items()}

    def smallest_text_px(self) -> float:
        """The smallest node text at the current zoom, in screen pixels (see ``checks.SMALLEST_TEXT_JS``)."""
        return float(self.evaluate(checks.SMALLEST_TEXT_JS))

    def note_contrasts(self) -> dict[str, float]:
        """Per Note / MarkdownNote id: the lowest WCAG contrast ratio of its text on its background."""
        return self.evaluate(checks.NOTE_CONTRAST_JS)

    def show_run_outputs(self, lines: int = 6) -> None:
        """Show in the loaded graph what a run shows (the server's "executed" messages, replayed): a
        384x512 picture in every output node that saves or previews images, ``lines`` lines of text in
        every other output node. Nodes grow as after a real run; nothing is queued."""
        if self._run_picture is None:
            self._run_picture = self.evaluate(checks.RUN_PICTURE_JS)
        text = [f"line {index + 1} of a report a node returns" for index in range(lines)]
        self.evaluate(checks.SHOW_RUN_JS, [self._run_picture, text])
        self._settle()

    # -- pictures --------------------------------------------------------------------------------

    def screenshot_graph(self, path: Path, *, crop: bool = True) -> Path:
        """Fit the graph to the window, hide the UI around it (focus mode), save a PNG screenshot.

        With ``crop`` the picture is cut to the nodes' bounding box plus a small margin.
        """
        path.parent.mkdir(parents=True, exist_ok=True)
        self.evaluate("""async () => {
            const cmd = app.extensionManager.command;
            await cmd.execute('Workspace.ToggleFocusMode');
            await cmd.execute('Comfy.Canvas.FitView');
            app.canvas.deselectAll?.(); app.graph.setDirtyCanvas(true, true); }""")
        self._wait_in_page(_VIEW_AT_REST_JS, "Fit View did not come to rest")
        self._settle()
        try:
            clip = self._graph_clip() if crop else None
            self.page.screenshot(path=str(path), **({"clip": clip} if clip else {}))
        finally:
            self.evaluate("async () => app.extensionManager.command.execute('Workspace.ToggleFocusMode')")
        return path

    def resize(self, viewport: tuple[int, int]) -> None:
        """Give the page another window size (as a user resizing the browser); return once the canvas
        has taken it and drawn."""
        self.page.set_viewport_size({"width": viewport[0], "height": viewport[1]})
        self.viewport = viewport
        self.page.wait_for_function(_CANVAS_SIZED_JS, arg=list(viewport), polling="raf")
        self._settle()

    def fit_zoom(self) -> float:
        """The zoom the frontend's Fit View (the "." key) picks for the loaded graph, with the UI shown
        as a user sees it; at this viewport size. Its animation is waited out: the zoom at rest."""
        self.evaluate("async () => app.extensionManager.command.execute('Comfy.Canvas.FitView')")
        self._wait_in_page(_VIEW_AT_REST_JS, "Fit View did not come to rest")
        return self.evaluate("() => app.canvas.ds.scale")

    def _graph_clip(self, margin: float = 24.0) -> dict[str, float] | None:
        boxes = list(self.node_boxes().values())  # Nodes 2.0: the DOM nodes, which may be larger
        if not boxes:
            return None
        box = self.evaluate("""([x0, y0, x1, y1]) => {
            const ds = app.canvas.ds, rect = app.canvas.canvas.getBoundingClientRect();
            const sx = (v) => rect.left + (v + ds.offset[0]) * ds.scale;
            const sy = (v) => rect.top + (v + ds.offset[1]) * ds.scale;
            return [sx(x0), sy(y0), sx(x1), sy(y1)]; }""",
                            [min(b[0] for b in boxes), min(b[1] for b in boxes),
                             max(b[2] for b in boxes), max(b[3] for b in boxes)])
        if box is None:
            return None
        width, height = self.viewport
        left, top = max(0.0, box[0] - margin), max(0.0, box[1] - margin)
        right, bottom = min(float(width), box[2] + margin), min(float(height), box[3] + margin)
        return {"x": left, "y": top, "width": right - left, "height": bottom - top}

    def _settle(self) -> None:
        """Wait until the frontend is idle: none of the page's requests in flight (a lazily loaded
        dialog, a fetch whose answer may raise a toast), two animation frames drawn and an idle moment
        of its main thread, and no request started meanwhile."""
        deadline = time.monotonic() + self.timeout_ms / 1000
        while True:
            started = self._requests_started
            while self._requests:
                if time.monotonic() > deadline:
                    urls = sorted(request.url for request in self._requests)
                    raise FrontendError(f"requests in flight for {self.timeout_ms / 1000:.0f} s: {urls}")
                self.page.wait_for_timeout(20)  # lets playwright deliver the requests' events
            self._wait_in_page(_IDLE_JS, "the frontend was not idle")
            if self._requests_started == started and not self._requests:
                return

    def _wait_in_page(self, script: str, what: str) -> None:
        """Await ``script`` (a function returning a promise) in the page, at most the timeout."""
        try:
            self.evaluate(_WITHIN_JS.replace("SCRIPT", script), self.timeout_ms)
        except Exception as err:
            raise FrontendError(f"{what} within {self.timeout_ms / 1000:.0f} s; console errors: "
                                f"{self.console_errors[-5:]}") from err
