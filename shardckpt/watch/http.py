"""``shardckpt watch --serve PORT``: the pipeline's status over HTTP on 127.0.0.1.

* ``/`` — a small HTML page: one row per checkpoint, one cell per step (state, duration, bytes,
  the failure's reason), refreshed by the browser every 10 s;
* ``/status.json`` — the document :func:`~shardckpt.watch.status.pipeline_status` returns;
* ``/metrics`` — Prometheus text format: steps by kind and state (from the records), and this
  watcher's own counters (steps done, dead, adopted, retries, seconds, bytes).

Every request reads the records afresh (a few listings); nothing is cached between requests.

Only requests for this machine are answered (:func:`allowed_hosts`): a ``Host`` header other than
``127.0.0.1``, ``localhost`` or ``[::1]`` (with or without the port), or the address the server
was explicitly bound to, gets 421 and no data, so that a web page whose name an attacker
re-points at 127.0.0.1 (DNS rebinding) cannot read the status through the visitor's browser.
"""

from __future__ import annotations

import html
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from collections.abc import Callable

from shardckpt.watch.records import printable
from shardckpt.watch.status import STATES, UNREADABLE

log = logging.getLogger(__name__)

_CSS = """body{font-family:sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse}th,td{border:1px solid #bbb;padding:.3em .6em;font-size:14px}
th{background:#eee}.done{background:#d8f5d0}.dead{background:#f8d0d0}.running{background:#fff3c0}
.pending,.waiting{background:#f4f4f4}.unreadable{background:#fbe0b8}.blocked{background:#e6e6e6;color:#777}
td:first-child{white-space:nowrap}small{color:#555;display:inline-block;max-width:32em;overflow-wrap:anywhere}"""


def human(n: float | None) -> str:
    if n is None:
        return ""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def render_html(doc: dict[str, Any]) -> str:
    e = html.escape
    head = "".join(f"<th>{e(s['key'])}</th>" for s in doc["steps"])
    rows = []
    for c in doc["checkpoints"]:
        note = "" if c["committed"] else (" (removed)" if not c["present"] else " (not committed)")
        cells = []
        for s in c["steps"]:
            detail = ""
            if s["state"] == "done":
                detail = f"<br><small>{s['seconds'] or 0:.2f} s, {human(s['bytes'])}</small>"
            elif s["state"] in ("dead", UNREADABLE):
                detail = f"<br><small>{e(str(s['reason'] or ''))}</small>"
            cells.append(f'<td class="{e(s["state"])}" data-state="{e(s["state"])}">'
                         f"{e(s['state'])}{detail}</td>")
        rows.append(f'<tr data-checkpoint="{e(c["checkpoint"])}"><td>{e(c["checkpoint"])}{e(note)}'
                    f"</td>{''.join(cells)}</tr>")
    totals = ", ".join(f"{n} {s}" for s, n in doc["totals"].items() if n) or "nothing yet"
    return (f"<!doctype html><html><head><meta charset=\"utf-8\"><meta http-equiv=\"refresh\" "
            f"content=\"10\"><title>shardckpt watch: {e(doc['pipeline'])}</title><style>{_CSS}"
            f"</style></head><body><h1>Pipeline {e(doc['pipeline'])}</h1><p>Watching "
            f"<code>{e(doc['watch'])}</code>; records in <code>{e(doc['state'])}</code>.</p>"
            f"<p id=\"totals\">{e(totals)}</p><table id=\"checkpoints\"><thead><tr><th>checkpoint"
            f"</th>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
            f"<p><a href=\"status.json\">status.json</a> · <a href=\"metrics\">metrics</a></p>"
            "</body></html>")


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")


