"""The write attempt (shardckpt.checkpoint.attempt): its call order, the lease held while it
writes, the discard on every failure before the commit, and the loss flag a job's agreements
watch (shardckpt.checkpoint.loss_flag). One process; the same attempt over several processes runs
in the reshard, import and training-save integration tests."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from shardckpt.checkpoint.attempt import Attempt, ForeignFiles, Steps
from shardckpt.checkpoint.collective import agree
from shardckpt.checkpoint.job import Job
from shardckpt.checkpoint.loss_flag import LossFlag, lost_contact
from shardckpt.checkpoint.writer import CheckpointSpec, CheckpointWriter
from shardckpt.errors import CollectiveError, ConfigError, IntegrityError
from shardckpt.format.chunked import ChunkedSection
from shardckpt.format.layout import Mesh
from shardckpt.format.manifest import MANIFEST_NAME
from shardckpt.storage import Storage
from shardckpt.storage.lease import LEASE_PREFIX


#: An empty checkpoint (chunked, no tensors): what the attempt writes matters less than when.
SPEC = CheckpointSpec(Mesh.for_world(1), {}, chunked=ChunkedSection({}, {}, {}))


def _attempt(storage: Storage, job: Job | None = None, **kw: Any) -> Attempt[CheckpointWriter]:
    return Attempt(job or Job.single(), storage.url, Steps.named("test"),
                   lambda save_id: CheckpointWriter(storage, SPEC, save_id), **kw)


def _blob(writer: CheckpointWriter) -> list[Any]:
    """A share: one small file in the attempt's directory (not named by the manifest)."""
    writer.storage.put(f"{writer.save_id}/part", b"bytes")
    return []


def test_steps_run_in_order_and_the_lease_is_held_until_the_outcome(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path / "ck"))
    order: list[str] = []

    def share(w: CheckpointWriter) -> str:
        leases = [n for n in storage.ls(w.save_id) if n.startswith(LEASE_PREFIX)]
        order.append(f"share (leases {len(leases)})")
        return "mine"

    def verify(w: CheckpointWriter, reports: list[Any]) -> None:
        order.append(f"verify {reports}")

    def commit(w: CheckpointWriter, reports: list[Any]) -> Any:
        order.append("commit")
        return w.commit([])

    attempt = _attempt(storage, guard=lambda: order.append("guard") or "guarded",
                       room=lambda w: order.append("room"), verify_before_commit=verify)
    m = attempt.run(share, commit)
    assert order == ["guard", "room", "share (leases 1)", "verify ['mine']", "commit"]
    assert m is not None and attempt.committed is m and attempt.guarded == "guarded"
    assert storage.exists(MANIFEST_NAME)
    assert not [n for n in storage.ls(m.save_id) if n.startswith(LEASE_PREFIX)]  # released


def test_a_given_save_id_is_the_attempts(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path / "ck"))
    attempt = _attempt(storage, save_id="20260101T000000Z-0000abcd")
    m = attempt.run(lambda w: None, lambda w, _: w.commit([]))
    assert m is not None and m.save_id == "20260101T000000Z-0000abcd"


@pytest.mark.parametrize("where", ["share", "verify", "commit"])
def test_a_failure_before_the_commit_discards_the_attempt(tmp_path: Path, where: str) -> None:
    storage = Storage(str(tmp_path / "ck"))

    def fail(step: str) -> None:
        if step == where:
            raise IntegrityError(f"broken in {step}")

    def share(w: CheckpointWriter) -> list[Any]:
        _blob(w)
        fail("share")
        return []

    def commit(w: CheckpointWriter, _: list[Any]) -> Any:
        fail("commit")
        return w.commit([])

    attempt = _attempt(storage, verify_before_commit=lambda w, r: fail("verify"))
    with pytest.raises(IntegrityError, match=f"broken in {where}"):
        attempt.run(share, commit)
    assert attempt.writer is not None and attempt.committed is None
    assert not storage.exists(attempt.writer.save_id)  # discarded, lease and all
    assert not storage.exists(MANIFEST_NAME)


def test_a_guard_that_refuses_writes_nothing(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path / "ck"))
    opened: list[str | None] = []

    def guard() -> None:
        raise ConfigError("occupied")

    attempt = Attempt(Job.single(), storage.url, Steps.named("test"),
                      lambda sid: opened.append(sid) or CheckpointWriter(storage, SPEC, sid),
                      guard=guard)
    with pytest.raises(ConfigError, match="occupied"):
        attempt.run(_blob, lambda w, _: w.commit([]))
    assert opened == [] and not storage.exists("")


