"""A fault-injecting HTTP reverse proxy for S3 on loopback.

The proxy sits between s3fs and a local S3 server (moto or Ceph RGW) and, per
rule, answers a chosen fraction of requests with a fault instead of (or on top
of) the server's answer. It runs an aiohttp server on its own event loop in a
background thread, so tests drive it from plain synchronous code::

    with FaultProxy("http://127.0.0.1:7480") as proxy:
        proxy.add_rule("slowdown", method="PUT", every=2)
        fs = s3fs.S3FileSystem(..., client_kwargs={"endpoint_url": proxy.endpoint_url})
        ...
        assert proxy.faulted == 3

Invariants:
- Requests are forwarded byte for byte: the raw (still percent-encoded) path and
  query, every end-to-end header including Host as the client sent it, and the
  raw body, streamed. SigV4 signatures made for the proxy's address therefore
  verify upstream. Hop-by-hop headers and `Expect` (never signed by botocore;
  the proxy has already answered `100-continue` itself) are dropped.
- Responses are relayed likewise: status, headers (HEAD keeps Content-Length)
  and the raw body, never decompressed.
- Rules are checked in the order added; the first rule whose filter matches and
  whose schedule fires decides the request. Later rules do not see it.
"""

from __future__ import annotations

import asyncio
import collections
import random
import re
import socket
import struct
import threading
import uuid
from dataclasses import dataclass, field
from xml.sax.saxutils import escape

import aiohttp
from aiohttp import web
from yarl import URL

FAULT_KINDS = ("slowdown", "internal_error", "reset", "truncate", "delay", "corrupt")
_HOP_BY_HOP = frozenset(
    h.lower()
    for h in ("Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization",
              "TE", "Trailer", "Transfer-Encoding", "Upgrade", "Expect")
)
_ERRORS = {  # kind -> (status, S3 error code, message)
    "slowdown": (503, "SlowDown", "Please reduce your request rate."),
    "internal_error": (500, "InternalError", "We encountered an internal error. Please try again."),
}
_LOG_LIMIT = 10_000


@dataclass(eq=False)
class FaultRule:
    """One fault and the requests it applies to.

    Filter (all given parts must match): `method` ("PUT", or several as "PUT|POST"),
    `path` (regex searched in the raw URL path, e.g. r"/bucket/key$"), `query`
    (regex searched in the raw query string, e.g. r"partNumber=" for UploadPart).
    Schedule over the matching requests (at most one; none means all of them):
    `probability` (seeded RNG), `every` (the k-th, 2k-th, ...), `first` (the first n).

    Kinds:
    - "slowdown": 503 SlowDown with an S3 XML error body; upstream never sees it.
    - "internal_error": 500 InternalError, likewise.
    - "reset": TCP RST without a response. With `after_upstream` the request is
      forwarded first, so the server applies it but the client never hears back.
    - "truncate": forward, relay headers (full Content-Length) and only
      `keep_bytes` of the body (default: half), then close the connection.
    - "delay": sleep `delay_s` seconds, then forward normally.
    - "corrupt": forward, flip one bit of the response body at byte `corrupt_at`
      (default: the middle); length and headers unchanged.
    """

    kind: str
    method: str | None = None
    path: str | None = None
    query: str | None = None
    probability: float | None = None
    every: int | None = None
    first: int | None = None
    seed: int = 0
    delay_s: float = 0.0
    keep_bytes: int | None = None
    corrupt_at: int | None = None
    after_upstream: bool = False
    matched: int = 0  # requests that passed the filter
    faulted: int = 0  # requests this rule faulted
    _rng: random.Random = field(init=False, repr=False)
    _path_re: re.Pattern | None = field(init=False, repr=False)
    _query_re: re.Pattern | None = field(init=False, repr=False)
    _methods: frozenset[str] | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"kind={self.kind!r}: expected one of {FAULT_KINDS}")
        schedules = [n for n in ("probability", "every", "first") if getattr(self, n) is not None]
        if len(schedules) > 1:
            raise ValueError(f"give at most one of probability/every/first, got {schedules}")
        if self.probability is not None and not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"probability={self.probability}: expected 0..1")
        if self.every is not None and self.every < 1:
            raise ValueError(f"every={self.every}: expected >= 1")
        if self.first is not None and self.first < 0:
            raise ValueError(f"first={self.first}: expected >= 0")
        if self.kind == "delay" and self.delay_s <= 0:
            raise ValueError("kind='delay' needs delay_s > 0")
        if self.after_upstream and self.kind != "reset":
            raise ValueError("after_upstream applies to kind='reset' only")
        self._rng = random.Random(self.seed)
        self._path_re = re.compile(self.path) if self.path else None
        self._query_re = re.compile(self.query) if self.query else None
        self._methods = frozenset(self.method.upper().split("|")) if self.method else None

    def _matches(self, method: str, path: str, query: str) -> bool:
        return (
            (self._methods is None or method in self._methods)
            and (self._path_re is None or self._path_re.search(path) is not None)
            and (self._query_re is None or self._query_re.search(query) is not None)
        )

    def _fires(self) -> bool:
        """Called once per matching request, after `matched` was incremented."""
        if self.probability is not None:
            return self._rng.random() < self.probability
        if self.every is not None:
            return self.matched % self.every == 0
        if self.first is not None:
            return self.matched <= self.first
        return True


