"""Every registered storage backend keeps the contract of :mod:`shardckpt.storage.backend`.

:class:`Contract` holds the checks; one subclass per backend that runs here gives it a fresh
place (``site``) and samples of its own error vocabulary: the local disk, ``memory://``, and S3
on moto and on Ceph RGW (``s3`` marker; Ceph is skipped where it is not installed, unless
``SHARDCKPT_REQUIRE_CEPH`` is set). To check a new backend, subclass :class:`Contract` the same
way. Last, a toy backend registered in the table serves its scheme.
"""

from __future__ import annotations

import errno
import os
import threading
import uuid
from pathlib import Path
from typing import Any, Callable, ClassVar, Collection, Iterator

import pytest

from shardckpt.errors import CommitConflictError, ConfigError
from shardckpt.storage import BACKENDS, Storage, backend_class
from shardckpt.storage.backend import resolve
from shardckpt.storage.backends import Backend
from shardckpt.storage.local import LocalBackend
from shardckpt.storage.options import BackendOptions

GENERIC_TRANSIENT: list[Callable[[], BaseException]] = [
    ConnectionResetError, TimeoutError, lambda: OSError(errno.EAGAIN, "busy"),
    lambda: OSError(errno.EREMOTEIO, "remote I/O"),
]
GENERIC_PERMANENT: list[Callable[[], BaseException]] = [
    FileNotFoundError, PermissionError, IsADirectoryError, lambda: OSError(errno.ENOSPC, "full"),
    lambda: ValueError("a bug"),
]


