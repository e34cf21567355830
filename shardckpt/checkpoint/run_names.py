"""The names of a run's checkpoint directories, for every layout shardckpt writes: one rule.

* ``step``: ``step-00000100``, by ``Checkpointer``, ``CheckpointManager``, the DCP checkpointer
  and torchtitan;
* ``trainer``: ``checkpoint-100``, by ``ShardckptTrainer`` (``TrainerRun``), as
  ``transformers.Trainer`` names them;
* ``lightning``: ``epoch=0-step=100.ckpt``, by the Lightning strategies, at the path
  ``ModelCheckpoint`` names (its default filename is ``epoch={epoch}-step={step}``).

Each layout is one pattern with one group, the step, as :attr:`CheckpointManager.DIR_PATTERN`
takes it, so a listing of any run goes through :class:`CheckpointManager`'s rules (only committed
directories count, retention keeps the newest). A name that carries no step (Lightning's
``last.ckpt``, rewritten in place at every save) is no checkpoint *of the run's sequence*:
:func:`stepless_checkpoints` finds those for the messages that list what a directory holds.

Every pattern accepts only plain names (ASCII letters, digits, ``_ . = + -``, at most 20 digits
of step), so a name read from a store is safe to log and to use as a path component.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from collections.abc import Iterable, Mapping

from shardckpt.checkpoint.run_dir import STEP_DIR, CheckpointManager, step_dir
from shardckpt.storage import Storage

#: ``transformers.Trainer``'s checkpoint directories (``trainer_utils.PREFIX_CHECKPOINT_DIR``).
TRAINER_DIR = re.compile(r"^checkpoint-([0-9]{1,20})\Z")
_PLAIN = r"[A-Za-z0-9_.=+-]"
#: A Lightning checkpoint whose name carries its step (``step=<N>`` between ``-``/``_``/start and
#: ``-``/``_``/``.``): ``epoch=1-step=40.ckpt``, ``step=40.ckpt``, ``epoch=1-step=40-v1.ckpt``.
LIGHTNING_DIR = re.compile(rf"^(?:[A-Za-z0-9]{_PLAIN}{{0,200}}?[-_])?step=([0-9]{{1,20}})"
                           rf"(?:[-_.]{_PLAIN}{{0,200}}?)?\.ckpt\Z")
#: Any Lightning checkpoint name, with a step or without (``last.ckpt``).
LIGHTNING_ANY = re.compile(rf"^[A-Za-z0-9]{_PLAIN}{{0,250}}\.ckpt\Z")


@dataclass(frozen=True)
class RunLayout:
    """One naming of a run's checkpoint directories: ``pattern`` (one group: the step) and
    ``label``, how a message names such a run."""

    name: str
    pattern: re.Pattern[str]
    label: str
    example: str

    def step_of(self, name: object) -> int | None:
        m = self.pattern.match(name) if isinstance(name, str) else None
        return int(m.group(1)) if m else None


STEP = RunLayout("step", STEP_DIR, "run directory", "step-00000100")
TRAINER = RunLayout("trainer", TRAINER_DIR, "Trainer run directory", "checkpoint-100")
LIGHTNING = RunLayout("lightning", LIGHTNING_DIR, "Lightning checkpoint directory",
                      "epoch=0-step=100.ckpt")
#: Every layout, in the order a directory that holds several is read.
LAYOUTS = (STEP, TRAINER, LIGHTNING)


def checkpoint_name(name: object) -> tuple[RunLayout, int] | None:
    """The layout and step of a checkpoint directory name; None for any other name."""
    for layout in LAYOUTS:
        step = layout.step_of(name)
        if step is not None:
            return layout, step
    return None


def checkpoint_names(names: Iterable[str]) -> list[tuple[int, str]]:
    """(step, name) of the checkpoint directory names among ``names``, oldest first (a name of
    another layout with the same step after, ordered by name)."""
    out = []
    for name in names:
        found = checkpoint_name(name)
        if found is not None:
            out.append((found[1], name))
    return sorted(out)


def stepless_checkpoints(names: Iterable[str]) -> list[str]:
    """Lightning checkpoint names that carry no step (``last.ckpt``)."""
    return sorted(n for n in names if LIGHTNING_ANY.match(n) and not LIGHTNING_DIR.match(n))


class LayoutRun(CheckpointManager):
    """:class:`CheckpointManager` reading a run of ``layout``'s naming (listing, committed
    checkpoints, checks, references; a step's directory name where the layout fixes one)."""

    def __init__(self, run_url: str | Storage, layout: RunLayout,
                 storage_options: Mapping[str, Any] | None = None) -> None:
        super().__init__(run_url, storage_options=storage_options)
        self.layout = layout
        self.DIR_PATTERN = layout.pattern

    def dir_name(self, step: int) -> str:
        if self.layout is STEP:
            return step_dir(step)
        if self.layout is TRAINER:
            return f"checkpoint-{step}"
        for s, name in self.step_dirs():  # Lightning: the name holds more than the step
            if s == step:
                return name
        return f"step={step}.ckpt"


def run_layout(names: Iterable[str]) -> RunLayout | None:
    """The layout of a run directory from its names: the first of :data:`LAYOUTS` that any name
    matches; None when none does."""
    names = list(names)
    for layout in LAYOUTS:
        if any(layout.pattern.match(n) for n in names):
            return layout
    return None


def run_manager(storage: Storage, names: Iterable[str] | None = None) -> CheckpointManager:
    """A :class:`CheckpointManager` for the run at ``storage`` in the layout its names
    (``names``: a listing the caller has already; else one LIST) show; ``step-*`` when it
    holds no checkpoint directory yet."""
    layout = run_layout(storage.ls("") if names is None else names) or STEP
    return CheckpointManager(storage) if layout is STEP else LayoutRun(storage, layout)