def test_a_discard_that_fails_says_how_to_clean(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = Storage(str(tmp_path / "ck"))
    monkeypatch.setattr(CheckpointWriter, "discard", lambda self: False)

    def share(w: CheckpointWriter) -> list[Any]:
        raise IntegrityError("broken")

    attempt = _attempt(storage)
    with pytest.raises(IntegrityError, match=r"broken; `shardckpt clean .*` removes the unfinished "):
        attempt.run(share, lambda w, _: w.commit([]))


def test_a_training_job_raises_the_exchange_error_and_keeps_the_files(tmp_path: Path) -> None:
    """Job.of_group (no process group: a job of one) agrees through the exchange, as the training
    save always has: one CollectiveError naming the rank; with discard off the files stay."""
    storage = Storage(str(tmp_path / "ck"))
    job = Job.of_group()
    assert (job.rank, job.world_size, job.collective) == (0, 1, True)

    def share(w: CheckpointWriter) -> list[Any]:
        _blob(w)
        raise IntegrityError("broken")

    attempt = _attempt(storage, job, discard=False, after_loss=lambda committing, writer: "unused")
    with pytest.raises(CollectiveError, match=r"test: writing the files failed on rank\(s\) \[0\]"):
        attempt.run(share, lambda w, _: w.commit([]))
    assert attempt.writer is not None and storage.exists(f"{attempt.writer.save_id}/part")


def test_guard_told_to_every_process(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path / "ck"))
    attempt = _attempt(storage, Job.of_group(), guard=lambda: {"previous": "step-1"}, tell_guard=True)
    attempt.open()
    assert attempt.guarded == {"previous": "step-1"}
    attempt.release()


def test_an_attempt_driven_step_by_step(tmp_path: Path) -> None:
    """What DCP's StorageWriter callbacks do: open, (shares elsewhere), commit, release."""
    storage = Storage(str(tmp_path / "ck"))
    attempt = _attempt(storage)
    w = attempt.open()
    assert [n for n in storage.ls(w.save_id) if n.startswith(LEASE_PREFIX)]
    m = attempt.commit(lambda w, reports: w.commit([]), [])
    attempt.release()
    assert m is not None and not [n for n in storage.ls(w.save_id) if n.startswith(LEASE_PREFIX)]


def test_foreign_files_are_removed_on_failure(tmp_path: Path) -> None:
    out = Storage(str(tmp_path / "export"))
    files = ForeignFiles(out)

    def share(f: ForeignFiles) -> None:
        f.create("a.pt", b"a")
        f.create("b.pt", b"b")
        raise OSError("disk full")

    attempt = Attempt(Job.single(), out.url, Steps.named("export"), lambda _: files)
    with pytest.raises(OSError, match="disk full"):
        attempt.run(share, lambda f, _: out.put("latest", b"tag"))
    assert files.written == ["a.pt", "b.pt"]
    assert not out.exists("a.pt") and not out.exists("b.pt") and not out.exists("latest")


# --------------------------------------------------------------------------- the loss flag


class _Store:
    """A rendezvous store's two calls a flag makes, in memory."""

    def __init__(self) -> None:
        self.keys: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.keys[key] = value.encode()

    def check(self, keys: list[str]) -> bool:
        return all(k in self.keys for k in keys)

    def get(self, key: str) -> bytes:
        return self.keys[key]


def test_a_raised_flag_abandons_a_blocked_agreement() -> None:
    store = _Store()
    flag = LossFlag(store, "shardckpt/lost/test", rank=1)
    stuck = threading.Event()
    LossFlag(store, flag.key, rank=0).raise_flag("RuntimeError: peer gone")
    with pytest.raises(CollectiveError, match=r"save: lost contact with another rank \(rank 0 lost "
                                              r"contact with a rank: RuntimeError: peer gone\); left"):
        agree(lambda: stuck.wait(), "save", flag=flag, after_loss=lambda: "left")
    stuck.set()  # the worker thread ends


def test_a_lost_contact_raises_the_flag_for_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    import shardckpt.checkpoint.collective as collective

    def gone(report: bytes, group: Any) -> list[bytes]:
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(collective, "_exchange", gone)
    store = _Store()
    flag = LossFlag(store, "shardckpt/lost/test", rank=0)
    with pytest.raises(CollectiveError) as e:
        agree(lambda: None, "save", flag=flag)
    assert lost_contact(e.value)
    assert "Connection closed by peer" in flag.seen()  # type: ignore[operator]
