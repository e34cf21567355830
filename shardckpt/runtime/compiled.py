"""Compiled units: each unit's forward under ``torch.compile``, the ZeRO hooks outside the graph.

``ZeroEngine(..., compile_units=True)`` (or a dict of ``torch.compile`` keyword arguments, e.g.
``{"fullgraph": True, "mode": "max-autotune-no-cudagraphs"}``) replaces the ``forward`` of every non-root unit
module by ``torch.compile(forward, **kwargs)``, as torchtitan compiles each transformer block
under FSDP2. What stays eager, and why:

* the unit's hooks (:mod:`shardckpt.runtime.stages`): they are module hooks, run by
  ``nn.Module.__call__`` around ``forward``, so the all-gather before the forward, the free
  after it, the gradient hooks on its outputs and the post-accumulate-grad hooks that reduce
  each flat group run as they do without compile. Inside the graph a parameter is a graph input
  like any tensor: while gathered its ``.data`` is a view of the flat buffer, of the same shape,
  stride and dtype every step, so the guards hold and nothing recompiles. The backward graph
  reads the views it saved, whose storage the re-gather for backward refills (stage 3);
* the root unit: its forward calls the other units, whose hooks run collectives, which do not
  belong in a graph (they would break it at every unit). Its own computation (embedding, final
  norm, head) stays eager;
* a unit that holds another unit (nested policies), for the same reason.

Limits: the deterministic (bit-exact) mode stays eager, and asking for both is a
:class:`~shardckpt.errors.ConfigError` (inductor fuses and reorders floating-point operations,
so its results are close to, not bit for bit, those of the eager reference). Activation
checkpointing (:func:`~shardckpt.runtime.activation.checkpoint_units`) wraps the compiled forward:
the recomputation runs the compiled code again.
The modes that capture CUDA graphs (``"reduce-overhead"``, ``"max-autotune"``) record
the parameters' addresses, and a stage-3 gather may place a unit's buffer elsewhere each time, as
FSDP2's does: expect re-recording rather than a gain (the ``-no-cudagraphs`` modes do not have
this problem; untested on a GPU so far).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any
from collections.abc import Mapping, Sequence

import torch

from shardckpt.errors import ConfigError
from shardckpt.runtime.stages import Unit
from shardckpt.runtime.units import ROOT

log = logging.getLogger(__name__)

#: ``compile_units`` as the engine takes it: off, on with torch.compile's defaults, or its kwargs.
CompileLike = bool | Mapping[str, Any] | None

_MARK = "_shardckpt_compiled"


def check_compile(compile_units: CompileLike, deterministic: bool) -> dict[str, Any] | None:
    """The ``torch.compile`` keyword arguments for ``compile_units`` (``None``: eager); one
    :class:`ConfigError` naming the field otherwise."""
    if compile_units is None or compile_units is False:
        return None
    if compile_units is True:
        options: dict[str, Any] = {}
    elif isinstance(compile_units, Mapping):
        options = dict(compile_units)
        known = set(inspect.signature(torch.compile).parameters) - {"model"}
        bad = sorted(str(k) for k in options if k not in known)
        if bad:
            raise ConfigError(f"compile_units has keys torch.compile does not take: "
                              f"{', '.join(bad)}; it takes {', '.join(sorted(known))}")
    else:
        raise ConfigError(f"compile_units is {compile_units!r}; use True, False or a dict of "
                          "torch.compile keyword arguments")
    if deterministic:
        raise ConfigError("compile_units and deterministic=True exclude each other: the "
                          "bit-exact mode stays eager (inductor fuses and reorders floating-point "
                          "operations, so compiled units are close to the reference, not equal "
                          "bit for bit); drop one of them")
    return options


def compile_unit_forwards(units: Sequence[Unit], options: Mapping[str, Any]) -> list[str]:
    """Compile the ``forward`` of each non-root unit that holds no other unit (see the module
    docstring); idempotent. Returns the FQNs of the units now compiled. Local."""
    done, nested = [], []
    modules = {id(u.module) for u in units}
    for unit in units:
        if unit.name == ROOT:
            continue
        if any(id(m) in modules for m in unit.module.modules() if m is not unit.module):
            nested.append(unit.name)
            continue
        if not getattr(unit.module, _MARK, False):
            unit.module.forward = torch.compile(unit.module.forward, **options)
            setattr(unit.module, _MARK, True)
        done.append(unit.name)
    log.info("torch.compile on %d units%s%s", len(done),
             f" ({', '.join(f'{k}={v!r}' for k, v in options.items())})" if options else "",
             f"; left eager (they hold other units): {', '.join(nested)}" if nested else "")
    return done
