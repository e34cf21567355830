"""A pipeline step run as a torchrun job (``processes = K`` on a verify, reshard or consolidate step).

The watcher runs the offline tool's torchrun form::

    python -m shardckpt.watch.launcher --standalone --nproc_per_node K -m shardckpt reshard SRC DST \\
        --to M --replicate R --overwrite --json [-o KEY=JSON ...]

(:mod:`shardckpt.watch.launcher` is torchrun with its store listening on ``localhost`` only;
``--standalone``: a c10d rendezvous on ``localhost`` whose free port the launcher takes itself,
so two jobs started at once never race for one) and waits for it, under the step's claim and lease,
which the watcher's lease thread keeps renewing meanwhile. The job's processes split the work and
its rank 0 commits the output (the manifest, or the index, written last), as
``torchrun ... -m shardckpt`` does by hand. The step's ``.done`` record is written only after the
job exited 0 *and* the output it reported is found committed: for reshard, a manifest whose save
id is the one the job printed and whose mesh is the one asked for; for consolidate, an index whose
files are all there and whose provenance names the source's save id and the dtype. A job that
exits 0 without such an output is a failed try. A non-zero exit is a failed try whose reason is
the job's own one-line error (the first ``error:`` line its processes printed); the try is
retried or dead-lettered as any other.

Every line the job writes on stderr goes to the watcher's log, prefixed with the checkpoint and
the step (``step-00000100 2-reshard: ...``): progress at INFO, what explains a failure (error
lines, tracebacks, torchrun's failure report) at DEBUG, so that a failed try's one-line reason
comes first (:func:`_log_lines`); stdout carries the tool's JSON summary.

What a kill does:

* the job killed (a process of it, or the launcher): torchrun ends the other processes; nothing
  is committed, since rank 0 commits only once every process has reported its files written.
  The try fails; the next try (or the next watcher) finds no output to adopt and runs again
  with ``--overwrite``, which removes the killed attempt's directory when it commits;
* the watcher killed: the job dies with it. The job is started through a few lines of Python
  that ask the kernel (Linux ``PR_SET_PDEATHSIG``) to send it SIGTERM when the watcher's thread
  that started it ends, then exec torchrun, which answers SIGTERM by terminating its processes.
  The watcher's lease ends with the watcher, and the next watcher adopts an output that
  committed before the kill or redoes the step. Were the job to outlive the watcher (a platform
  without ``PR_SET_PDEATHSIG``, the launcher SIGKILLed alone), the outputs' own create-only
  commits still keep one result: of two reshards overwriting one destination, one commits and
  the other fails and removes its files;
* a graceful stop (SIGTERM or SIGINT to the watcher): the job runs on and is recorded, as a
  step run in the watcher's own process does. The job runs in its own session, so a Ctrl-C at
  the terminal reaches the watcher alone; a second signal makes the watcher terminate the
  running jobs (:func:`terminate_all`) and exit at once, leaving the step to the next watcher.

Does not import torch: the job's processes do.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from typing import IO, Any

from shardckpt.checkpoint.reader import read_manifest
from shardckpt.errors import ShardckptError
from shardckpt.tools.distributed import LAUNCH_VARIABLES, OPT_OUT_VARIABLE
from shardckpt.watch.records import printable
from shardckpt.watch.steps import StepContext, StepFailed, committed_consolidation

log = logging.getLogger(__name__)

#: Seconds a job is given to end after SIGTERM (torchrun itself waits up to 30 s for its
#: processes) before its process group is killed.
TERMINATE_GRACE_S = 60.0

#: Run by ``python -c`` in the job's first process, then replaced by torchrun (``execv`` keeps
#: the parent-death signal): SIGTERM when the watcher's thread that started it ends, and no start
#: at all where the watcher is gone already. Linux only; elsewhere the job is started plainly.
_SHIM = """\
import os, signal, sys
if sys.platform.startswith("linux"):
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    sys.exit(128 + int(signal.SIGTERM))
os.execv(sys.argv[2], sys.argv[2:])
"""

_running: set[subprocess.Popen[bytes]] = set()
_running_lock = threading.Lock()


def job_argv(ctx: StepContext, python: str = sys.executable) -> list[str]:
    """The torchrun command line of ``ctx``'s step (storage options as ``-o KEY=JSON``)."""
    spec = ctx.spec
    argv = [python, "-m", "shardckpt.watch.launcher", "--standalone", "--nproc_per_node",
            str(spec.processes), "-m", "shardckpt", spec.kind, ctx.src.url]
    if spec.kind == "reshard":
        argv += [ctx.dst or "", "--to", str(spec.to), "--replicate", str(spec.replicate),
                 "--overwrite", "--json"] + (["--sign-key", ctx.signing_key] if ctx.signing_key else [])
        if spec.from_ is not None:
            argv += ["--from", str(spec.from_)]
    elif spec.kind == "consolidate":
        from shardckpt.tools.consolidate_plan import DEFAULT_MAX_SHARD_SIZE

        argv += [ctx.dst or "", "--dtype", spec.dtype, "--max-shard-size",
                 str(spec.max_shard_size or DEFAULT_MAX_SHARD_SIZE), "--overwrite", "--json"]
        if spec.copy_from is not None:
            argv += ["--copy-from", spec.copy_from]
        if spec.keep_buffers:
            argv.append("--keep-buffers")
    elif spec.kind != "verify":
        raise ValueError(f"a {spec.kind} step does not run as a job")
    for key, value in ctx.storage_options.items():
        argv += ["--storage-option", f"{key}={json.dumps(value)}"]
    return argv


