"""A real ComfyUI server in a subprocess, with this pack loaded from the repo, driven over HTTP.

Why: the demo, the T2 tests (bundled workflows executed end to end) and the T3 tests (the real
frontend in a browser) must see exactly what a user sees after cloning the pack into
``ComfyUI/custom_nodes``. So ComfyUI runs as its own process (``main.py --cpu``) and finds the pack
through an ``extra_model_paths`` yaml whose ``custom_nodes:`` folder links to this repo. Every
folder ComfyUI writes to (temp, user, input, database) lives in a temporary directory, so nothing
is written into the ComfyUI folder; images go to ``--output-directory``. Other packs (the tests load
the vendored AnimateDiff-Evolved and Advanced-ControlNet, devtools/vendor_packs.py) are linked into
the same custom_nodes folder under their own names.

Only the standard library is used for HTTP (urllib), so the module runs in any Python.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import devpaths
from progress import STALL_SECONDS, Activity

__all__ = ["ComfyServer", "ComfyServerError", "ExecutionError", "HTTPStatusError", "RunResult", "free_port",
           "plain_log"]

# ComfyUI 0.33 prints each logged line behind a coloured level tag ("\x1b[32m[INFO]\x1b[0m "), some
# messages coloured too; 0.3.75 prints bare lines.
_ANSI_CODE = re.compile(r"\x1b\[[0-9;]*m")
_LEVEL_TAG = re.compile(r"^\[(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\] ?", re.MULTILINE)


class ComfyServerError(RuntimeError):
    """The server did not start, died, refused a request or timed out."""


class ExecutionError(ComfyServerError):
    """ComfyUI refused a prompt or failed while executing it; the message is ComfyUI's."""


class HTTPStatusError(ComfyServerError):
    """The server answered with an HTTP error status; ``body`` is what it said."""

    def __init__(self, method: str, path: str, status: int, body: str) -> None:
        super().__init__(f"{method} {path} answered {status}: {body}")
        self.status = status
        self.body = body


