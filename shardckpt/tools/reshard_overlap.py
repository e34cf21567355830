"""Target files written a few at once: the next file streams while one completes.

A file's write ends with its completion: an S3 multipart upload waits for its last parts and
for CompleteMultipartUpload, a local file for its fsync. Written one after the other, every
completion pauses the stream of source reads. :func:`write_overlapped` runs the writes of up to
:data:`FILES_IN_FLIGHT` files on as many threads, started in file order; the producers take the
stream's batches in file order (:class:`~shardckpt.tools.reshard_stream.ShardStream`), so the
file after one that is completing streams meanwhile. Memory grows by the parts of the files
completing (an upload holds at most ``concurrency`` parts), not by batches: the read-ahead is
the same one stream.

Failure: the first write that fails stops the other producers (:meth:`Stoppable.fail`: a
producer that waits for its turn, or takes its next batch, raises); a write that stops aborts
its own file (the writer's context: the multipart upload aborted, the partial file removed);
the threads are joined, then the first error is raised. Nothing is committed here: the commit
(the manifest, create-only) comes after every file, in the caller, and only if all succeed.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, TypeVar
from collections.abc import Callable, Sequence

T = TypeVar("T")

#: Target files written at once: one streaming, one completing (two: the completion of one file
#: overlaps the next file's stream; more would only hold more upload parts).
FILES_IN_FLIGHT = 2


class Stoppable(Protocol):
    """The stream the files' producers share: :meth:`fail` stops them; :attr:`failed` is the
    first error given to it."""

    failed: BaseException | None

    def fail(self, error: BaseException) -> None: ...


def write_overlapped(stream: Stoppable, files: Sequence[int], write: Callable[[int], T],
                     depth: int = FILES_IN_FLIGHT) -> tuple[T, ...]:
    """``write(file)`` for each of ``files``, up to ``depth`` at once, started in order (module
    doc); their results in the order of ``files``. One failure: every write ends (stopped or
    complete), then the first error is raised."""
    if depth <= 1 or len(files) <= 1:
        return tuple(write(t) for t in files)

    def one(t: int) -> T:
        try:
            return write(t)
        except BaseException as e:
            stream.fail(e)  # the other producers stop at their next batch
            raise

    pool = ThreadPoolExecutor(min(depth, len(files)), thread_name_prefix="shardckpt-file")
    futures = [pool.submit(one, t) for t in files]
    try:
        return tuple(f.result() for f in futures)
    except BaseException as e:  # noqa: BLE001 - re-raised below, the first error first
        stream.fail(e)  # an interrupt of this thread stops the writes too
        pool.shutdown(wait=True, cancel_futures=True)  # every write aborted or complete
        raise stream.failed if stream.failed is not None else e  # noqa: B904 - the first error as it was
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