def job_environment() -> dict[str, str]:
    """The watcher's environment less what would make the job's processes something else: the
    launcher variables of a job the watcher itself runs in, and ``SHARDCKPT_DIST=0`` (which would
    make each of the K processes do the whole work alone)."""
    drop = set(LAUNCH_VARIABLES) | {OPT_OUT_VARIABLE, "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                    "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_RUN_ID"}
    return {k: v for k, v in os.environ.items() if k not in drop}


def run_job(ctx: StepContext) -> dict[str, Any]:
    """Run ``ctx``'s step as a torchrun job of ``ctx.spec.processes`` processes and return its
    ``.done`` facts once its output is found committed; :class:`StepFailed` otherwise."""
    spec = ctx.spec
    where = f"{ctx.checkpoint} {spec.key}"
    argv = job_argv(ctx)
    shown = argv[:argv.index("--storage-option")] if "--storage-option" in argv else argv
    log.info("%s: a job of %d processes: %s", where, spec.processes,
             printable(" ".join(shlex.quote(a) for a in shown)))  # storage options may hold secrets
    code, out, errors = _run(argv, where)
    if code != 0:
        raise StepFailed(_failure(code, errors, spec.processes))
    if spec.kind == "verify":
        return {"bytes": sum(f.size for f in ctx.manifest.files), "identity": ctx.manifest.save_id}
    summary = _summary(out)
    if spec.kind == "reshard":
        return _resharded(ctx, summary)
    facts = committed_consolidation(ctx, ctx.dst_storage())
    if facts is None:
        raise StepFailed(f"{ctx.dst}: the job exited 0, but no consolidation of save "
                         f"{ctx.manifest.save_id} ({spec.dtype}) is committed there")
    return {**facts, "output": ctx.dst, "bytes": _count(summary.get("bytes_written"), facts["bytes"])}


def terminate_all() -> None:
    """SIGTERM the process group of every job running now (a watcher exiting at once: torchrun
    ends its processes on SIGTERM); does not wait."""
    with _running_lock:
        procs = list(_running)
    for proc in procs:
        _signal_group(proc, signal.SIGTERM)


# ------------------------------------------------------------------------------ helpers


def _run(argv: list[str], where: str) -> tuple[int, str, list[str]]:
    """Start the job (through the shim, in a session of its own), log its stderr line by line,
    and wait: (exit status, stdout, its ``error:`` lines). Left by an exception (the watcher
    interrupted), the job is terminated first."""
    proc = subprocess.Popen([sys.executable, "-c", _SHIM, str(os.getpid()), *argv],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=job_environment(), start_new_session=True)
    with _running_lock:
        _running.add(proc)
    errors: list[str] = []
    assert proc.stdout is not None and proc.stderr is not None
    pump = threading.Thread(target=_log_lines, args=(proc.stderr, where, errors),
                            name="shardckpt-watch-job-stderr", daemon=True)
    pump.start()
    try:
        out = proc.stdout.read().decode("utf-8", "replace")
        code = proc.wait()
        pump.join()
    finally:
        if proc.poll() is None:
            _stop(proc)
        with _running_lock:
            _running.discard(proc)
        proc.stdout.close()
    return code, out, errors


#: A line of a process's stderr as torchrun relays it: ``[rank3]: Traceback ...``.
_RANK_PREFIX = re.compile(r"^\[(?:default)?rank[0-9]+\]:\s?")
#: A torch / torchrun log line at error or warning level (``E1204 12:00:00.123 4567 file.py:89]``).
_TORCH_LOG = re.compile(r"^[EWF][0-9]{4} [0-9:.]+ ")


def _log_lines(stream: IO[bytes], where: str, errors: list[str]) -> None:
    """Log each line of the job's stderr; keep its processes' ``error:`` lines, or where none
    printed one (killed first), the root cause torchrun reports (``rank 0 ... exitcode -9``).

    What only explains a failure goes to DEBUG: the ``error:`` lines (the failed try's warning
    says the first, as its one-line reason), Python tracebacks, and torchrun's failure report
    (its error log lines, its ``ChildFailedError`` traceback and root-cause block); so a failed
    job's first line in the log at INFO and above is its reason, and ``shardckpt watch
    --verbose`` shows the rest. Other lines (progress) are logged at INFO as they come."""
    cause: list[str] = []
    in_traceback = report = False
    for raw in stream:
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if not line.strip():
            continue
        bare = _RANK_PREFIX.sub("", line)
        if bare.startswith("Traceback (most recent call last)"):
            in_traceback = explains = True
        elif in_traceback and bare[:1] not in (" ", "\t"):  # the exception's own line ends it
            in_traceback = False
            report = report or "ChildFailedError" in bare  # torchrun's report follows
            explains = True
        else:
            explains = in_traceback or report or bare.startswith(("error: ", "Root Cause")) or \
                _TORCH_LOG.match(bare) is not None
        log.log(logging.DEBUG if explains else logging.INFO, "%s: %s", where,
                printable(line))
        if line.startswith("error: "):
            errors.append(line[len("error: "):].strip())
        elif line.startswith("Root Cause") or cause:
            cause.append(line.strip())
    stream.close()
    if not errors:
        root = _root_cause(cause)
        if root:
            errors.append(root)


def _root_cause(lines: list[str]) -> str | None:
    """torchrun's "Root Cause" block as one line: which rank failed and how."""
    rank = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("rank ")), None)
    code = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("exitcode ")), None)
    if rank is None or code is None:
        return None
    return f"rank {rank} of the job failed (exitcode {' '.join(code.split())})"


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(proc: subprocess.Popen[bytes]) -> None:
    _signal_group(proc, signal.SIGTERM)
    try:
        proc.wait(TERMINATE_GRACE_S)
    except subprocess.TimeoutExpired:
        _signal_group(proc, signal.SIGKILL)
        proc.wait()