@dataclass(frozen=True)
class RunResult:
    """What one prompt did: ``seconds`` of execution, the files it wrote to the output folder."""

    seconds: float
    outputs: list[Path] = field(default_factory=list)
    ok: bool = True
    error: str | None = None
    prompt_id: str | None = None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ComfyServer:
    """``with ComfyServer() as server: server.run(prompt)`` -- ComfyUI with this pack, on the CPU.

    Args:
        output_dir: where ComfyUI saves images (default ``devpaths.output_dir()``).
        port: TCP port on 127.0.0.1 (default: a free one).
        log_path: file that receives ComfyUI's stdout and stderr (default: in the temp folder,
            removed on exit; pass a path to keep it).
        startup_stall: while starting, seconds without progress (``progress.Activity``) before giving up.
        api_nodes: load ComfyUI's paid API nodes (off: faster start, and the frontend stays offline).
        settings: frontend settings for the (fresh) default user, e.g. ``frontend.HEADLESS_SETTINGS``.
        extra_args: more ``main.py`` arguments.
        extra_packs: other custom node packs to load, ``{folder name: source folder}`` (linked).
        cpu: ``main.py --cpu``; False lets ComfyUI pick the GPU and memory mode as it would for a user
            (on ComfyUI 0.33 with an NVIDIA GPU: dynamic VRAM).
    """

    def __init__(
        self,
        output_dir: Path | None = None,
        *,
        port: int | None = None,
        log_path: Path | None = None,
        startup_stall: float = STALL_SECONDS,
        api_nodes: bool = False,
        settings: dict[str, Any] | None = None,
        extra_args: tuple[str, ...] = (),
        extra_packs: Mapping[str, Path] | None = None,
        cpu: bool = True,
    ) -> None:
        self.output_dir = Path(output_dir or devpaths.output_dir()).resolve()
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.startup_stall = startup_stall
        self.client_id = uuid.uuid4().hex
        self._requested_log = log_path
        self._log_path: Path | None = None
        self._api_nodes = api_nodes
        self._settings = dict(settings or {})
        self._extra_args = tuple(extra_args)
        self._extra_packs = dict(extra_packs or {})
        self._cpu = cpu
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._proc: subprocess.Popen | None = None
        self._log_file = None
        self._log_mode = "w"  # "a" after a restart
        self._old_sigterm: Any = None

    # -- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> ComfyServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def log_path(self) -> Path:
        if self._log_path is None:
            raise ComfyServerError("the server has not been started; use 'with ComfyServer() as server:'")
        return self._log_path

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> ComfyServer:
        """Start ComfyUI and wait until its HTTP API answers; on failure stop it and raise."""
        if self._proc is not None:
            raise ComfyServerError(f"this ComfyServer is already started at {self.url}")
        try:
            comfy_dir = devpaths.comfyui_dir()
        except RuntimeError as err:
            raise ComfyServerError(str(err)) from err
        self._tmp = tempfile.TemporaryDirectory(prefix="patchbay-comfy-")
        tmp = Path(self._tmp.name)
        self._log_path = Path(self._requested_log or tmp / "comfyui.log")
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self._log_path, self._log_mode, encoding="utf-8")  # noqa: SIM115 (closed in stop)
        self._proc = subprocess.Popen(
            self._command(comfy_dir, tmp), cwd=tmp, stdout=self._log_file, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env=server_environment(), start_new_session=True,
        )
        self._install_sigterm_handler()
        try:
            self._wait_until_up()
        except BaseException:
            self.stop()
            raise
        return self

    def _command(self, comfy_dir: Path, tmp: Path) -> list[str]:
        for name in ("input", "user/default"):
            (tmp / name).mkdir(parents=True, exist_ok=True)
        if self._settings:
            (tmp / "user/default/comfy.settings.json").write_text(json.dumps(self._settings, indent=4))
        config = tmp / "extra_model_paths.yaml"
        config.write_text(self._extra_paths_yaml(tmp))
        command = [
            sys.executable, str(comfy_dir / "main.py"), *(["--cpu"] if self._cpu else []),
            "--listen", "127.0.0.1", "--port", str(self.port), "--disable-auto-launch",
            "--extra-model-paths-config", str(config),
            "--output-directory", str(self.output_dir),
            "--temp-directory", str(tmp), "--input-directory", str(tmp / "input"),
            "--user-directory", str(tmp / "user"), "--database-url", f"sqlite:///{tmp / 'comfyui.db'}",
        ]
        if not self._api_nodes:
            command.append("--disable-api-nodes")
        return command + list(self._extra_args)

    def _extra_paths_yaml(self, tmp: Path) -> str:
        models = devpaths.models_dir().resolve()
        custom_nodes = devpaths.make_custom_nodes_dir(tmp)
        for name, source in self._extra_packs.items():
            (custom_nodes / name).symlink_to(Path(source).resolve(), target_is_directory=True)
        paths = {
            "checkpoints": models / "checkpoints",
            "loras": models / "loras",
            "diffusion_models": models / "diffusion_models",
            "controlnet": models / "controlnet",
            "vae": models / "vae",
            "custom_nodes": custom_nodes,
        }
        # A JSON string is a valid YAML double-quoted scalar, whatever the path holds.
        return "patchbay:\n" + "".join(f"  {key}: {json.dumps(str(p))}\n" for key, p in paths.items())

    def _wait_until_up(self) -> None:
        activity = Activity(self._proc.pid)
        while True:
            if self._proc.poll() is not None:
                raise ComfyServerError(
                    f"ComfyUI exited with code {self._proc.returncode} while starting.\n"
                    f"{self.log_tail()}\nFull log: {self.log_path}"
                )
            with contextlib.suppress(OSError, ComfyServerError):
                self._request("GET", "/api/system_stats", timeout=2)
                return
            if activity.idle_for() > self.startup_stall:
                raise ComfyServerError(
                    f"ComfyUI did not answer at {self.url} and made no progress for {self.startup_stall:.0f} "
                    f"s while starting.\n{self.log_tail()}\nFull log: {self.log_path}"
                )
            time.sleep(0.25)

    def restart(self) -> ComfyServer:
        """Stop and start again on the same port, the log continued: a fresh process holds none of the
        memory the last one gathered (models, caches, a fragmented heap)."""
        self.stop()
        self._log_mode = "a"
        return self.start()

    def stop(self) -> None:
        """Stop ComfyUI and everything it started (its process group); idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            _stop_group(proc)
        self._restore_sigterm_handler()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def _install_sigterm_handler(self) -> None:
        """Turn SIGTERM into SystemExit so ``with`` blocks (and so ``stop``) still run."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._old_sigterm = signal.signal(signal.SIGTERM, _raise_system_exit)

    def _restore_sigterm_handler(self) -> None:
        if self._old_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    # -- logs ------------------------------------------------------------------------------------

    def log_text(self, *, raw: bool = False) -> str:
        """Everything ComfyUI has printed so far, as ``plain_log`` gives it (``raw``: byte for byte)."""
        text = self.log_path.read_text(encoding="utf-8", errors="replace")
        return text if raw else plain_log(text)

    def startup_log(self) -> str:
        """The log up to "Starting server" (``log_text``'s lines): the imports only, whatever later
        prompts print."""
        log = self.log_text()
        if "Starting server" not in log:
            raise ComfyServerError(f"no 'Starting server' line in {self.log_path}")
        return log.split("Starting server", 1)[0]

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_text().splitlines()[-lines:]
        return "--- last lines of the ComfyUI log ---\n" + "\n".join(text)

    # -- HTTP API --------------------------------------------------------------------------------

    def _request(self, method: str, path: str, body: Any = None, timeout: float = 30.0) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                payload = response.read()
        except urllib.error.HTTPError as err:
            raise HTTPStatusError(method, path, err.code, _body_text(err)) from err
        return json.loads(payload) if payload else None

    def get_json(self, path: str, timeout: float = 30.0) -> Any:
        """GET ``path`` (e.g. ``/api/workflow_templates``) and decode the JSON answer."""
        return self._request("GET", path, timeout=timeout)

    def frontend_version(self) -> str:
        """The version of the frontend this server serves, e.g. ``"1.49.6"`` (workflow_api's ``frontend``).

        ComfyUI 0.33 reports it in ``/system_stats``; 0.3.75 does not, and serves the
        ``comfyui_frontend_package`` of the Python that started it (``sys.executable``, this one).
        """
        packages = self.get_json("/api/system_stats").get("system", {}).get("comfy_package_versions") or []
        for package in packages:
            if package.get("name") == "comfyui-frontend-package" and package.get("installed"):
                return str(package["installed"])
        import importlib.metadata

        return importlib.metadata.version("comfyui_frontend_package")

    def object_info(self) -> dict[str, dict]:
        """``GET /object_info``: every node type's inputs and outputs, as the frontend sees them."""
        return self._request("GET", "/api/object_info", timeout=120)

    def queue(self, prompt: dict[str, Any]) -> str:
        """Queue an API-format prompt; return its prompt_id. Raise ExecutionError if refused."""
        body = {"prompt": prompt, "client_id": self.client_id}
        try:
            return self._request("POST", "/api/prompt", body, timeout=60)["prompt_id"]
        except HTTPStatusError as err:
            raise ExecutionError(f"ComfyUI refused the prompt: {_refusal_text(err.body)}") from err

    def wait(self, prompt_id: str, stall: float = STALL_SECONDS) -> dict[str, Any]:
        """Wait for ``prompt_id`` to finish; return its ``/history`` entry, or raise ExecutionError.

        No wall-clock limit: the wait ends when the prompt ends, when the server dies, or when the
        server's processes make no progress (``progress.Activity``) for ``stall`` seconds, so a machine
        slowed by other work makes it longer but never fails it, and a hung server fails it.
        """
        activity = Activity(self._proc.pid if self._proc else 0, window=min(2.0, stall / 4))
        while True:
            entry = self._history_entry(prompt_id)
            if entry is not None and entry.get("status", {}).get("completed") is not None:
                _raise_if_failed(prompt_id, entry)
                return entry
            if not self.running:
                raise ComfyServerError(f"ComfyUI died while running prompt {prompt_id}.\n{self.log_tail()}")
            if activity.idle_for() > stall:
                raise ComfyServerError(
                    f"prompt {prompt_id} made no progress for {stall:g} s: ComfyUI used next to no CPU "
                    f"time, read nothing from disk and faulted in no page (hung?).\n{self.log_tail()}\n"
                    f"Full log: {self.log_path}")
            time.sleep(0.2)

    def _history_entry(self, prompt_id: str) -> dict[str, Any] | None:
        """The prompt's ``/history`` entry; None while it runs, or while a busy server is slow to answer
        (the caller's progress check, not this request, decides when waiting is over)."""
        try:
            return self._request("GET", f"/api/history/{prompt_id}").get(prompt_id)
        except (TimeoutError, urllib.error.URLError) as err:
            if isinstance(err, urllib.error.HTTPError):
                raise
            return None

    def run(self, prompt: dict[str, Any], stall: float = STALL_SECONDS) -> RunResult:
        """Queue, wait and collect the written files; errors become ``ok=False`` with ComfyUI's message."""
        started = time.monotonic()
        prompt_id = None
        try:
            prompt_id = self.queue(prompt)
            entry = self.wait(prompt_id, stall)
        except ComfyServerError as err:
            return RunResult(time.monotonic() - started, [], False, str(err), prompt_id)
        seconds = _execution_seconds(entry) or time.monotonic() - started
        return RunResult(seconds, self.output_files(entry), True, None, prompt_id)

    def output_files(self, entry: dict[str, Any]) -> list[Path]:
        """The files a history entry says were saved to the output folder (not temp previews)."""
        files = []
        for node_output in entry.get("outputs", {}).values():
            for items in node_output.values():
                for item in items if isinstance(items, list) else []:
                    if isinstance(item, dict) and item.get("type") == "output" and "filename" in item:
                        files.append(self.output_dir / item.get("subfolder", "") / item["filename"])
        return files


