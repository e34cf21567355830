"""The offload settings of :class:`~shardckpt.runtime.engine.ZeroEngine`, validated
(:mod:`shardckpt.runtime.offload.store` has what they mean)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from shardckpt.errors import ConfigError

MODES = ("cpu", "nvme")


@dataclass(frozen=True)
class OffloadConfig:
    """Where the optimizer state lives: ``mode`` ``"cpu"`` or ``"nvme"`` (with ``directory``)."""

    mode: str
    directory: Path | None = None
    overlap_step: bool = False  # each group's host step runs in backward (module docstring)

    def describe(self) -> str:
        return (f"optimizer offload {self.mode}" + (f" to {self.directory}" if self.directory
                                                    else "")
                + (", step overlapping backward" if self.overlap_step else ""))


def check_offload(mode: str | None, directory: str | os.PathLike[str] | None,
                  overlap_step: bool = False) -> OffloadConfig | None:
    """The validated offload settings (``None``: resident); one :class:`ConfigError` naming
    the field otherwise. For ``"nvme"`` the directory is created if missing and must be
    writable."""
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