def render_metrics(doc: dict[str, Any], counters: Any = None) -> str:
    """Prometheus text exposition (version 0.0.4)."""
    out = ["# HELP shardckpt_watch_steps Steps of the pipeline's checkpoints by kind and state.",
           "# TYPE shardckpt_watch_steps gauge"]
    by: dict[tuple[str, str], int] = {}
    for c in doc["checkpoints"]:
        for s in c["steps"]:
            by[(s["kind"], s["state"])] = by.get((s["kind"], s["state"]), 0) + 1
    p = _label(doc["pipeline"])
    for st in doc["steps"]:
        for state in STATES + (UNREADABLE,):
            n = by.get((st["kind"], state), 0)
            out.append(f'shardckpt_watch_steps{{pipeline="{p}",kind="{_label(st["kind"])}",'
                       f'state="{state}"}} {n}')
    out += ["# HELP shardckpt_watch_checkpoints Checkpoints in the run directory.",
            "# TYPE shardckpt_watch_checkpoints gauge",
            f'shardckpt_watch_checkpoints{{pipeline="{p}"}} '
            f'{sum(1 for c in doc["checkpoints"] if c["present"])}']
    if counters is not None:
        for name, attr, typ in (("steps_done_total", "done", "counter"),
                                ("steps_dead_total", "dead", "counter"),
                                ("steps_adopted_total", "adopted", "counter"),
                                ("step_retries_total", "retries", "counter"),
                                ("step_seconds_total", "seconds", "counter"),
                                ("step_bytes_total", "bytes", "counter")):
            out += [f"# HELP shardckpt_watch_{name} This watcher's {attr} by step kind.",
                    f"# TYPE shardckpt_watch_{name} {typ}"]
            with counters.lock:
                items = sorted(getattr(counters, attr).items())
            out += [f'shardckpt_watch_{name}{{pipeline="{p}",kind="{_label(k)}"}} {v}' for k, v in items]
    return "\n".join(out) + "\n"


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")
_WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def allowed_hosts(host: str, port: int) -> frozenset[str]:
    """The ``Host`` header values a server bound to ``host``:``port`` answers (lower case): the
    loopback names, and ``host`` itself when it is a specific address (not a wildcard such as
    0.0.0.0, which would let any name through), each alone or with ``:port``."""
    names = set(LOOPBACK_HOSTS)
    h = host.strip().lower()
    if h not in _WILDCARDS:
        names.add(f"[{h}]" if ":" in h and not h.startswith("[") else h)
    return frozenset(names | {f"{n}:{port}" for n in names})


def _render(doc: dict[str, Any], path: str, counters: Any) -> tuple[str, bytes]:
    if path == "/status.json":
        return "application/json", json.dumps(doc, indent=1).encode()
    if path == "/metrics":
        return "text/plain; version=0.0.4; charset=utf-8", render_metrics(doc, counters).encode()
    return "text/html; charset=utf-8", render_html(doc).encode()


def serve(port: int, status: Callable[[], dict[str, Any]], counters: Any = None,
          host: str = "127.0.0.1") -> ThreadingHTTPServer:
    """Start serving in a daemon thread; ``server.shutdown()`` stops it. ``port`` 0 picks one
    (``server.server_address[1]``)."""

    class Handler(BaseHTTPRequestHandler):
        allowed: frozenset[str] = frozenset()

        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            hosts = self.headers.get_all("Host") or []
            if len(hosts) != 1 or hosts[0].strip().lower() not in self.allowed:
                log.info("refused a request for Host %s from %s",
                         printable(repr(hosts[0] if len(hosts) == 1 else hosts), 200),
                         self.address_string())
                self._send(421, "text/plain; charset=utf-8",
                           b"misdirected request: this server answers only for localhost\n")
                return
            path = self.path.split("?", 1)[0]
            if path not in ("/", "/index.html", "/status.json", "/metrics"):
                self._send(404, "text/plain; charset=utf-8", b"not found\n")
                return
            try:
                doc = status()
            except Exception as e:  # noqa: BLE001 - the page reports it; the server stays up
                why = printable(str(e).splitlines()[0] if str(e).strip() else type(e).__name__, 500)
                log.warning("status failed: %s", why)
                self._send(503, "text/plain; charset=utf-8", f"status unavailable: {why}\n".encode())
                return
            try:
                ctype, body = _render(doc, path, counters)
            except Exception as e:  # noqa: BLE001 - an answer, never a dropped connection
                log.warning("could not render %s: %s: %s", path, type(e).__name__, printable(e, 500))
                self._send(500, "text/plain; charset=utf-8", b"internal error; see the watcher's log\n")
                return
            self._send(200, ctype, body)

        def _send(self, code: int, ctype: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            if ctype.startswith("text/html"):
                self.send_header("Content-Security-Policy",
                                 "default-src 'none'; style-src 'unsafe-inline'; frame-ancestors 'none'")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("%s %s", self.address_string(), printable(fmt % args, 500))

    server = ThreadingHTTPServer((host, port), Handler)
    Handler.allowed = allowed_hosts(host, server.server_address[1])
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="shardckpt-serve", daemon=True).start()
    return server
