"""`shardckpt watch` against whoever can write into the run or state prefix, and against web pages
that reach its status server through the browser: planted records (text where numbers go, deep
nesting, oversized, not an object, a lone surrogate), a hostile lease, a checkpoint directory with
a newline in its name, and foreign ``Host`` headers (DNS rebinding). Plus a seeded,
structure-aware fuzz of the record reader and the status renderers (testing/fuzz.py)."""

from __future__ import annotations

import http.client
import json
import logging
import random
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from testing.ckpts import make_run_dir
from testing.fuzz import dumps, expect_clean, mutate_bytes, mutations
from shardckpt.watch.config import load_pipeline
from shardckpt.watch.http import render_html, render_metrics, serve
from shardckpt.watch.records import checkpoint_dir
from shardckpt.watch.service import Watcher
from shardckpt.watch.status import pipeline_status, status_lines

PIPELINE = """\
name = "h"
watch = "run"
state = "out"
retries = 0
[[steps]]
kind = "verify"
[[steps]]
kind = "copy"
dst = "out/copy/{name}"
"""
CKPT = "step-00000100"


def pipeline(tmp: Path, steps: tuple[int, ...] = (100,)) -> Path:
    make_run_dir(tmp / "run", steps)
    path = tmp / "p.toml"
    path.write_text(PIPELINE)
    return path


def record_path(tmp: Path, ckpt: str, name: str) -> Path:
    d = tmp / "out" / checkpoint_dir("h", ckpt)
    d.mkdir(parents=True, exist_ok=True)
    return d / name


def good_done(ckpt: str = CKPT, index: int = 1, kind: str = "verify") -> dict:
    return {"pipeline": "h", "checkpoint": ckpt, "step": 100, "kind": kind, "index": index,
            "claim": 1, "host": "node-1", "pid": 4242, "bytes": 123456, "identity": "abc",
            "source_save_id": "abc", "started": 1.7e9, "finished": 1.7e9 + 2, "seconds": 2.0,
            "tries": 1, "output": None}


def good_dead(ckpt: str = CKPT) -> dict:
    return {"pipeline": "h", "checkpoint": ckpt, "step": 100, "kind": "verify", "index": 1,
            "claim": 1, "host": "node-1", "pid": 4242, "reason": "StepFailed: <b>bad</b>",
            "tries": 1, "finished": 1.7e9}


