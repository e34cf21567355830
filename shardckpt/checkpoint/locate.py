"""What a location given where a checkpoint is expected holds, said in one line.

:func:`locate_checkpoint` is :func:`~shardckpt.checkpoint.run_dir.resolve_checkpoint` (a
checkpoint, or a ``step-*`` run directory and its ``latest``) for every other thing a user of
another tool points a command at, from the names there (one LIST) and, for a file, its first bytes:

* a run directory of another layout shardckpt writes (the Trainer's ``checkpoint-N``,
  Lightning's ``*.ckpt`` folders, :mod:`shardckpt.checkpoint.run_names`): its committed
  checkpoints are listed, as for a ``step-*`` run without ``latest``;
* a DeepSpeed checkpoint folder or tag folder, a DCP folder, a Hugging Face model folder, a
  safetensors file or a ``torch.save`` file (a pickle): what it is and the exact ``shardckpt
  import`` command that turns it into a checkpoint (``DST`` and ``N`` for the user to fill);

each as one :class:`NotACheckpointError`. Anything else (nothing there, a damaged checkpoint)
comes back as it is, for the reader's own message. Reads no file but a file's first bytes; never
unpickles anything.
"""

from __future__ import annotations

import re
from typing import Any
from collections.abc import Mapping

from shardckpt.checkpoint.reader import as_storage
from shardckpt.checkpoint.run_dir import Resolved, resolve_checkpoint
from shardckpt.checkpoint.run_names import LIGHTNING, LIGHTNING_ANY, STEP, TRAINER, checkpoint_name
from shardckpt.errors import IncompleteCheckpointError, ShardckptError
from shardckpt.format.manifest import MANIFEST_NAME
from shardckpt.storage import Storage

#: DeepSpeed's per-rank files (``engine.save_checkpoint``), in a tag folder.
DEEPSPEED_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_[0-9]+_mp_rank_[0-9]+_optim_states\.pt\Z"
                            r"|^(?:zero_pp_rank_[0-9]+_)?mp_rank_[0-9]+_model_states\.pt\Z")
#: Hugging Face weights shardckpt imports, and the pickled ones it does not read.
HF_WEIGHTS = re.compile(r"^model(?:-[0-9]+-of-[0-9]+)?\.safetensors(?:\.index\.json)?\Z")
HF_PICKLES = re.compile(r"^pytorch_model(?:-[0-9]+-of-[0-9]+)?\.bin(?:\.index\.json)?\Z")
#: Shown when a listing of committed checkpoints is long: the first two and the last three.
LISTED = 6


class NotACheckpointError(ShardckptError):
    """A location that holds something else than a shardckpt checkpoint (a foreign format, a
    run directory); the message says what, and what to run."""


def locate_checkpoint(url: str, storage_options: Mapping[str, Any] | None = None) -> Resolved:
    """The checkpoint ``url`` names (:func:`resolve_checkpoint`), or one clear error saying what
    is there instead (see the module doc)."""
    try:
        resolved = resolve_checkpoint(url, storage_options)
    except IncompleteCheckpointError as e:  # a "run directory" that is DeepSpeed's (``latest``)
        what = _foreign_or_none(as_storage(url, storage_options), url)
        if what is not None:
            raise NotACheckpointError(what) from None
        raise e
    storage = resolved.storage
    if resolved.note is not None or storage.exists(MANIFEST_NAME):
        return resolved
    what = _foreign_or_none(storage, url)
    if what is not None:
        raise NotACheckpointError(what)
    return resolved


def _foreign_or_none(storage: Storage, shown: str) -> str | None:
    try:
        return describe_foreign(storage, shown)
    except (NotACheckpointError, IncompleteCheckpointError):
        raise
    except ShardckptError:  # unreadable: the reader says what is wrong
        return None


