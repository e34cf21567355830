"""What a Trainer resume takes from a checkpoint whose author is not trusted.

* :func:`read_trainer_record`: ``extras["app"]["trainer"]``, each field checked.
* :func:`restored_trainer_state`: the ``trainer_state.json`` text Trainer reads on resume, without
  ``best_model_checkpoint``. Trainer deletes with ``shutil.rmtree`` what that path decides: at the
  end of ``train()`` with ``save_total_limit=1`` every ``checkpoint-*`` of the run that is not
  it, the newest included. shardckpt's own retention keeps the newest and the limit, so the live
  state never holds that path (saves still record the best committed checkpoint's URL); one that
  is not a committed checkpoint of the run is named in a warning.
* :func:`rng_lengths`: the length of each rank's RNG document, from the checkpoint's stored
  tensors and files (what a resume allocates), checked against ``rng_bytes``.
"""

from __future__ import annotations

import json
import logging
from typing import Any
from collections.abc import Mapping

from shardckpt.checkpoint.reader import as_storage, read_manifest
from shardckpt.checkpoint.run_dir import CheckpointManager
from shardckpt.errors import ManifestError, ShardckptError
from shardckpt.format.manifest import MANIFEST_NAME
from shardckpt.format.records import run_extras

log = logging.getLogger(__name__)

__all__ = ["APP_VERSION", "read_trainer_record", "restored_trainer_state", "rng_lengths", "rng_name"]

#: Version of ``extras["app"]["trainer"]``; a reader refuses a newer one.
APP_VERSION = 1


def rng_name(rank: int) -> str:
    """The DCP name of rank ``rank``'s RNG document."""
    return f"rng.rank-{rank:05d}"


def read_trainer_record(url: str, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``extras["app"]["trainer"]`` of the checkpoint at ``url``, checked."""
    storage = as_storage(url, storage_options)
    m = read_manifest(storage)
    where = storage.url_of(MANIFEST_NAME)
    app = (run_extras(m, where).app or {}).get("trainer")
    if not isinstance(app, dict):
        raise ManifestError(f"{where}: extras.app.trainer is missing; this checkpoint was not "
                            "written by a Trainer through shardckpt")
    version = app.get("version")
    if not isinstance(version, int) or version > APP_VERSION:
        raise ManifestError(f"{where}: extras.app.trainer.version is {version!r}; this shardckpt "
                            f"reads up to {APP_VERSION}")
    problems = []
    if not isinstance(app.get("trainer_state"), str):
        problems.append("trainer_state is not a string")
    if not isinstance(app.get("world_size"), int) or app["world_size"] < 1:
        problems.append("world_size is not a positive integer")
    lengths = app.get("rng_bytes")
    if not (isinstance(lengths, list) and all(isinstance(n, int) and n >= 0 for n in lengths)
            and len(lengths) == app.get("world_size")):
        problems.append("rng_bytes is not one length per rank")
    if not isinstance(app.get("model_only"), bool):
        problems.append("model_only is not a boolean")
    if problems:
        raise ManifestError(f"{where}: extras.app.trainer: {'; '.join(problems)}")
    return app


def restored_trainer_state(text: str, run: CheckpointManager, source: str) -> str:
    """``text`` (the stored ``trainer_state.json``) as Trainer may read it: an object, with
    ``best_model_checkpoint`` null (module doc). One that is not a committed checkpoint of ``run``
    (outside it, ``..``, a URL elsewhere) is named in a warning."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ManifestError(f"{source}: extras.app.trainer.trainer_state is not JSON "
                            f"Trainer can read: {e}") from None
    if not isinstance(doc, dict):
        raise ManifestError(f"{source}: extras.app.trainer.trainer_state is not a JSON object")
    best = doc.get("best_model_checkpoint")
    if best is not None:
        ours = {f.url for f in run.committed()}
        if isinstance(best, str) and best in ours:
            log.info("%s: best_model_checkpoint %s is not handed to Trainer (shardckpt's retention "
                      "keeps the checkpoints)", source, best)
        else:
            log.warning("%s: best_model_checkpoint %r dropped: it is not a committed checkpoint of "
                        "the run %s, and a path read from a checkpoint is never deleted or kept "
                        "in place of the run's own", source, best, run.url)
        doc["best_model_checkpoint"] = None
    return json.dumps(doc)


def rng_lengths(url: str, storage_options: Mapping[str, Any] | None, recorded: list[int]) -> list[int]:
    """Each rank's RNG document length, as stored: a 1-D uint8 tensor of one chunk whose bytes
    lie inside its file's real size. :class:`ManifestError` names the file or the entry where a
    tensor is not so, or where ``recorded`` (``rng_bytes``) says another length. Every rank
    checks every rank's entry: they reach the same verdict without a collective."""
    storage = as_storage(url, storage_options)
    m = read_manifest(storage)
    where = storage.url_of(MANIFEST_NAME)
    tensors = m.chunked.tensors if m.chunked is not None else {}
    sizes = {f.path: f.size for f in m.files}
    out = []
    for rank, claimed in enumerate(recorded):
        t = tensors.get(rng_name(rank))
        if t is None or t.dtype != "uint8" or len(t.shape) != 1 or len(t.chunks) != 1:
            raise ManifestError(f"{where}: {rng_name(rank)} is not one stored 1-D uint8 tensor "
                                "(a Trainer checkpoint holds each rank's RNG document so)")
        (c,) = t.chunks
        n = t.shape[0]
        try:
            real = storage.size(c.file)
        except ShardckptError as e:
            raise ManifestError(f"{where}: {rng_name(rank)}'s file {c.file}: {e}") from e
        if c.end - c.begin != n or c.end > real or sizes.get(c.file) != real:
            raise ManifestError(
                f"{storage.url_of(c.file)}: {real} bytes (the manifest records {sizes.get(c.file)}); "
                f"{rng_name(rank)} of {n} bytes at [{c.begin}, {c.end}) does not lie in it")
        if claimed != n:
            raise ManifestError(
                f"{where}: extras.app.trainer.rng_bytes[{rank}] is {claimed}, but {rng_name(rank)} "
                f"stored in {c.file} holds {n} bytes; the manifest does not describe its files, "
                "nothing was allocated or loaded")
        out.append(n)
    return out
