"""A storage call that keeps retrying says so on stderr after a few seconds (a WARNING through
logging, which Python prints on stderr when nothing else handles it) instead of staying silent
until its deadline. The clock is a fake one: no test waits out a backoff."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from shardckpt.errors import DeadlineExceededError
from shardckpt.storage import retry


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def test_a_retrying_call_warns_with_its_count_and_deadline(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    monkeypatch.setattr(retry.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(retry.time, "sleep", clock.sleep)
    policy = retry.RetryPolicy(deadline_s=120.0, initial_backoff_s=0.1, max_backoff_s=5.0)

    def reset() -> None:
        raise ConnectionResetError("connection reset by peer")

    caplog.set_level(logging.INFO, logger="shardckpt.storage.retry")
    with pytest.raises(DeadlineExceededError, match="deadline 120 s"):
        retry.retry_call(policy, "read", "s3://b/run/x", reset)
    warned = [(r.created, r.getMessage()) for r in caplog.records if r.levelno == logging.WARNING]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos and warned, (infos, warned)
    n_max = retry.attempts_until(policy, 120.0)
    first = warned[0][1]
    assert first.startswith("retrying read of s3://b/run/x (") and "/%d, deadline 120 s" % n_max in first
    assert "ConnectionResetError: connection reset by peer" in first
    # silent (INFO) for the first seconds, then a warning at most every NOTICE_EVERY_S
    assert all("retrying read" in m for m in infos)
    attempts = len(infos) + len(warned) + 1
    assert attempts <= n_max
    left = [int(m.split(" s left")[0].rsplit(" ", 1)[1]) for _, m in warned]
    assert left[0] <= 120 - retry.NOTICE_AFTER_S
    assert left[-1] <= retry.NOTICE_EVERY_S + policy.max_backoff_s + 1  # none long silent
    gaps = [a - b for a, b in zip(left, left[1:])]
    assert all(retry.NOTICE_EVERY_S - 1 <= g <= retry.NOTICE_EVERY_S + policy.max_backoff_s + 1
               for g in gaps), gaps


def test_the_warning_reaches_stderr_without_any_logging_setup() -> None:
    code = """
from shardckpt.storage import retry
t = [0.0]
retry.time.monotonic = lambda: t[0]
retry.time.sleep = lambda s: t.__setitem__(0, t[0] + s)
calls = []
def flaky():
    calls.append(1)
    if len(calls) < 12:
        raise TimeoutError("slow down")
    return "ok"
print(retry.retry_call(retry.RetryPolicy(), "read", "s3://b/x", flaky))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == "ok\n", r.stderr
    lines = r.stderr.splitlines()
    assert lines and all(line.startswith("retrying read of s3://b/x (") for line in lines), r.stderr
    assert "deadline 120 s" in lines[0] and "TimeoutError: slow down" in lines[0]