class Server:
    """``serve`` on 127.0.0.1 (or ``host``) with a free port, for one test."""

    def __init__(self, path: Path, host: str = "127.0.0.1") -> None:
        p = load_pipeline(str(path))
        self.server = serve(0, lambda: pipeline_status(p), None, host=host)
        self.host = host
        self.port = self.server.server_address[1]

    def get(self, target: str = "/", host: str | None = "127.0.0.1") -> tuple[int, str]:
        """``GET target`` with exactly the Host header ``host`` (None: no Host header)."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        try:
            conn.putrequest("GET", target, skip_host=True, skip_accept_encoding=True)
            if host is not None:
                conn.putheader("Host", host)
            conn.endheaders()
            r = conn.getresponse()
            return r.status, r.read().decode("utf-8")
        finally:
            conn.close()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def server_for():
    started: list[Server] = []

    def start(path: Path, host: str = "127.0.0.1") -> Server:
        started.append(Server(path, host))
        return started[-1]
    yield start
    for s in started:
        s.close()


def status_cli(path: Path) -> tuple[int, str, BaseException | None]:
    from shardckpt.cli.main import app

    r = CliRunner().invoke(app, ["watch", str(path), "--status"])
    exc = r.exception if not isinstance(r.exception, SystemExit) else None
    return r.exit_code, r.stdout, exc


# ------------------------------------------------------------------------- planted records

BAD_RECORDS = {
    # text where numbers go: formatting "fast" with :.2f raised inside the page and --status
    "text-for-numbers": ("1-verify.done", json.dumps({**good_done(), "seconds": "fast",
                                                      "bytes": "lots"}).encode()),
    # 5000 brackets: json's recursion gave up and every page answered 503
    "deep": ("1-verify.done", b"[" * 5000 + b"]" * 5000),
    # larger than a record may be
    "oversized": ("1-verify.done", json.dumps({**good_done(), "pad": "x" * 70000}).encode()),
    # a list, not an object: was shown as done with 0 bytes
    "not-an-object": ("1-verify.done", b"[1, 2, 3]"),
    # a number too large for a float: the page's byte formatting overflowed
    "huge-bytes": ("1-verify.done", json.dumps({**good_done(), "bytes": 10**400}).encode()),
}


@pytest.mark.parametrize("case", sorted(BAD_RECORDS))
def test_planted_record_is_reported_unreadable_and_pages_render(
        tmp_path: Path, case: str, server_for, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    path = pipeline(tmp_path)
    name, body = BAD_RECORDS[case]
    rec = record_path(tmp_path, CKPT, name)
    rec.write_bytes(body)
    srv = server_for(path)
    code, page = srv.get("/", f"127.0.0.1:{srv.port}")
    assert code == 200, page
    assert 'data-state="unreadable"' in page and name in page
    code, text = srv.get("/status.json", f"127.0.0.1:{srv.port}")
    assert code == 200, text
    steps = json.loads(text)["checkpoints"][0]["steps"]
    assert [s["state"] for s in steps] == ["unreadable", "blocked"]
    assert str(rec) in steps[0]["reason"] and "\n" not in steps[0]["reason"]
    assert json.loads(text)["totals"]["unreadable"] == 1
    code, text = srv.get("/metrics", f"127.0.0.1:{srv.port}")
    assert code == 200 and 'kind="verify",state="unreadable"} 1' in text
    rc, out, exc = status_cli(path)
    assert exc is None and rc == 0, out
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("1-verify"))
    assert "unreadable" in line and str(rec) in line
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and str(rec) in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    assert "\n" not in warned[0].getMessage()


def test_unprintable_text_in_a_record_is_shown_escaped(tmp_path: Path, server_for) -> None:
    """A lone surrogate (an undecodable file name in a failure's message) made the page
    unencodable as UTF-8 (the connection closed with no answer); a newline or an escape sequence
    would act on a terminal. Shown escaped, on one line."""
    path = pipeline(tmp_path)
    reason = "StepFailed: bad \udc80 name\r\n\x1b[2Jspoofed <i>line</i>"
    record_path(tmp_path, CKPT, "1-verify.dead").write_text(json.dumps({**good_dead(), "reason": reason}))
    srv = server_for(path)
    code, page = srv.get("/")
    assert code == 200, page
    assert "\\udc80" in page and "\\x1b" in page and "<i>" not in page and "&lt;i&gt;" in page
    rc, out, exc = status_cli(path)
    assert exc is None and rc == 0, out
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("1-verify"))
    assert "dead" in line and "\\udc80" in line and "spoofed" in line and "\x1b" not in out


def test_unreadable_record_holds_its_checkpoint_until_removed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Neither rerun (the record's name is taken: a rerun could never be recorded) nor counted done
    (the copy would build on an output that may not exist): the checkpoint waits; others go on."""
    from shardckpt.cli.main import app

    caplog.set_level(logging.WARNING)
    path = pipeline(tmp_path, (100, 200))
    rec = record_path(tmp_path, CKPT, "1-verify.done")
    rec.write_text(json.dumps({**good_done(), "seconds": "fast"}))
    w = Watcher(load_pipeline(str(path)))
    report = w.run(once=True)
    report = w.run(once=True)  # looked at again, warned once
    assert (report.done, report.dead, report.unreadable) == (0, 0, 1)
    d = rec.parent
    assert sorted(p.name for p in d.iterdir() if p.is_file()) == ["1-verify.done"]
    assert json.loads(rec.read_text())["seconds"] == "fast"  # left for the operator to inspect
    assert not (tmp_path / "out" / "copy" / CKPT).exists()
    other = record_path(tmp_path, "step-00000200", "x").parent
    assert sorted(p.name for p in other.glob("*.done")) == ["1-verify.done", "2-copy.done"]
    assert len([r for r in caplog.records if str(rec) in r.getMessage()]) == 1
    r = CliRunner().invoke(app, ["watch", str(path), "--once", "-q"])
    assert r.exit_code == 1 and "1 waiting behind an unreadable record" in r.stdout, r.output
    rec.unlink()
    report = w.run(once=True)
    assert (report.done, report.unreadable) == (2, 0)
    assert sorted(p.name for p in d.glob("*.done")) == ["1-verify.done", "2-copy.done"]


def test_record_of_another_step_is_not_taken_for_this_one(tmp_path: Path) -> None:
    path = pipeline(tmp_path)
    record_path(tmp_path, CKPT, "1-verify.done").write_text(json.dumps(good_done("step-00000001")))
    record_path(tmp_path, CKPT, "2-copy.done").write_text(json.dumps(good_done(index=1)))
    doc = pipeline_status(load_pipeline(str(path)))
    assert [s["state"] for s in doc["checkpoints"][0]["steps"]] == ["unreadable", "unreadable"]
    report = Watcher(load_pipeline(str(path))).run(once=True)
    assert report.unreadable == 1 and not (tmp_path / "out" / "copy" / CKPT).exists()


def test_hostile_lease_counts_as_held_and_pages_render(tmp_path: Path, server_for) -> None:
    path = pipeline(tmp_path)
    lease_dir = record_path(tmp_path, CKPT, "1-verify")
    lease_dir.mkdir()
    (lease_dir / ".lease-deep").write_bytes(b"[" * 2000 + b"]" * 2000)
    (lease_dir / ".lease-big").write_text(json.dumps({"expires": 10**400, "pid": 10**30}))
    srv = server_for(path)
    code, page = srv.get("/", "localhost")
    assert code == 200, page
    doc = json.loads(srv.get("/status.json", "localhost")[1])
    # held while a lease cannot be read (a reader that skips such a lease may say pending)
    assert doc["checkpoints"][0]["steps"][0]["state"] in ("running", "pending")
    rc, out, exc = status_cli(path)
    assert exc is None and rc == 0, out
    report = Watcher(load_pipeline(str(path))).run(once=True)
    assert (report.held, report.done) in ((1, 0), (0, 2))


def test_file_planted_for_a_record_directory_fails_only_its_checkpoint(tmp_path: Path) -> None:
    from shardckpt.errors import ShardckptError

    path = pipeline(tmp_path, (100, 200))
    planted = record_path(tmp_path, CKPT, "x").parent
    planted.rmdir()
    planted.write_text("not a directory")
    with pytest.raises(ShardckptError):
        Watcher(load_pipeline(str(path))).run(once=True)
    other = record_path(tmp_path, "step-00000200", "x").parent
    assert sorted(p.name for p in other.glob("*.done")) == ["1-verify.done", "2-copy.done"]
    doc = pipeline_status(load_pipeline(str(path)))
    assert [c["checkpoint"] for c in doc["checkpoints"]] == [CKPT, "step-00000200"]


# ----------------------------------------------------------------- a newline in a directory name


def test_checkpoint_name_with_a_newline_is_ignored_and_logs_stay_one_line(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    path = pipeline(tmp_path)
    shutil.copytree(tmp_path / "run" / CKPT, tmp_path / "run" / "step-00000001\n")
    shutil.copytree(tmp_path / "run" / CKPT, tmp_path / "run" / "step-\u0660\u0660\u0660\u0660\u0660\u0661\u0660\u0660")
    report = Watcher(load_pipeline(str(path))).run(once=True)
    assert (report.done, report.dead) == (2, 0)
    assert sorted(p.name for p in (tmp_path / "out" / ".watch" / "h").iterdir()) == [CKPT]
    assert sorted(p.name for p in (tmp_path / "out" / "copy").iterdir()) == [CKPT]
    for r in caplog.records:
        assert "\n" not in r.getMessage() and "\r" not in r.getMessage(), r.getMessage()
    doc = pipeline_status(load_pipeline(str(path)))
    assert [c["checkpoint"] for c in doc["checkpoints"]] == [CKPT]
    lines = status_lines(doc)
    assert all("\n" not in ln for ln in lines)
    rc, out, exc = status_cli(path)
    assert exc is None and rc == 0
    assert [ln for ln in out.splitlines() if ln.startswith("step-")] == [CKPT]


# ------------------------------------------------------------------------------ Host header


def test_foreign_host_headers_get_no_data(tmp_path: Path, server_for) -> None:
    path = pipeline(tmp_path)
    record_path(tmp_path, CKPT, "1-verify.dead").write_text(json.dumps(good_dead()))
    srv = server_for(path)
    port = srv.port
    for host in ("127.0.0.1", f"127.0.0.1:{port}", "localhost", f"LocalHost:{port}", "[::1]",
                 f"[::1]:{port}"):
        for target in ("/", "/status.json", "/metrics"):
            code, body = srv.get(target, host)
            assert code == 200, (host, target, body)
    for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1.evil.example:{port}",
                 f"127.0.0.1:{port + 1 if port < 65535 else port - 1}", "localhost.", "0.0.0.0",
                 f"127.0.0.1@evil.example:{port}", "", None):
        for target in ("/", "/status.json", "/metrics", "/nope"):
            code, body = srv.get(target, host)
            assert code in (403, 421), (host, target, code)
            assert len(body) < 200 and "step-" not in body and '"h"' not in body and "verify" not in body


def test_host_bound_explicitly_is_answered_too(tmp_path: Path, server_for) -> None:
    path = pipeline(tmp_path)
    srv = server_for(path, host="127.0.0.2")
    assert srv.get("/status.json", f"127.0.0.2:{srv.port}")[0] == 200
    assert srv.get("/status.json", "127.0.0.2")[0] == 200
    assert srv.get("/status.json", "localhost")[0] == 200
    assert srv.get("/status.json", "evil.example")[0] in (403, 421)


# ------------------------------------------------------------------------------------- fuzz


def test_fuzz_record_reader_and_status_renderers(tmp_path: Path) -> None:
    """Every mutated record is parsed (returns or raises ShardckptError) and the status built
    from it renders as one line per entry, as escaped HTML and as metrics, never raising."""
    from shardckpt.watch.records import parse_record

    path = pipeline(tmp_path)
    p = load_pipeline(str(path))
    for base, state, seed in ((good_done(), "done", 20240601), (good_dead(), "dead", 20240602)):
        rec = record_path(tmp_path, CKPT, f"1-verify.{state}")
        for i, case in mutations(base, seed, 400):
            what = f"{state} record, seed {seed}, case {i}"
            try:
                data = dumps(case).encode("utf-8")
            except ValueError:  # an integer too long for json to write out
                continue
            if i % 4 == 3:
                data = mutate_bytes(data, random.Random(seed * 1000 + i))
            expect_clean(lambda: parse_record(data, state, CKPT, "1-verify"), what)
            rec.write_bytes(data)
            out: dict = {}

            def render() -> None:
                doc = pipeline_status(p)
                out["lines"] = status_lines(doc)
                out["html"] = render_html(doc).encode("utf-8")
                out["metrics"] = render_metrics(doc).encode("utf-8")
                out["json"] = json.dumps(doc)
            assert expect_clean(render, what) is None, what
            assert all("\n" not in ln and "\r" not in ln for ln in out["lines"]), what
            assert b"<script>" not in out["html"], what
            rec.unlink()
