"""Optimizer state and step off the accelerator: in host memory (``"cpu"``) or in files (``"nvme"``).

ZeRO-Offload (Ren et al., 2021) and ZeRO-Infinity (Rajbhandari et al., 2021) for the sharded
element-wise optimizers of :mod:`shardckpt.runtime.optim`. Per trained flat group the offload
store holds an fp32 master and every per-element state kind (``exp_avg``, ...); the step runs
on the host, group by group:

1. the group's reduced gradient comes to the host;
2. its master and state are at hand: in place (``"cpu"``), or read from their files, the next
   group's read already in flight (``"nvme"``: :mod:`~shardckpt.runtime.offload.windows`);
3. the optimizer's update runs on them, op for op as in the resident step, so every element
   gets the same bits, on several threads (:mod:`~shardckpt.runtime.offload.host_step`);
4. the updated master goes to the device shard the all-gathers read (``group.shard``: the
   master itself, or with a narrower compute dtype its cast on the host, the device then
   holding no fp32 copy: :mod:`shardckpt.runtime.offload.master`); with ``"nvme"`` the master
   and state are written back while the next group computes.

By default ``optimizer.step()`` pipelines 1, 3 and 4 (:mod:`~shardckpt.runtime.offload.pipeline`):
while group k steps, group k+1's gradient comes in and group k-1's weights go out.
``OffloadConfig(pipeline=False)`` keeps the old step for comparison: gradients copied in
backward to host buffers per model, on one worker thread, then the groups stepped in turn.

When the step runs (DeepSpeed's rule): by default in ``optimizer.step()``, after backward, so
that whatever needs every gradient first (the global norm of
:meth:`~shardckpt.runtime.engine.ZeroEngine.clip_grad_norm_`, an inf/nan check) sees them all
(unpipelined, clipping scales the host copies alike; a gradient changed otherwise after its
copy is copied again). ``offload_overlap_step=True`` (opt-in: at backward time the engine cannot
know whether the loop will clip) runs a group's step (1-4) on the worker right after its
reduction, while backward computes the remaining units; ``step()`` only waits for it. That
needs every synced backward's gradient to be final: accumulate micro-batches under
``no_sync()``, follow each synced backward by ``step()``, set hyper-parameters before backward,
and do not clip; ``clip_grad_norm_``, a second reduction of a group before ``step()`` and
hyper-parameters changed since backward are each one :class:`~shardckpt.errors.ConfigError`.
The bits are the same either way. A reduced gradient stays unchanged until the worker copied
it (:meth:`OffloadStore.drain` runs before the next backward, ``zero_grad`` and clipping).

Host memory: the state (12 bytes per element for AdamW; ``"nvme"``: three groups' of it, the one
computing, the one read ahead, the one written back) plus the ring (2 x the largest group x 6-8
bytes, pinned on CUDA); unpipelined, gradient copies (4 bytes per element) pinned with the state;
with ``offload_overlap_step`` one gradient buffer. A device master (compute in the master dtype)
stays authoritative between steps: whatever writes it (a checkpoint load,
``summon_full_params(writeback=True)``) marks the group changed (:meth:`FlatParamGroup.refresh`),
and the next step copies it into the store first. A master held in the store alone is written
there, and the device shard cast from it.
"""

from __future__ import annotations

import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any
from collections.abc import Callable, Mapping, Sequence

import torch

from shardckpt.errors import ConfigError, ShardckptError
from shardckpt.runtime.offload.config import OffloadConfig
from shardckpt.runtime.offload.files import (OffloadedShard, OffloadSnapshot, as_bytes,
                                             create_files, remove_files)
from shardckpt.runtime.offload.host_step import HostStepper
from shardckpt.runtime.offload.pipeline import StepPipeline, Windows
from shardckpt.runtime.offload.windows import file_windows, read_window, write_window

__all__ = ["OffloadStore", "UpdateFn"]

#: The update of one flat group: (master, grad, state kinds, the group's work items).
UpdateFn = Callable[[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], Any], None]


