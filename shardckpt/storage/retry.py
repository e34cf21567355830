"""Retries under one deadline, and the one error vocabulary of the storage layer.

Every failure leaves this layer as a :class:`~shardckpt.errors.StorageError` whose one-line
message names the object, with the original exception as ``__cause__``. Transient failures (5xx,
throttling, resets, timeouts, truncated bodies) are retried with capped, jittered backoff until
one deadline per operation; everything else fails at once. Which is which is the backend's call
(its :meth:`classify`, each backend with its own error vocabulary); :func:`classify` here is the
vocabulary every fsspec filesystem shares. Transport errors are recognised by class name, so no
HTTP stack is imported here.
"""

from __future__ import annotations

import errno
import logging
import random
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal, TypeVar
from collections.abc import Callable, Iterator

from shardckpt.errors import DeadlineExceededError, NotFoundError, ShardckptError, StorageError

log = logging.getLogger(__name__)
T = TypeVar("T")

DEADLINE_ENV = "SHARDCKPT_DEADLINE_S"


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """One overall deadline per operation, capped exponential backoff, an explicit retryable list."""

    deadline_s: float = 120.0
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 5.0


#: A call still retrying after this long says so as a warning, then at most every
#: :data:`NOTICE_EVERY_S` seconds (before, retries are logged at INFO).
NOTICE_AFTER_S = 3.0
NOTICE_EVERY_S = 10.0


def attempts_until(policy: RetryPolicy, seconds: float) -> int:
    """The most attempts that fit in ``seconds`` with ``policy``'s backoff (each pause at its
    shortest jitter): the N of "n/N" in the log (the deadline is what ends the retries)."""
    n, t, backoff = 1, 0.0, policy.initial_backoff_s
    while t + 0.5 * backoff < seconds and n < 100_000:
        t += 0.5 * backoff
        backoff = min(backoff * 2, policy.max_backoff_s)
        n += 1
    return n


#: What a backend's :meth:`classify` answers: retry the call, or fail at once.
Verdict = Literal["retry", "permanent"]

_RETRYABLE_ERRNO = frozenset({errno.EBUSY, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET,
                              errno.EREMOTEIO, errno.ECONNREFUSED, errno.EPIPE, errno.ECONNABORTED})
#: Transport errors of the HTTP stacks fsspec filesystems use (aiohttp, asyncio, urllib3),
#: matched by class name so none is imported here.
TRANSIENT_NAMES = frozenset({
    "ClientPayloadError", "ClientConnectionError", "ServerDisconnectedError", "ClientConnectorError",
    "ClientOSError", "ServerTimeoutError", "TimeoutError", "ProtocolError", "ContentLengthError",
})
#: fsspec's "the object changed under an open file": reading on would mix two versions.
PERMANENT_NAMES = frozenset({"FileExpired"})
_PERMANENT_TYPES = (FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError,
                    NotADirectoryError)


def error_response(e: BaseException) -> tuple[str, int]:
    """(service error code, HTTP status) of an error that carries a boto-style ``response``
    (or whose cause does); ("", 0) otherwise. Used for messages and HTTP statuses only."""
    for x in (e, e.__cause__):
        resp = getattr(x, "response", None)
        if isinstance(resp, dict):
            code = str(resp.get("Error", {}).get("Code", ""))
            status = int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            return code, status
    return "", 0


def classify(e: BaseException, transient: frozenset[str] = TRANSIENT_NAMES,
             permanent: frozenset[str] = PERMANENT_NAMES,
             transient_codes: frozenset[str] = frozenset()) -> Verdict:
    """The verdict for ``e`` in the vocabulary every fsspec filesystem shares: missing, denied
    and existing objects and the errors named in ``permanent`` are permanent; connection resets,
    timeouts, the transport errors named in ``transient``, the service error codes in
    ``transient_codes``, HTTP 5xx and 429, and the errnos of a busy or broken connection are
    transient; anything else is permanent. A backend with its own vocabulary passes its names
    and codes here (:meth:`~shardckpt.storage.s3.S3Backend.classify`)."""
    names = {cls.__name__ for cls in type(e).__mro__}
    if names & permanent or isinstance(e, _PERMANENT_TYPES):
        return "permanent"
    if names & transient or isinstance(e, (ConnectionError, TimeoutError)):
        return "retry"
    code, status = error_response(e)
    if code in transient_codes or status >= 500 or status == 429:
        return "retry"
    if isinstance(e, OSError) and e.errno in _RETRYABLE_ERRNO:
        return "retry"
    return "permanent"


