"""T0: waits on the test server and on child processes end on an outcome or on a hang, never on a
wall-clock budget (devtools/progress.py).

devtools/comfy_server.py waits for a prompt until its history entry says it ended, the server dies,
or the server's processes show no sign of work (CPU time, I/O, major page faults) for ``stall``
seconds. Here a stand-in server (a small HTTP server in a subprocess, answering ``/api/history`` as
ComfyUI does) is slow but busy, or idle: the first wait succeeds however long the work takes, the
second fails after ``stall`` seconds with the reason.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
from comfy_server import ComfyServer, ComfyServerError, free_port
from progress import Activity, run_watched

pytestmark = pytest.mark.t0

# Answers /api/history/<id> with an empty object until BUSY seconds of CPU work are done (a busy
# loop in a thread), then with a completed, successful entry. BUSY < 0: never completes, never works.
STAND_IN = textwrap.dedent("""
    import http.server, json, sys, threading, time
    port, busy = int(sys.argv[1]), float(sys.argv[2])
    done = threading.Event()
    def work():
        end = time.process_time() + busy
        while time.process_time() < end:
            pass
        done.set()
    if busy >= 0:
        threading.Thread(target=work, daemon=True).start()
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            pid = self.path.rsplit("/", 1)[1]
            entry = {pid: {"status": {"completed": True, "status_str": "success", "messages": []},
                           "outputs": {}}} if done.is_set() else {}
            body = json.dumps(entry).encode()
            self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
            self.wfile.write(body)
        def log_message(self, *args):
            pass
    http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
""")


def stand_in_server(tmp_path, busy_seconds: float) -> ComfyServer:
    server = ComfyServer(tmp_path, port=free_port(), log_path=tmp_path / "server.log")
    server._log_path = tmp_path / "server.log"
    server._log_path.write_text("stand-in server\n")
    server._proc = subprocess.Popen([sys.executable, "-c", STAND_IN, str(server.port), str(busy_seconds)])
    for _ in range(100):  # until it listens
        try:
            server.get_json("/api/history/none", timeout=1)
            break
        except OSError:
            time.sleep(0.05)
    return server


@pytest.fixture
def servers():
    started: list[ComfyServer] = []
    yield started
    for server in started:
        server._proc.kill()
        server._proc.wait()


def test_a_busy_server_is_waited_for_longer_than_the_stall_limit(tmp_path, servers):
    servers.append(server := stand_in_server(tmp_path, busy_seconds=1.5))
    began = time.monotonic()
    entry = server.wait("p1", stall=0.5)
    assert entry["status"]["status_str"] == "success"
    assert time.monotonic() - began > 1.2  # well past the stall limit: progress, not a budget, decides


def test_a_server_that_does_nothing_fails_the_wait_after_the_stall_limit(tmp_path, servers):
    servers.append(server := stand_in_server(tmp_path, busy_seconds=-1))
    began = time.monotonic()
    with pytest.raises(ComfyServerError, match=r"(?s)prompt p2 made no progress for 0.5 s.*stand-in server"):
        server.wait("p2", stall=0.5)
    assert time.monotonic() - began < 10


def test_activity_moves_with_cpu_work_and_not_with_sleep():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    idle = subprocess.Popen(["sleep", "30"])
    try:
        working, sleeping = Activity(busy.pid, window=0.25), Activity(idle.pid, window=0.25)
        for _ in range(4):
            time.sleep(0.25)
            working.idle_for(), sleeping.idle_for()
        assert working.idle_for() < 0.3
        assert sleeping.idle_for() > 0.7
    finally:
        for process in (busy, idle):
            process.kill()
            process.wait()


def test_a_watched_child_runs_as_long_as_it_works_and_is_stopped_when_it_hangs():
    busy = "import time\nend = time.process_time() + 1.5\nwhile time.process_time() < end: pass\nprint('ok')"
    result = run_watched([sys.executable, "-c", busy], stall=0.5, capture_output=True, text=True)
    assert (result.returncode, result.stdout) == (0, "ok\n")
    hung = "import sys, time\nprint('waiting', file=sys.stderr, flush=True)\ntime.sleep(60)"
    began = time.monotonic()
    with pytest.raises(TimeoutError, match="made no progress for 0.5 s; stderr so far: 'waiting"):
        run_watched([sys.executable, "-c", hung], stall=0.5, capture_output=True, text=True)
    assert time.monotonic() - began < 10