def _failure(code: int, errors: list[str], processes: int) -> str:
    """The one-line reason of a failed job: its first error line (all its processes print the
    same one), how many other distinct ones there were, and how it exited."""
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
    distinct = list(dict.fromkeys(errors))
    if not distinct:
        return f"the torchrun job of {processes} processes failed ({how}) without an error line; see the log"
    more = f" (and {len(distinct) - 1} more)" if len(distinct) > 1 else ""
    return f"{distinct[0]}{more} (torchrun job of {processes} processes, {how})"


def _summary(out: str) -> dict[str, Any]:
    """The JSON summary rank 0 printed last on stdout ({} if there is none)."""
    lines = out.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].rstrip() == "{":
            try:
                doc = json.loads("\n".join(lines[i:]))
            except ValueError:
                return {}
            return doc if isinstance(doc, dict) else {}
    return {}


def _count(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else default


def _resharded(ctx: StepContext, summary: dict[str, Any]) -> dict[str, Any]:
    """The facts of the reshard the job committed: the manifest at DST must be the save the job
    reported (not one that replaced it meanwhile) with the mesh the step asks for."""
    dst = ctx.dst_storage()
    sid = summary.get("save_id")
    if not isinstance(sid, str):
        raise StepFailed(f"{dst.url}: the job exited 0 without reporting the save it committed")
    try:
        m = read_manifest(dst)
    except ShardckptError as e:
        raise StepFailed(f"{dst.url}: the job exited 0, but its output cannot be read: "
                         f"{printable(e, 500)}") from None
    if m.save_id != sid:
        raise StepFailed(f"{dst.url}: the committed save is {m.save_id}, not the job's "
                         f"{printable(sid, 80)} (replaced while the job ran)")
    if m.mesh.world_size != ctx.spec.to or m.mesh.replicate_degree != ctx.spec.replicate:
        raise StepFailed(f"{dst.url}: the job committed {m.mesh.describe()}, not the "
                         f"{ctx.spec.to} ranks (replicate {ctx.spec.replicate}) asked for")
    return {"output": ctx.dst, "identity": m.save_id,
            "bytes": _count(summary.get("bytes_written"), sum(f.size for f in m.files))}