class Contract:
    """The checks every backend passes. Subclasses provide ``site`` (a Storage on an empty
    place), ``options`` (options its backend takes) and error samples."""

    transient: ClassVar[list[Callable[[], BaseException]]] = GENERIC_TRANSIENT
    permanent: ClassVar[list[Callable[[], BaseException]]] = GENERIC_PERMANENT
    options: ClassVar[dict[str, Any]] = {}

    def test_the_table_names_the_class_for_each_of_its_schemes(self, site: Storage) -> None:
        kind = type(site.backend)
        assert kind.schemes and all(resolve(BACKENDS[s]) is kind for s in kind.schemes)
        assert backend_class(site.url) is kind

    def test_create_only_writes_once_and_refuses_an_existing_object(self, site: Storage) -> None:
        site.create_only("m.json", b"first")
        with pytest.raises(CommitConflictError, match="already exists") as e:
            site.create_only("m.json", b"second")
        assert site.url_of("m.json") in str(e.value)
        assert site.read("m.json") == b"first"

    def test_create_only_has_one_winner(self, site: Storage) -> None:
        won: list[bytes] = []
        lost: list[BaseException] = []

        def attempt(i: int) -> None:
            data = f"writer {i}".encode()
            try:
                site.create_only("race.json", data)
                won.append(data)
            except CommitConflictError as e:
                lost.append(e)
        threads = [threading.Thread(target=attempt, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1 and len(lost) == 5
        assert site.read("race.json") == won[0]

    def test_replace_if_refuses_a_stale_expectation(self, site: Storage) -> None:
        site.put("m.json", b"version 2")
        with pytest.raises(CommitConflictError, match="nothing was replaced") as e:
            site.replace_if("m.json", b"version 3", b"version 1")
        assert site.url_of("m.json") in str(e.value)
        assert site.read("m.json") == b"version 2"
        with pytest.raises(CommitConflictError):  # a prefix of what is there is not it
            site.replace_if("m.json", b"version 3", b"version")
        assert site.read("m.json") == b"version 2"

    def test_replace_if_refuses_an_object_that_is_gone(self, site: Storage) -> None:
        with pytest.raises(CommitConflictError):
            site.replace_if("absent.json", b"new", b"old")
        assert not site.exists("absent.json")

    def test_replace_if_replaces_what_it_expected(self, site: Storage) -> None:
        site.put("m.json", b"version 1")
        site.replace_if("m.json", b"version 2", b"version 1")
        assert site.read("m.json") == b"version 2"
        site.replace_if("m.json", b"version 3", b"version 2")  # the new object's own tag
        assert site.read("m.json") == b"version 3"

    def test_a_passed_over_step_is_put_aside_and_its_number_committed_again(self, site: Storage) -> None:
        """Renamed in one step where the store can; elsewhere its manifest is recorded beside the
        run and the next commit there replaces it by a conditional write, only while it is the
        manifest recorded."""
        import json

        from shardckpt.checkpoint.set_aside import NOTE, PASSED_OVER, put_aside, supersede

        old = json.dumps({"save_id": "20260101T000000Z-0000abcd", "x": 1}).encode()
        site.put("step-00000002/20260101T000000Z-0000abcd/shard", b"bytes")
        site.create_only("step-00000002/manifest.json", old)
        url = put_aside(site, "step-00000002", "it fails its checksums (shard: chunk 0)")
        aside = f"{PASSED_OVER}/step-00000002.20260101T000000Z-0000abcd"
        assert url == site.url_of(aside)
        assert "fails its checksums" in json.loads(site.read(f"{aside}/{NOTE}"))["why"]
        step = site.child("step-00000002")
        renamed = isinstance(site.backend, LocalBackend)
        if renamed:  # the whole directory, at once: nothing of it is left in the way
            assert not site.exists("step-00000002")
            assert site.read(f"{aside}/20260101T000000Z-0000abcd/shard") == b"bytes"
            step.create_only("manifest.json", b"new")
        else:
            assert site.read(f"{aside}/manifest.json") == old and step.read("manifest.json") == old
            assert site.rename("step-00000002", "elsewhere") is False  # no rename: nothing done
            assert put_aside(site, "step-00000002", "again") == url  # recorded once
            assert supersede(step, b"new", "20260102T000000Z-0000beef") is True
        assert step.read("manifest.json") == b"new"
        # a manifest that no resume put aside is never replaced
        assert supersede(step, b"newer", "20260103T000000Z-0000cafe") is False
        assert step.read("manifest.json") == b"new"

    def test_classify_knows_its_transient_and_permanent_errors(self, site: Storage) -> None:
        classify = site.backend.classify
        assert [e() for e in self.transient if classify(e()) != "retry"] == []
        assert [e() for e in self.permanent if classify(e()) != "permanent"] == []

    def test_calls_retry_what_classify_calls_transient(self, site: Storage) -> None:
        tries: list[int] = []

        def flaky() -> str:
            tries.append(1)
            if len(tries) < 3:
                raise self.transient[0]()
            return "done"
        assert site.call("probe", "x", flaky) == "done" and len(tries) == 3
        tries.clear()

        def broken() -> None:
            tries.append(1)
            raise self.permanent[-1]()
        with pytest.raises(Exception) as e:
            site.call("probe", "x", broken)
        assert len(tries) == 1 and site.url_of("x") in str(e.value)

    def test_option_parsing_takes_its_options_and_refuses_unknown_ones(self, site: Storage) -> None:
        kind = type(site.backend)
        parsed = kind.parse_options({**self.options, "shardckpt_deadline_s": 7})
        assert isinstance(parsed, BackendOptions) and parsed.retry.deadline_s == 7
        assert not any(k.startswith("shardckpt_") for k in parsed.fs)
        with pytest.raises(ConfigError) as e:
            Storage(site.url, {**self.options, "endpoint_ulr": "x", "no_such_option": 1})
        assert "endpoint_ulr" in str(e.value) and "no_such_option" in str(e.value)
        assert f"{kind.schemes[0]}://" in str(e.value)
        with pytest.raises(ConfigError, match="shardckpt_deadline: not a shardckpt option"):
            Storage(site.url, {**self.options, "shardckpt_deadline": 3})


class TestLocal(Contract):
    options: ClassVar[dict[str, Any]] = {"auto_mkdir": True}

    @pytest.fixture
    def site(self, tmp_path: Path) -> Storage:
        return Storage(str(tmp_path / "site"))

    def test_a_plain_path_is_served_through_os(self, site: Storage) -> None:
        assert site.backend._fs is None  # fsspec's filesystem is never created for it

    def test_options_make_it_an_fsspec_local_filesystem(self, tmp_path: Path) -> None:
        st = Storage(str(tmp_path), {"auto_mkdir": True})
        assert type(st.backend).__name__ == "LocalBackend" and st.backend._fs is not None

    def test_another_kind_of_places_options_are_left_out(self, tmp_path: Path) -> None:
        """One ``-o`` set serves a command's S3 source and local destination."""
        st = Storage(str(tmp_path), {"key": "k", "client_kwargs": {}, "shardckpt_deadline_s": 5})
        assert st.backend._fs is None and st.retry.deadline_s == 5
        assert "auto_mkdir" not in type(Storage("memory://x").backend).parse_options(
            {"auto_mkdir": True}).fs


class TestMemory(Contract):
    options: ClassVar[dict[str, Any]] = {"skip_instance_cache": False}

    @pytest.fixture
    def site(self) -> Iterator[Storage]:
        st = Storage(f"memory://contract-{uuid.uuid4().hex}")
        yield st
        st.rm("", recursive=True)


# ------------------------------------------------------------------------------------- S3


def _s3_samples() -> tuple[list[Callable[[], BaseException]], list[Callable[[], BaseException]]]:
    import aiohttp
    import botocore.exceptions as bx

    def client_error(code: str, status: int, translated: OSError | None = None) -> BaseException:
        e = bx.ClientError({"Error": {"Code": code, "Message": code},
                            "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")
        if translated is None:
            return e
        translated.__cause__ = e
        return translated
    transient = [
        lambda: bx.EndpointConnectionError(endpoint_url="http://x"),
        lambda: bx.ConnectionClosedError(endpoint_url="http://x"),
        lambda: bx.ReadTimeoutError(endpoint_url="http://x"),
        lambda: aiohttp.ServerDisconnectedError(),
        lambda: client_error("SlowDown", 503, OSError(errno.EBUSY, "slow down")),
        lambda: client_error("RequestTimeout", 400, OSError(errno.EIO, "timeout")),  # S3's code, a 4xx
        lambda: client_error("ConditionalRequestConflict", 409),
        *GENERIC_TRANSIENT,
    ]
    permanent = [
        lambda: bx.NoCredentialsError(),
        lambda: client_error("PreconditionFailed", 412, OSError(errno.EINVAL, "precondition")),
        lambda: client_error("AccessDenied", 403, PermissionError("denied")),
        lambda: client_error("InvalidArgument", 400, OSError(errno.EINVAL, "bad")),
        *GENERIC_PERMANENT,
    ]
    return transient, permanent


def _ceph_required() -> bool:
    return os.environ.get("SHARDCKPT_REQUIRE_CEPH", "").strip().lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="module", params=["moto", "ceph"])
def s3_server(request: pytest.FixtureRequest) -> Iterator[Any]:
    from testing.s3servers import CephServer, MotoServer

    if request.param == "ceph" and CephServer.missing_binaries():
        reason = f"Ceph binaries not installed ({', '.join(CephServer.missing_binaries())})"
        if _ceph_required():
            pytest.fail(f"{reason}, and SHARDCKPT_REQUIRE_CEPH is set", pytrace=False)
        pytest.skip(reason)
    server = (MotoServer() if request.param == "moto" else CephServer()).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.s3
class TestS3(Contract):
    @pytest.fixture
    def site(self, s3_server: Any) -> Iterator[Storage]:
        bucket = s3_server.create_bucket()
        try:
            yield Storage(f"s3://{bucket}/site", s3_server.storage_options())
        finally:
            s3_server.delete_bucket(bucket)

    @pytest.fixture(autouse=True)
    def _samples(self, request: pytest.FixtureRequest) -> None:
        self.transient, self.permanent = _s3_samples()  # type: ignore[misc]
        self.options = {"anon": False, "retries": 2, "profile": None}  # type: ignore[misc]

    def test_a_replace_between_the_check_and_the_put_is_refused(
            self, site: Storage, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
        """The PUT carries ``If-Match`` with the ETag the check saw: the server refuses it once
        another writer has replaced the object, whichever spelling of the tag it wants."""
        site.put("m.json", b"version 1")
        site.replace_if("m.json", b"version 2", b"version 1")  # learns the spelling
        assert "refused If-Match" not in caplog.text  # a conditional PUT, not the fallback
        backend: Any = site.backend
        real = backend._etag_if_holds

        def raced(*args: Any) -> Any:
            etag = real(*args)
            site.put("m.json", b"version 2, rewritten")  # another writer, after the check
            return etag
        monkeypatch.setattr(backend, "_etag_if_holds", raced)
        with pytest.raises(CommitConflictError, match="nothing was replaced"):
            site.replace_if("m.json", b"version 3", b"version 2")
        assert site.read("m.json") == b"version 2, rewritten"

    def test_overwrite_replaces_a_checkpoint_through_if_match(
            self, site: Storage, caplog: pytest.LogCaptureFixture) -> None:
        """``reshard --overwrite`` on S3: the manifest is replaced by the conditional PUT."""
        from shardckpt.checkpoint.reader import read_manifest
        from shardckpt.tools.reshard import reshard
        from shardckpt.tools.synth import synthesize

        opts = site.storage_options
        synthesize(site.url_of("src"), 3000, 2, storage_options=opts)
        first = reshard(site.url_of("src"), site.url_of("dst"), to=2, storage_options=opts)
        again = reshard(site.url_of("src"), site.url_of("dst"), to=1, overwrite=True,
                        storage_options=opts)
        now = read_manifest(site.child("dst"))
        assert now.save_id == again.manifest.save_id != first.manifest.save_id
        assert "refused If-Match" not in caplog.text

    def test_the_local_vocabulary_is_not_s3s(self, site: Storage, tmp_path: Path) -> None:
        """An S3 error code is S3's to judge: another backend does not retry it."""
        slow = self.transient[5]()
        assert site.backend.classify(slow) == "retry"
        assert Storage(str(tmp_path)).backend.classify(slow) == "permanent"


# ---------------------------------------------------------------------------- the table


class ToyBackend(Backend):
    """A backend for ``toy://`` kept in a private in-memory filesystem, and judging a
    ``LookupError`` transient (no real store would)."""

    schemes: ClassVar[tuple[str, ...]] = ("toy",)

    @classmethod
    def known_options(cls) -> Collection[str]:
        return {"colour"}

    @classmethod
    def open(cls, url: str, options: BackendOptions) -> tuple[Backend, str]:
        from fsspec.implementations.memory import MemoryFileSystem

        fs = MemoryFileSystem(skip_instance_cache=True)
        return cls(fs, options.retry, options.tuning), "/toy/" + url.split("://", 1)[1]

    @classmethod
    def fresh_listings(cls, raw: Any) -> dict[str, Any]:
        return {"colour": "fresh", **raw}

    def classify(self, error: BaseException) -> Any:
        return "retry" if isinstance(error, LookupError) else super().classify(error)


def test_a_backend_registered_in_the_table_serves_its_scheme(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(BACKENDS, "toy", ToyBackend)
    st = Storage("toy://box/run", {"colour": "red"})
    assert type(st.backend) is ToyBackend and st.root == "/toy/box/run"
    st.create_only("manifest.json", b"one")
    with pytest.raises(CommitConflictError):
        st.create_only("manifest.json", b"two")
    st.replace_if("manifest.json", b"two", b"one")
    assert st.read("manifest.json") == b"two" and st.ls() == ["manifest.json"]
    with pytest.raises(ConfigError, match="storage option color: not known for toy://"):
        Storage("toy://box", {"color": "red"})
    tries: list[int] = []

    def flaky() -> int:  # retried because this backend says so
        tries.append(1)
        if len(tries) < 2:
            raise KeyError("later")
        return len(tries)
    assert st.call("probe", "x", flaky) == 2
    # an entry may name its class as "module:Class", imported when first used
    monkeypatch.setitem(BACKENDS, "toy2", f"{ToyBackend.__module__}:ToyBackend")
    assert backend_class("toy2://x") is ToyBackend
    assert type(Storage("toy2://y").backend) is ToyBackend


def test_schemes_outside_the_table_get_the_generic_backend(tmp_path: Path) -> None:
    from testing.fsspec_probes import register

    register()  # countfile://: the local disk, through fsspec, under another name
    st = Storage(f"countfile://{tmp_path}")
    assert type(st.backend) is Backend
    assert backend_class("a::b://c") is Backend  # chained URLs too
    st.create_only("m.json", b"1")
    st.replace_if("m.json", b"2", b"1")
    assert st.read("m.json") == b"2"
    with pytest.raises(CommitConflictError):
        st.replace_if("m.json", b"3", b"1")


def test_the_watcher_asks_the_backend_for_fresh_listings(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardckpt.watch.service import _fresh_listings

    assert _fresh_listings("s3://b/run", {"key": "k"}) == {"use_listings_cache": False, "key": "k"}
    assert _fresh_listings("s3a://b/run", {"use_listings_cache": True}) == {"use_listings_cache": True}
    assert _fresh_listings("/tmp/run", {}) == {} and _fresh_listings("memory://run", {}) == {}
    monkeypatch.setitem(BACKENDS, "toy", ToyBackend)
    assert _fresh_listings("toy://run", {"a": 1}) == {"colour": "fresh", "a": 1}
