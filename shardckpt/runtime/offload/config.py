"""The offload settings of :class:`~shardckpt.runtime.engine.ZeroEngine`, validated
(:mod:`shardckpt.runtime.offload.store` has what they mean).

``offload_optimizer`` is a mode (``"cpu"``, ``"nvme"``) or an :class:`OffloadConfig` for the
settings beyond it: ``pipeline=False`` selects the step as it ran before the group pipeline
(:mod:`~shardckpt.runtime.offload.pipeline`), kept for comparison; ``host_threads`` the threads of
the host step (:mod:`~shardckpt.runtime.offload.host_step`); ``fused_adamw=True`` torch's fused
CPU AdamW, faster but not the resident run's bits (opt-in).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from shardckpt.errors import ConfigError

MODES = ("cpu", "nvme")


@dataclass(frozen=True)
class OffloadConfig:
    """Where the optimizer state lives: ``mode`` ``"cpu"`` or ``"nvme"`` (with ``directory``),
    and how the host step runs (module docstring)."""

    mode: str
    directory: Path | None = None
    overlap_step: bool = False  # each group's host step runs in backward (module docstring)
    pipeline: bool = True  # gradients in, step, weights out, group by group in a ring
    host_threads: int | None = None  # None: torch.get_num_threads()
    fused_adamw: bool = False  # torch._fused_adamw_: faster, not bit-exact

    def describe(self) -> str:
        return (f"optimizer offload {self.mode}" + (f" to {self.directory}" if self.directory
                                                    else "")
                + (", step overlapping backward" if self.overlap_step else "")
                + ("" if self.pipeline else ", unpipelined step")
                + (", fused AdamW (not bit-exact)" if self.fused_adamw else ""))


def check_offload(mode: str | OffloadConfig | None, directory: str | os.PathLike[str] | None,
                  overlap_step: bool = False) -> OffloadConfig | None:
    """The validated offload settings (``None``: resident); one :class:`ConfigError` naming
    the field otherwise. For ``"nvme"`` the directory is created if missing and must be
    writable. ``mode`` may be an :class:`OffloadConfig`; its directory and ``overlap_step``
    are then its own."""
    if isinstance(mode, OffloadConfig):
        if directory is not None or overlap_step:
            raise ConfigError("offload_optimizer is an OffloadConfig: set directory and "
                              "overlap_step in it, not offload_dir / offload_overlap_step")
        threads = mode.host_threads
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ConfigError(f"OffloadConfig.host_threads is {threads!r}; use None or an int "
                              ">= 1")
        checked = _check_mode(mode.mode, mode.directory)
        assert checked is not None
        return replace(mode, directory=checked.directory, overlap_step=bool(mode.overlap_step))
    if mode is None and overlap_step:
        raise ConfigError("offload_overlap_step=True needs offload_optimizer='cpu' or 'nvme'")
    config = _check_mode(mode, directory)
    if config is None:
        return None
    return OffloadConfig(config.mode, config.directory, bool(overlap_step))


def _check_mode(mode: str | None, directory: str | os.PathLike[str] | None
                ) -> OffloadConfig | None:
    if mode is None:
        if directory is not None:
            raise ConfigError(f"offload_dir={str(directory)!r} is set but offload_optimizer is "
                              "None; pass offload_optimizer='nvme' to use it")
        return None
    if mode not in MODES:
        raise ConfigError(f"offload_optimizer is {mode!r}; use None, 'cpu' or 'nvme'")
    if mode == "cpu":
        if directory is not None:
            raise ConfigError("offload_dir is only for offload_optimizer='nvme'")
        return OffloadConfig("cpu")
    if directory is None:
        raise ConfigError("offload_optimizer='nvme' needs offload_dir, a directory on local disk")
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".shardckpt-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"offload directory {path} is not writable: "
                          f"{e.strerror or e} ({type(e).__name__})") from e
    return OffloadConfig("nvme", path)