def plain_log(text: str) -> str:
    """ComfyUI log text with colour codes and leading ``[INFO]``-style level tags removed, so one check
    reads the lines of every version the same way."""
    return _LEVEL_TAG.sub("", _ANSI_CODE.sub("", text))


def server_environment() -> dict[str, str]:
    """The server's environment: this one, unbuffered output, and one glibc heap (``MALLOC_ARENA_MAX=1``
    unless set). ComfyUI runs prompts in a worker thread beside aiohttp's, and glibc gave the threads
    heaps of their own that kept freed tensor memory: measured over T2's bundled workflows on 0.3.75,
    the server's private memory peaked at 5.45 GB with the default and 4.24 GB with one heap, in the same
    time (152 s and 143 s)."""
    return {"MALLOC_ARENA_MAX": "1", **os.environ, "PYTHONUNBUFFERED": "1"}


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group we created for ComfyUI, then SIGKILL whatever is left."""
    for sig, grace in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
            with contextlib.suppress(ProcessLookupError):  # children that outlived the leader
                os.killpg(proc.pid, signal.SIGKILL)
            return


def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _body_text(err: urllib.error.HTTPError) -> str:
    try:
        return err.read().decode("utf-8", errors="replace")
    except OSError:
        return str(err)


def _refusal_text(body: str) -> str:
    """ComfyUI's /prompt validation answer as readable lines (node id, type, what is wrong)."""
    try:
        answer = json.loads(body)
    except ValueError:
        return body
    error = answer.get("error", {})
    lines = [f"{error.get('message', '')} {error.get('details', '')}".strip()]
    for node_id, node_error in answer.get("node_errors", {}).items():
        for item in node_error.get("errors", []):
            lines.append(f"node {node_id} ({node_error.get('class_type')}): {item.get('message')}: "
                         f"{item.get('details')}")
    return "\n".join(lines)


def _raise_if_failed(prompt_id: str, entry: dict[str, Any]) -> None:
    status = entry.get("status", {})
    if status.get("status_str") == "success":
        return
    for event, data in status.get("messages", []):
        if event == "execution_error":
            raise ExecutionError(
                f"ComfyUI failed on node {data.get('node_id')} ({data.get('node_type')}): "
                f"{data.get('exception_type')}: {data.get('exception_message', '').strip()}"
            )
        if event == "execution_interrupted":
            raise ExecutionError(f"prompt {prompt_id} was interrupted at node {data.get('node_id')}")
    raise ExecutionError(f"prompt {prompt_id} ended with status {status.get('status_str')!r}: {status}")


def _execution_seconds(entry: dict[str, Any]) -> float | None:
    """Seconds between ComfyUI's execution_start and execution_success messages, if both are there."""
    stamps = {event: data.get("timestamp") for event, data in entry.get("status", {}).get("messages", [])}
    start, end = stamps.get("execution_start"), stamps.get("execution_success")
    return (end - start) / 1000.0 if start is not None and end is not None else None
