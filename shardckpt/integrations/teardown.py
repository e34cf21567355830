"""The process group gone before the interpreter is: what an integration's run leaves at exit.

A gloo process group still alive when Python shuts down is destroyed during interpreter
teardown. Its worker threads may then hold the last reference to a tensor of a recent collective
(``Trainer``'s ``store_flos`` all-gather, the object collectives of a DCP save), whose Python
object they must release under the GIL; with the interpreter half torn down that thread is
unwound through C++ and the process aborts ("terminate called without an active exception",
exit -6), now and then, after a run that succeeded. ``transformers``' ``Trainer.end()`` destroys
the group; most scripts end with ``train()``.

:func:`destroy_group_at_exit` registers, once per process, an ``atexit`` hook that destroys the
default group (and so every group) while the interpreter is whole: atexit hooks run before
teardown. A script that destroyed the group itself (``Trainer.end()``,
``destroy_process_group()``) finds it gone and the hook does nothing.
"""

from __future__ import annotations

import atexit
import logging

log = logging.getLogger(__name__)

__all__ = ["destroy_group_at_exit"]


def _destroy() -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.destroy_process_group()
        log.debug("destroyed the default process group before interpreter teardown")
    except Exception as e:  # noqa: BLE001 - at exit: say it, do not mask the exit status
        log.warning("could not destroy the process group at exit: %s", e)


def destroy_group_at_exit() -> None:
    """Destroy the default process group at interpreter exit, if it is still there then (one
    hook per process, however often it is called)."""
    atexit.unregister(_destroy)
    atexit.register(_destroy)
