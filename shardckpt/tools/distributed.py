"""The offline tools as the processes of a ``torchrun`` job: which job this process is in.

``torchrun --nnodes ... --nproc_per_node ... -m shardckpt reshard SRC DST --to M`` runs the same
command in every process. :func:`job_from_environment` gives each its
:class:`~shardckpt.checkpoint.job.Job`, and the tool's one flow (the same a single process runs,
as a job of one) does the rest: each process takes a share of the output files, balanced by
bytes, reads only the ranges those files need and writes them; the processes agree on the
outcome through the process group (raw bytes over :mod:`shardckpt.checkpoint.collective`, no
pickling); rank 0 holds the attempt's lease and commits once every process has reported its
files written. Any failure fails every process with the same error and commits nothing; a
process that dies makes the others' next collective fail (at once where the connection drops,
else within the process group's timeout, ``SHARDCKPT_DIST_TIMEOUT_S`` seconds, 1800 by default).

The imports (``import hf|deepspeed|dcp ... --ranks N``) split their shard files the same way,
through :func:`shardckpt.interop.importing.write_import`, which takes a :class:`Job`.

torch is loaded (here and by :mod:`shardckpt.checkpoint.collective`) only when the launcher's variables say
this process is one of a job: a plain ``shardckpt reshard`` never loads it.
"""

from __future__ import annotations

import datetime
import os
from contextlib import contextmanager
from collections.abc import Iterator

from shardckpt.checkpoint.job import Job
from shardckpt.checkpoint.rendezvous import init_default_group
from shardckpt.errors import ConfigError

__all__ = ["Job", "job_from_environment", "launched"]

#: Set by torchrun (and by any launcher that uses its ``env://`` rendezvous) in every process.
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
TIMEOUT_VARIABLE = "SHARDCKPT_DIST_TIMEOUT_S"
#: ``SHARDCKPT_DIST=0`` runs a command alone even with torchrun's variables set: a command started
#: from inside a training job's worker inherits them and must not join that job's rendezvous.
OPT_OUT_VARIABLE = "SHARDCKPT_DIST"
DEFAULT_TIMEOUT_S = 1800.0


def launched() -> bool:
    """Whether this process was started by torchrun (its variables are all set) to run as a job
    (not opted out with ``SHARDCKPT_DIST=0``)."""
    if os.environ.get(OPT_OUT_VARIABLE, "").strip() == "0":
        return False
    return all(os.environ.get(k) for k in LAUNCH_VARIABLES)


def _timeout_s() -> float:
    text = os.environ.get(TIMEOUT_VARIABLE, "")
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ConfigError(f"{TIMEOUT_VARIABLE}={text!r}: expected a positive number of seconds")
    return value


@contextmanager
def job_from_environment() -> Iterator[Job | None]:
    """The job this process belongs to (its process group initialized, gloo, from the launcher's
    variables), or None where it was not launched by torchrun."""
    if not launched():
        yield None
        return
    timeout = _timeout_s()
    import torch.distributed as dist

    own = not dist.is_initialized()
    if own:
        env = os.environ
        init_default_group("gloo", env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["RANK"]),
                           int(env["WORLD_SIZE"]), datetime.timedelta(seconds=timeout))
    try:
        yield Job(dist.get_rank(), dist.get_world_size())
    finally:
        if own:
            dist.destroy_process_group()
