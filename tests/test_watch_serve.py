"""`shardckpt watch --serve`: the status as JSON, Prometheus metrics, and an HTML page checked in a
real headless Chromium (Debian's `chromium`), not only with an HTTP client."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import pytest

from testing.ckpts import TINY_PARAMS, make_run_dir
from shardckpt.tools.synth import synthesize
from shardckpt.watch.service import Watcher
from shardckpt.watch.config import load_pipeline
from shardckpt.watch.http import serve
from shardckpt.watch.status import pipeline_status

PIPELINE = """\
name = "served"
watch = "run"
state = "out"
retries = 0
[[steps]]
kind = "verify"
[[steps]]
kind = "consolidate"
dst = "out/hf/{name}"
"""


@pytest.fixture
def served(tmp_path: Path):
    make_run_dir(tmp_path / "run")
    shard = next((tmp_path / "run" / "step-00000100").glob("*/shard-00001-of-*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-3])  # truncated: verify fails, the step is dead
    (tmp_path / "p.toml").write_text(PIPELINE)
    p = load_pipeline(str(tmp_path / "p.toml"))
    w = Watcher(p)
    w.run(once=True)
    server = serve(0, lambda: pipeline_status(p, w.watch, w.state), w.counters)
    yield f"http://127.0.0.1:{server.server_address[1]}", tmp_path
    server.shutdown()
    server.server_close()


def get(url: str) -> tuple[str, bytes]:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.headers["Content-Type"], r.read()


def test_json_and_metrics(served) -> None:
    url, _ = served
    ctype, body = get(url + "/status.json")
    doc = json.loads(body)
    assert ctype == "application/json"
    states = {c["checkpoint"]: [s["state"] for s in c["steps"]] for c in doc["checkpoints"]}
    assert states == {"step-00000100": ["dead", "blocked"], "step-00000200": ["done", "done"]}
    ctype, body = get(url + "/metrics")
    text = body.decode()
    assert ctype.startswith("text/plain; version=0.0.4")
    assert 'shardckpt_watch_steps{pipeline="served",kind="verify",state="dead"} 1' in text
    assert 'shardckpt_watch_steps{pipeline="served",kind="consolidate",state="done"} 1' in text
    assert 'shardckpt_watch_steps_done_total{pipeline="served",kind="verify"} 1' in text
    assert 'shardckpt_watch_steps_dead_total{pipeline="served",kind="verify"} 1' in text
    assert re.search(r'shardckpt_watch_step_bytes_total\{pipeline="served",kind="consolidate"\} [1-9]', text)
    with pytest.raises(urllib.error.HTTPError) as e:
        get(url + "/nope")
    assert e.value.code == 404


class Table(HTMLParser):
    """The rows of the page's #checkpoints table as lists of cell texts."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self._in_table = self._in_cell = False

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag == "table" and ("id", "checkpoints") in attrs:
            self._in_table = True
        elif self._in_table and tag == "tr":
            self.rows.append([])
        elif self._in_table and tag in ("td", "th"):
            self._in_cell = True
            self.rows[-1].append("")

    def handle_endtag(self, tag: str) -> None:
        if tag == "table":
            self._in_table = False
        elif tag in ("td", "th"):
            self._in_cell = False

    def handle_data(self, data: str) -> None:
        if self._in_cell:
            self.rows[-1][-1] += data


def chromium() -> str | None:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None and os.environ.get("SHARDCKPT_REQUIRE_CHROMIUM") == "1":
        pytest.fail("SHARDCKPT_REQUIRE_CHROMIUM=1 but no chromium on PATH (apt-get install chromium)")
    return found


def browse(binary: str, tmp: Path, url: str, *mode: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--disable-dev-shm-usage",
         f"--user-data-dir={tmp / 'chromium-profile'}", "--window-size=1100,500", *mode, url],
        capture_output=True, text=True, timeout=180)


def test_html_page_in_headless_chromium(served) -> None:
    binary = chromium()
    if binary is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium); the page test "
                    "needs a real browser")
    url, tmp = served
    r = browse(binary, tmp, url + "/", "--dump-dom")
    assert r.returncode == 0, r.stderr[-2000:]
    table = Table()
    table.feed(r.stdout)
    assert table.rows[0] == ["checkpoint", "1-verify", "2-consolidate"]
    body = {row[0]: row[1:] for row in table.rows[1:]}
    assert set(body) == {"step-00000100", "step-00000200"}
    assert body["step-00000100"][0].startswith("dead") and "truncated" in body["step-00000100"][0]
    assert body["step-00000100"][1] == "blocked"
    assert all(c.startswith("done") and " s, " in c for c in body["step-00000200"])
    shot = tmp / "page.png"
    r = browse(binary, tmp, url + "/", f"--screenshot={shot}")
    assert r.returncode == 0 and shot.stat().st_size > 1000, r.stderr[-2000:]
    keep = os.environ.get("SHARDCKPT_SCREENSHOT")
    if keep:
        shutil.copy(shot, keep)


def test_cli_serve_while_watching(tmp_path: Path) -> None:
    import queue
    import signal
    import sys
    import threading

    synthesize(str(tmp_path / "run" / "step-00000100"), TINY_PARAMS, 2, step=100)
    (tmp_path / "p.toml").write_text(PIPELINE.replace("retries = 0", "retries = 0\ninterval_s = 0.1"))
    proc = subprocess.Popen([sys.executable, "-c", "from shardckpt.cli.main import app; app()", "watch",
                             str(tmp_path / "p.toml"), "--serve", "0", "-q"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: first.put(proc.stderr.readline()), daemon=True).start()
        line = first.get(timeout=120)  # a bound on a hang, not a timing assertion
        m = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
        assert m, line
        url = f"http://127.0.0.1:{m.group(1)}"
        for _ in range(3000):  # a bound on a hang, not a timing assertion
            doc = json.loads(get(url + "/status.json")[1])
            if doc["totals"]["done"] == 2:
                break
            time.sleep(0.02)
        assert doc["totals"] == {"done": 2, "dead": 0, "running": 0, "pending": 0, "blocked": 0,
                                 "waiting": 0}
        assert 'shardckpt_watch_steps_done_total{pipeline="served",kind="consolidate"} 1' in \
            get(url + "/metrics")[1].decode()
        proc.send_signal(signal.SIGINT)  # a graceful stop: exit 0
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0 and err.strip().splitlines()[-1] == "stopped on SIGINT", err
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=120)
