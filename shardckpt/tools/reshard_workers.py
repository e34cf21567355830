"""``reshard --workers K``: one process's share of the target shards split over K spawned worker
processes.

A worker is another process: it opens the source and the destination again, from their URLs and
options, but takes the parsed source manifest and the target (its spec and plan) from its parent
(pickled by ``spawn``), so no worker reads or parses the source manifest. Each sends back the
entries of the files it wrote, as JSON; the parent fails if any worker fails.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from collections.abc import Mapping, Sequence

from shardckpt.checkpoint.reader import CheckpointReader
from shardckpt.checkpoint.writer import CheckpointWriter
from shardckpt.errors import StorageError
from shardckpt.format.manifest import Manifest
from shardckpt.storage import Storage
from shardckpt.tools.reshard_stream import Written
from shardckpt.tools.reshard_target import ReshardTarget

if TYPE_CHECKING:
    from multiprocessing.connection import Connection


@dataclass(frozen=True)
class WorkerTask:
    """What a worker process writes: target files ``shards`` of save ``save_id``."""

    src_url: str
    src_options: Mapping[str, Any]
    manifest: Manifest
    dst_url: str
    dst_options: Mapping[str, Any]
    target: ReshardTarget
    save_id: str
    shards: tuple[int, ...]
    buffer_bytes: int


def _worker(task: WorkerTask, conn: Connection) -> None:
    """Entry point of a worker process: write some target shards, send their entries as JSON."""
    try:
        reader = CheckpointReader(Storage(task.src_url, task.src_options), manifest=task.manifest)
        writer = task.target.writer(Storage(task.dst_url, task.dst_options), task.save_id)
        done = task.target.write(reader, writer, task.shards, task.buffer_bytes, None)
        conn.send(json.dumps({"ok": True, **done.to_doc()}))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises
        conn.send(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}))
    finally:
        conn.close()


def run_workers(reader: CheckpointReader, target: ReshardTarget, writer: CheckpointWriter,
                parts: Sequence[Sequence[int]], buffer_bytes: int) -> Written:
    """Write the target files of ``parts[w]`` of ``target`` in spawned process ``w``; fail if
    any fails."""
    import multiprocessing as mp  # only with --workers

    ctx = mp.get_context("spawn")
    procs = []
    src, dst = reader.storage, writer.storage
    for shards in parts:
        parent, child = ctx.Pipe(duplex=False)
        task = WorkerTask(src.url, dict(src.storage_options), reader.manifest, dst.url,
                          dict(dst.storage_options), target, writer.save_id,
                          tuple(shards), buffer_bytes)
        p = ctx.Process(target=_worker, args=(task, child), daemon=True)
        p.start()
        child.close()
        procs.append((p, parent))
    done: list[Written] = []
    errors: list[str] = []
    for w, (p, conn) in enumerate(procs):
        try:
            msg = json.loads(conn.recv())
        except EOFError:
            p.join(5)
            errors.append(f"worker {w} died (exit code {p.exitcode})")
            continue
        p.join(30)
        if not msg["ok"]:
            errors.append(f"worker {w}: {msg['error']}")
            continue
        done.append(Written.from_doc(msg))
    if errors:
        for p, _ in procs:
            if p.is_alive():
                p.kill()
                p.join(30)
        raise StorageError("reshard failed; nothing was committed: " + "; ".join(errors))
    return Written.join(done)