@dataclass(frozen=True)
class RequestRecord:
    method: str
    path: str
    query: str
    fault: str | None  # the kind applied, or None if forwarded untouched


class FaultProxy:
    """Reverse proxy from `endpoint_url` (127.0.0.1, free port) to `upstream`."""

    def __init__(self, upstream: str, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.upstream = URL(upstream.rstrip("/"))
        self._host, self._port = host, port
        self._lock = threading.Lock()
        self._rules: list[FaultRule] = []
        self._log: collections.deque[RequestRecord] = collections.deque(maxlen=_LOG_LIMIT)
        self.seen = 0  # requests received
        self.faulted = 0  # requests faulted, all rules
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop_event: asyncio.Event | None = None
        self._session: aiohttp.ClientSession | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    # -- sync control ---------------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        if not self._ready.is_set():
            raise RuntimeError("FaultProxy is not started")
        return f"http://{self._host}:{self._port}"

    def start(self, timeout: float = 10.0) -> FaultProxy:
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._run, name="faultproxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout) or self._error is not None:
            self.stop()
            raise RuntimeError(f"FaultProxy did not start: {self._error!r}")
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving; in-flight requests are cut off. Safe to call twice."""
        thread, loop = self._thread, self._loop
        if thread is None:
            return
        if loop is not None and self._stop_event is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._stop_event.set)
            except RuntimeError:  # loop already closed
                pass
        thread.join(timeout)
        if thread.is_alive():
            raise RuntimeError(f"FaultProxy thread did not stop within {timeout}s")
        self._thread = None
        self._ready.clear()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def add_rule(self, kind: str, **kwargs: object) -> FaultRule:
        """Append a rule (see FaultRule for the arguments) and return it."""
        rule = FaultRule(kind, **kwargs)  # type: ignore[arg-type]
        with self._lock:
            self._rules.append(rule)
        return rule

    def clear(self) -> None:
        """Remove all rules; counters and the request log are kept."""
        with self._lock:
            self._rules.clear()

    def reset_counters(self) -> None:
        with self._lock:
            self.seen = self.faulted = 0
            self._log.clear()

    @property
    def log(self) -> list[RequestRecord]:
        """The last requests received (at most 10,000), oldest first."""
        with self._lock:
            return list(self._log)

    # -- event loop thread ----------------------------------------------------

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as e:  # surfaced to start(); the thread must not die silently
            self._error = e
            self._ready.set()
        finally:
            # Handlers still running (e.g. a long "delay") are cancelled, not leaked.
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _serve(self) -> None:
        self._stop_event = asyncio.Event()
        app = web.Application(client_max_size=0)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # auto_decompress=False: relay Content-Encoding'd request bodies as they came.
        runner = web.AppRunner(app, access_log=None, auto_decompress=False, shutdown_timeout=0.5)
        connector = aiohttp.TCPConnector(limit=64, force_close=False)
        self._session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=300),
        )
        await runner.setup()
        try:
            site = web.TCPSite(runner, self._host, self._port)
            await site.start()
            self._port = runner.addresses[0][1]
            self._ready.set()
            await self._stop_event.wait()
        finally:
            await runner.cleanup()
            await self._session.close()

    def _pick(self, method: str, path: str, query: str) -> FaultRule | None:
        with self._lock:
            self.seen += 1
            chosen = None
            for rule in self._rules:
                if rule._matches(method, path, query):
                    rule.matched += 1
                    if rule._fires():
                        rule.faulted += 1
                        self.faulted += 1
                        chosen = rule
                        break
            self._log.append(RequestRecord(method, path, query, chosen.kind if chosen else None))
            return chosen

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raw_path, _, query = request.raw_path.partition("?")
        rule = self._pick(request.method, raw_path, query)
        kind = rule.kind if rule else None
        try:
            if kind in _ERRORS:
                await request.read()  # consume the upload so the client sees our answer, not EPIPE
                return _s3_error(request, *_ERRORS[kind])
            if kind == "reset" and not rule.after_upstream:
                return _reset(request)
            if kind == "delay":
                await asyncio.sleep(rule.delay_s)
                if _client_gone(request):  # it timed out meanwhile: do not replay a dead request
                    return web.Response()
            return await self._forward(request, rule)
        except (OSError, aiohttp.ClientError, asyncio.TimeoutError) as e:
            if _client_gone(request):  # nobody to answer; aiohttp drops the response quietly
                return web.Response()
            return _s3_error(request, 502, "BadGateway", f"fault proxy: upstream failed: {e!r}")

    async def _forward(self, request: web.Request, rule: FaultRule | None) -> web.StreamResponse:
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP]
        async with self._session.request(
            request.method,
            URL(str(self.upstream) + request.raw_path, encoded=True),
            headers=headers,
            data=request.content if request.body_exists else None,
            allow_redirects=False,
            compress=None,
        ) as upstream:
            kind = rule.kind if rule else None
            if kind == "reset":  # after_upstream: the server acted, the client never hears
                await upstream.read()
                return _reset(request)
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for k, v in upstream.headers.items():
                if k.lower() not in _HOP_BY_HOP:
                    response.headers.add(k, v)
            if upstream.content_length is None and request.method != "HEAD":
                response.enable_chunked_encoding()
            await response.prepare(request)
            try:
                await self._relay_body(request, upstream, response, rule)
            except (OSError, aiohttp.ClientError, asyncio.TimeoutError):
                _reset(request)  # headers are out: a short body + RST is all we can say
            return response

    @staticmethod
    async def _relay_body(
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        response: web.StreamResponse,
        rule: FaultRule | None,
    ) -> None:
        kind = rule.kind if rule else None
        length = upstream.content_length or 0
        limit = flip_at = None
        if kind == "truncate":
            limit = rule.keep_bytes if rule.keep_bytes is not None else length // 2
        elif kind == "corrupt":
            flip_at = rule.corrupt_at if rule.corrupt_at is not None else length // 2
        sent = 0
        async for chunk in upstream.content.iter_chunked(1 << 16):
            if flip_at is not None and sent <= flip_at < sent + len(chunk):
                i = flip_at - sent
                chunk = chunk[:i] + bytes([chunk[i] ^ 0x01]) + chunk[i + 1 :]
            if limit is not None and sent + len(chunk) >= limit:
                chunk = chunk[: limit - sent]
                await response.write(chunk)
                sent += len(chunk)
                break
            await response.write(chunk)
            sent += len(chunk)
        if limit is not None:  # drop the connection, also if the body was shorter than the cut
            _close_after_flush(request)
            return
        await response.write_eof()


def _s3_error(request: web.Request, status: int, code: str, message: str) -> web.Response:
    request_id = uuid.uuid4().hex[:16].upper()
    headers = {"x-amz-request-id": request_id, "Content-Type": "application/xml"}
    if request.method == "HEAD":  # HEAD answers carry no body; botocore reads the status only
        return web.Response(status=status, headers=headers)
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{escape(message)}</Message>"
        f"<Resource>{escape(request.path)}</Resource><RequestId>{request_id}</RequestId></Error>"
    )
    return web.Response(status=status, body=body.encode(), headers=headers)


def _reset(request: web.Request) -> web.StreamResponse:
    """Abort the client connection with a TCP RST (SO_LINGER 0), sending nothing."""
    transport = request.transport
    if transport is not None:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()
    return web.Response()  # written to a dead transport; aiohttp drops it


def _client_gone(request: web.Request) -> bool:
    return request.transport is None or request.transport.is_closing()


def _close_after_flush(request: web.Request) -> None:
    """Close once the buffered bytes are sent: the client sees a short body, then EOF."""
    if request.transport is not None:
        request.transport.close()