def describe_foreign(storage: Storage, shown: str) -> str | None:
    """One line on what ``storage`` (``shown`` as the user wrote it) holds and what to run, or
    None where it is nothing this module recognises."""
    names = storage.ls("")
    if not names:
        return _describe_file(storage, shown) if storage.exists("") and not storage.isdir("") else None
    run = _describe_run(storage, names, shown)
    if run is not None:
        return run
    if any(DEEPSPEED_FILE.match(n) for n in names):
        return (f"{shown} is a DeepSpeed checkpoint tag folder, not a shardckpt checkpoint; "
                f"import it: shardckpt import deepspeed {shown} DST --ranks N")
    if "latest" in names:
        tag = _deepspeed_tag(storage, names)
        if tag is not None:
            return (f"{shown} is a DeepSpeed checkpoint folder (latest: {tag}), not a shardckpt "
                    f"checkpoint; import it: shardckpt import deepspeed {shown} DST --ranks N")
    if ".metadata" in names and any(n.endswith(".distcp") for n in names):
        return (f"{shown} is a torch.distributed.checkpoint (DCP) folder, not a shardckpt "
                f"checkpoint; import it: shardckpt import dcp {shown} DST")
    if any(HF_WEIGHTS.match(n) for n in names):
        return (f"{shown} is a Hugging Face model folder (safetensors weights), not a shardckpt "
                f"checkpoint; import it: shardckpt import hf {shown} DST --ranks N")
    if any(HF_PICKLES.match(n) for n in names):
        return (f"{shown} is a Hugging Face model folder with pickled weights (pytorch_model.bin), "
                "which shardckpt never unpickles; save it with save_pretrained(path, "
                "safe_serialization=True), then: shardckpt import hf PATH DST --ranks N")
    return None


def _describe_run(storage: Storage, names: list[str], shown: str) -> str | None:
    """A Trainer or Lightning run directory: its committed checkpoints, listed."""
    if any(STEP.step_of(n) is not None for n in names):
        return None  # step-*: resolve_checkpoint's, with ``latest``
    found = {n: checkpoint_name(n) for n in names}
    layouts = {f[0] for f in found.values() if f is not None}
    ckpts = [n for n in names if found[n] is not None or LIGHTNING_ANY.match(n)]
    if not ckpts:
        return None
    if layouts == {TRAINER}:
        label = "Trainer run directory"
    elif layouts <= {LIGHTNING}:
        label = "run directory of Lightning checkpoints"
    else:
        label = "run directory"
    step = {n: f[1] if (f := found[n]) is not None else -1 for n in ckpts}
    committed = sorted((n for n in ckpts if storage.exists(f"{n}/{MANIFEST_NAME}")),
                       key=lambda n: (step[n], n))
    if not committed:
        raise IncompleteCheckpointError(
            f"{storage.url} is a {label} with no committed checkpoint: none of its {len(ckpts)} "
            f"checkpoint directories has a {MANIFEST_NAME} (the saves never committed)")
    listed = ", ".join(committed) if len(committed) <= LISTED else \
        f"{', '.join(committed[:2])}, ..., {', '.join(committed[-3:])} ({len(committed)} in all)"
    newest = max(committed, key=lambda n: (step[n], n))
    return (f"{shown} is a {label}, not a checkpoint; its committed checkpoints: {listed}. "
            f"Name one, e.g. {storage.url_of(newest)}")


def _deepspeed_tag(storage: Storage, names: list[str]) -> str | None:
    try:
        tag = storage.read_limited("latest", 4096).decode("utf-8", "replace").strip()
    except ShardckptError:
        return None
    if not tag.isprintable() or "/" in tag or tag not in names:
        return None
    return tag if any(DEEPSPEED_FILE.match(n) for n in storage.ls(tag)) else None


def _describe_file(storage: Storage, shown: str) -> str | None:
    """A file: a ``torch.save`` file (a zip archive or a bare pickle) or safetensors."""
    head = storage.read_prefix("", 16)
    if shown.endswith(".safetensors"):
        return (f"{shown} is a safetensors file, not a shardckpt checkpoint; import it: "
                f"shardckpt import hf {shown} DST --ranks N")
    if head.startswith(b"PK\x03\x04") or (len(head) > 1 and head[0] == 0x80 and head[1] <= 5):
        return (f"{shown} is a torch.save file (a pickle), not a shardckpt checkpoint, and "
                "shardckpt never unpickles it; a DeepSpeed file is imported with its folder "
                "(shardckpt import deepspeed FOLDER DST --ranks N); a state dict, saved as "
                "safetensors (safetensors.torch.save_file(torch.load(PATH, weights_only=True), "
                "'model.safetensors')), with: shardckpt import hf model.safetensors DST --ranks N")
    return None