class OffloadStore:
    """The masters and optimizer state of this rank's trained flat groups, off the device.

    ``sizes``: group name -> shard numel; ``kinds``: the optimizer's per-element state kinds.
    One worker thread runs the host gradient copies, the early steps and the file I/O.
    """

    def __init__(self, config: OffloadConfig, sizes: Mapping[str, int], kinds: Sequence[str],
                 device: torch.device, rank: int = 0) -> None:
        self.config = config
        self.kinds = tuple(kinds)
        self.sizes = dict(sizes)
        self.pin = device.type == "cuda"
        self._pin_state = self.pin and not config.pipeline  # (else the pipeline's ring is)
        on = config.pipeline
        self._stepper = HostStepper(config.host_threads or torch.get_num_threads(),
                                    config.fused_adamw, self.kinds) if on else None
        self._pipeline = StepPipeline(device, self.pin) if on else None
        # the worker's copies: on CUDA on a stream of their own, not queued behind backward
        self._stream = torch.cuda.Stream(device) if self.pin else None
        self._grad: torch.Tensor | None = None
        self._grads: dict[str, torch.Tensor] = {}  # host copies of the reduced gradients
        self._copied: dict[str, tuple[weakref.ref, int]] = {}  # what they copied (and version)
        self._early: dict[str, Any] = {}  # groups stepped in this backward -> their work items
        self._tasks: list[Future[None]] = []
        self._host: dict[str, dict[str, torch.Tensor]] = {}
        self._files: dict[tuple[str, str], OffloadedShard] = {}
        self.run_dir: Path | None = None
        self._failed: str | None = None  # a step failed half-way: the state is inconsistent
        if config.mode == "cpu":
            self._host = {name: {k: torch.zeros(n, dtype=torch.float32,
                                                pin_memory=self._pin_state)
                                 for k in ("master", *self.kinds)}
                          for name, n in self.sizes.items()}
        else:
            assert config.directory is not None
            self.run_dir, self._files = create_files(config.directory, self.sizes,
                                                     ("master", *self.kinds), rank)
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            1, thread_name_prefix="shardckpt-offload")
        self._finalizer = weakref.finalize(self, remove_files, self.run_dir,
                                           [s.fd for s in self._files.values()])

    @property
    def state_bytes(self) -> int:
        """Bytes of masters and state this store holds (host memory or disk)."""
        return sum(self.sizes.values()) * 4 * (1 + len(self.kinds))

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host bytes held now, their peak (0 without CUDA): ring or buffers."""
        held = [*self._grads.values(), *([] if self._grad is None else [self._grad]),
                *(t for k in self._host.values() for t in k.values() if self._pin_state)]
        ring = self._pipeline.buffer_bytes if self._pipeline is not None else 0
        return (ring + sum(t.numel() * t.element_size() for t in held)) if self.pin else 0

    # ----------------------------------------------------------------- checkpoint access

    def local_state(self, name: str) -> dict[str, Any]:
        """State kind -> the live host tensor (``"cpu"``) or :class:`OffloadedShard`; waits for
        the worker first (an early step may still be writing them)."""
        self._check_usable()
        self.drain()
        if name not in self.sizes:
            return {}
        if self._host:
            return {k: self._host[name][k] for k in self.kinds}
        return {k: self._files[name, k] for k in self.kinds}

    def snapshot(self) -> OffloadSnapshot | None:
        """An empty :class:`OffloadSnapshot` directory in the run directory (``"nvme"``; else
        ``None``): an async checkpoint copies the files into it instead of into memory."""
        from shardckpt.checkpoint.writer import new_save_id

        self._check_usable()
        if self.run_dir is None:
            return None
        return OffloadSnapshot(self.run_dir / f"snapshot-{new_save_id()}")

    def local_master(self, name: str) -> Any:
        """The master of ``name``: the live host tensor (``"cpu"``) or its
        :class:`OffloadedShard`; waits for the worker first."""
        self._check_usable()
        self.drain()
        return self._host[name]["master"] if self._host else self._files[name, "master"]

    def read_master(self, name: str) -> torch.Tensor:
        """The fp32 master of ``name`` on the host (the live tensor with ``"cpu"``)."""
        live = self.local_master(name)
        if isinstance(live, torch.Tensor):
            return live
        out = torch.empty(self.sizes[name], dtype=torch.float32)
        live.read_into(out)
        return out

    def pull_master(self, name: str, master: torch.Tensor) -> None:
        """Copy ``master`` (fp32, any device) into the store's master of ``name``."""
        if self._host:
            self._host[name]["master"].copy_(master)
            return
        host = master.detach().to("cpu", copy=True)
        self._files[name, "master"].write_bytes(0, as_bytes(host))

    # ------------------------------------------------------------- gradients from backward

    @property
    def early_names(self) -> set[str]:
        """The groups whose step already ran in this backward (``overlap_step``)."""
        return set(self._early)

    def grad_ready(self, name: str, grad: torch.Tensor, master: torch.Tensor | None = None,
                   update: UpdateFn | None = None, work: Any = None) -> None:
        """The reduction of ``name`` finished with ``grad`` (its device shard): copy it to the
        host on the worker; with ``update`` (``overlap_step``) also run the group's step there
        and copy the updated master into ``master``. The caller leaves ``grad`` unchanged until
        :meth:`drain`."""
        self._check_usable()
        if name not in self.sizes or self._pool is None or (update is None and self._pipeline):
            return  # the pipeline copies the gradients in during step()
        if name in self._early:
            raise ConfigError(
                f"flat group {name} was reduced again before optimizer.step(), but its step "
                "already ran in the first backward (offload_overlap_step=True); accumulate "
                "micro-batches under engine.no_sync() and call step() after each synced backward")
        event = None
        if grad.device.type == "cuda":  # the worker's copy waits for the reduction's kernels
            event = torch.cuda.Event()
            event.record()
        if update is None:
            self._copied[name] = (weakref.ref(grad), grad._version)
            self._tasks.append(self._pool.submit(self._copy_grad, name, grad, event))
        else:
            assert master is not None  # the early step is given the master shard with update
            self._early[name] = work
            self._tasks.append(self._pool.submit(self._early_step, name, grad, event, master,
                                                 update, work))

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, event: Any = None) -> None:
        """``dst.copy_(src)`` on the worker; on CUDA on the worker's stream, after ``event``
        (the reduction's kernels), and finished on return."""
        if self._stream is None:
            dst.copy_(src)
            return
        with torch.cuda.stream(self._stream):
            if event is not None:
                self._stream.wait_event(event)
            dst.copy_(src, non_blocking=True)
        self._stream.synchronize()

    def _copy_grad(self, name: str, grad: torch.Tensor, event: Any) -> None:
        buf = self._grads.get(name)
        if buf is None:
            buf = self._grads[name] = torch.empty(grad.numel(), dtype=torch.float32,
                                                  pin_memory=self.pin)
        self._copy(buf, grad, event)

    def _early_step(self, name: str, grad: torch.Tensor, event: Any, master: torch.Tensor,
                    update: UpdateFn, work: Any) -> None:
        try:
            n = grad.numel()  # one reused buffer: the worker runs one task at a time
            if self._grad is None or self._grad.numel() < n:
                self._grad = torch.empty(n, dtype=torch.float32, pin_memory=self.pin)
            host = self._grad[:n]
            self._copy(host, grad, event)
            window = self._host[name] if self._host else read_window(
                self._files, name, self.sizes[name], ("master", *self.kinds), self._pin_state)
            self._update(update, name, window, host, work)
            self._copy(master, window["master"].to(master.dtype))  # the host cast
            if not self._host:
                write_window(self._files, name, window)
        except BaseException as e:
            self._failed = f"{type(e).__name__}: {e}"
            raise

    def drain(self) -> None:
        """Wait for every host copy and early step handed to the worker; raise the first
        failure."""
        tasks, self._tasks = self._tasks, []
        errors = []
        for f in tasks:
            try:
                f.result()
            except BaseException as e:  # noqa: BLE001 - wait for every task, then raise the first
                errors.append(e)
        if errors:
            raise errors[0]

    def scale_grads(self, coef: torch.Tensor) -> None:
        """Scale the host copies as the device shards were (clipping): the same multiply, so
        the same bits; a copy whose device shard changed otherwise is made again at the step."""
        if self.config.overlap_step:
            raise ConfigError("clip_grad_norm_ with offload_overlap_step=True: the steps ran in "
                              "backward, before any global norm; build the engine without it")
        self.drain()
        coef = coef.to("cpu", torch.float32)
        for name, (ref, version) in list(self._copied.items()):
            grad = ref()
            if grad is not None and grad._version == version + 1:
                self._grads[name].mul_(coef)
                self._copied[name] = (ref, grad._version)

    def _grad_of(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """The host copy of ``grad`` made in backward, if it is still what ``grad`` holds."""
        ref, version = self._copied.get(name, (None, -1))
        if ref is not None and ref() is grad and grad._version == version:
            return self._grads[name]
        return self.host_grad(grad)

    # ---------------------------------------------------------------------------- step

    def host_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` copied into the reused host buffer (pinned on CUDA)."""
        n = grad.numel()
        if self._grad is None or self._grad.numel() < n:
            self._grad = torch.empty(n, dtype=torch.float32, pin_memory=self.pin)
        out = self._grad[:n]
        out.copy_(grad)
        return out

    def windows(self, names: Sequence[str]) -> Windows:
        """Each group's master and state kinds, in order; with ``"nvme"``
        :func:`~shardckpt.runtime.offload.windows.file_windows` (read ahead, written back)."""
        if self._host:
            return ((name, self._host[name]) for name in names)
        assert self._pool is not None
        return file_windows(self._pool, self._files, self.sizes, names, ("master", *self.kinds),
                            self._pin_state)

    def step(self, work: Mapping[str, Any], masters: Mapping[str, torch.Tensor],
             grads: Mapping[str, torch.Tensor], update: UpdateFn) -> None:
        """Run ``update`` on every group of ``work`` on the host and copy each updated master
        to its device shard in ``masters``; a group stepped in backward (:meth:`grad_ready`
        with ``update``) is only waited for. If it fails half-way, some groups are updated and
        others not: the store then refuses every later step and checkpoint access, so that no
        checkpoint is taken from that state."""
        self._check_usable()
        early, self._early = self._early, {}
        try:
            self.drain()
            moved = sorted(n for n, items in early.items() if work.get(n) != items)
            if moved:
                raise ConfigError(
                    f"the hyper-parameters or steps of flat groups {moved[:3]} changed between "
                    "their step in backward (offload_overlap_step=True) and optimizer.step(); "
                    "set the learning rate and other hyper-parameters before backward")
            rest = [n for n in work if n not in early]
            if self._pipeline is not None:
                self._pipeline.run(rest, self.windows(rest), grads, masters,
                                   lambda n, w, g: self._update(update, n, w, g, work[n]))
                return
            for name, window in self.windows(rest):  # the unpipelined step
                grad = self._grad_of(name, grads[name])
                update(window["master"], grad, {k: window[k] for k in self.kinds}, work[name])
                masters[name].copy_(window["master"].to(masters[name].dtype))  # the host cast
        except BaseException as e:
            self._failed = f"{type(e).__name__}: {e}"
            raise
        finally:
            self._copied.clear()

    def _update(self, update: UpdateFn, name: str, window: dict[str, torch.Tensor],
                grad: torch.Tensor, work: Any) -> None:
        state = {k: window[k] for k in self.kinds}
        if self._stepper is None:
            update(window["master"], grad, state, work)
        else:
            self._stepper.run(update, window["master"], grad, state, work, name)

    def _check_usable(self) -> None:
        if self._failed is not None:
            where = self.run_dir or "host memory"
            raise ShardckptError(
                f"the offloaded optimizer state in {where} is inconsistent: an optimizer step "
                f"failed half-way ({self._failed}); rebuild the engine and resume from the last "
                "checkpoint")

    def close(self) -> None:
        """Release the host state, or close and remove the files."""
        if self._pool is not None:
            try:
                self.drain()
            except BaseException:  # noqa: BLE001 - the failure was raised where it happened
                pass
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._stepper is not None:
            self._stepper.close()
        self._host = {}
        self._grad = None
        self._grads = {}
        self._finalizer()