def describe_error(e: BaseException) -> str:
    """One line: exception type, message, and the S3 error code when there is one."""
    text = " ".join(str(e).split())[:300] or repr(e)
    code, status = error_response(e)
    extra = f" ({code}, HTTP {status})" if code and code not in text else ""
    return f"{type(e).__name__}: {text}{extra}"


def map_error(e: BaseException, what: str, url: str, attempts: int = 1, elapsed: float = 0.0,
              deadline: float | None = None) -> StorageError:
    """The :class:`StorageError` that ``e`` (raised by ``what`` on ``url``) becomes: not found,
    permission denied, a deadline passed after ``attempts`` (where ``deadline`` is given), or
    a failure described by :func:`describe_error`."""
    if isinstance(e, FileNotFoundError):
        return NotFoundError(f"{url}: not found ({what})", url)
    if isinstance(e, PermissionError):
        return StorageError(f"{url}: permission denied ({what}): {describe_error(e)}", url)
    if attempts > 1 and deadline is not None:
        return DeadlineExceededError(
            f"{url}: {what} failed after {attempts} attempts in {elapsed:.1f} s (deadline "
            f"{deadline:g} s; set shardckpt_deadline_s or {DEADLINE_ENV}): {describe_error(e)}",
            url)
    return StorageError(f"{url}: {what} failed: {describe_error(e)}", url)


@contextmanager
def mapped_errors(what: str, url: str) -> Iterator[None]:
    try:
        yield
    except ShardckptError:
        raise
    except OSError as e:
        raise map_error(e, what, url) from e


def retry_call(policy: RetryPolicy, what: str, url: str, fn: Callable[[], T],
               deadline: float | None = None,
               classify: Callable[[BaseException], Verdict] = classify) -> T:
    """Run ``fn`` with retries on what ``classify`` (the backend's) calls transient until the
    deadline; map errors.

    ``deadline`` (``time.monotonic()`` seconds) lets several calls share one; by default it is
    the policy's ``deadline_s`` from now. Backoff is capped, exponential and jittered. Each
    retry is logged, at INFO while the call is young, then as a WARNING (on stderr where nothing
    else handles the log) once it has been retrying for :data:`NOTICE_AFTER_S`, at most every
    :data:`NOTICE_EVERY_S`: ``retrying read of s3://b/x (7/31, deadline 120 s, 104 s left): ...``
    rather than minutes of silence.
    """
    t0 = told = time.monotonic()
    end = deadline if deadline is not None else t0 + policy.deadline_s
    backoff = policy.initial_backoff_s
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except ShardckptError:
            raise
        except Exception as e:  # noqa: BLE001 - mapped below, never swallowed
            pause = backoff * (0.5 + random.random() / 2)
            transient = classify(e) == "retry"
            now = time.monotonic()
            if transient and now + pause < end:
                loud = now - t0 >= NOTICE_AFTER_S and now - told >= NOTICE_EVERY_S
                told = now if loud else told
                log.log(logging.WARNING if loud else logging.INFO,
                        "retrying %s of %s (%d/%d, deadline %.0f s, %.0f s left): %s", what, url,
                        attempt, attempts_until(policy, end - t0), end - t0, end - now,
                        describe_error(e))
                time.sleep(pause)
                backoff = min(backoff * 2, policy.max_backoff_s)
                continue
            raise map_error(e, what, url, attempt, time.monotonic() - t0,
                            policy.deadline_s if transient else None) from e
