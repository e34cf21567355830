"""Move a module's weights into flat shards, one unit at a time, initializing meta tensors on the way.

Walks ``module.named_modules()`` in order (pre-order, which is construction order for ordinary
``__init__`` code). At the first module that holds a parameter of a unit, the unit's gathered
buffers are allocated and its parameters pointed into them; materialized parameters are copied
in, meta ones are initialized by ``init_fn(module)`` (default: ``module.reset_parameters()``) when
their module is reached. Once every module that holds a parameter of the unit has been visited,
each rank keeps its slice in the master shard and the buffers are freed again.

Peak memory is the shards plus the units whose modules are still being visited (for a
transformer: the root's leftovers, whose modules come first and last, plus one block).

With the same RNG state (``init_seed``, or ``torch.manual_seed`` before the call), meta
initialization draws the same random numbers in the same order as eager construction of a model
whose modules initialize themselves in ``reset_parameters`` (as ``nn.Linear`` does), so it gives the
same weights. A module whose own parameters were all initialized already (e.g. an output head
tied to the embedding) is not re-initialized.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch
from torch import nn

from shardckpt.errors import ConfigError
from shardckpt.runtime.flat import FlatParamGroup

log = logging.getLogger(__name__)

InitFn = Callable[[nn.Module], None]


def default_init(module: nn.Module) -> None:
    """``module.reset_parameters()``: the convention of ``torch.nn`` layers (and FSDP's meta init)."""
    reset = getattr(module, "reset_parameters", None)
    if not callable(reset):
        raise ConfigError(
            f"{type(module).__name__} holds meta-device tensors but has no reset_parameters(); "
            "give the module one or pass init_fn=... to the engine"
        )
    reset()


def skip_weight_init(module: nn.Module) -> None:
    """``ZeroEngine(..., init_fn=skip_weight_init)`` for weights that come from a file next
    (:func:`shardckpt.training.hf_load.load_hf`, a checkpoint load).

    Parameters are left as they are allocated (no random numbers drawn, and the pages of a unit's
    temporary whole buffer are never touched, so a rank's memory stays about its shards); only
    modules that hold buffers are initialized (rotary tables). Load every parameter afterwards
    (``load_hf`` with ``strict=True``): a parameter left out would hold arbitrary values.
    """
    if next(module.buffers(recurse=False), None) is not None:
        default_init(module)


def swap_meta_params(module: nn.Module, params: Iterable[tuple[str, nn.Parameter]],
                     device: torch.device) -> tuple[dict[str, nn.Parameter], set[str]]:
    """Replace every meta parameter by an empty real one, in every module that holds it.

    Returns FQN -> the parameter now registered, and the FQNs that were meta (and still need
    initialization). ``.data`` of a meta tensor cannot point at real memory, hence new objects.
    """
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in module.modules():
        for key, p in m._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((m, key))
    out: dict[str, nn.Parameter] = {}
    fresh: set[str] = set()
    for fqn, p in params:
        if p.device.type == "meta":
            new = nn.Parameter(torch.empty(0, dtype=p.dtype, device=device),
                               requires_grad=p.requires_grad)
            for m, key in holders[id(p)]:
                m._parameters[key] = new
            out[fqn] = new
            fresh.add(fqn)
        else:
            out[fqn] = p
    return out, fresh


@contextlib.contextmanager
def _seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    if seed is None:
        yield
        return
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def shard_unit_by_unit(module: nn.Module, unit_groups: Mapping[str, list[FlatParamGroup]],
                       param_unit: Mapping[int, str], fresh: set[int], device: torch.device,
                       init_fn: InitFn | None = None, init_seed: int | None = None) -> None:
    """Fill every group's master shard from ``module`` (see module docstring). Local: no collectives.

    ``param_unit`` maps ``id(parameter)`` to its unit; ``fresh`` holds the ids of parameters that
    were on the meta device and must be initialized. Leaves every group freed.
    """
    init = init_fn or default_init
    holders: dict[str, set[str]] = {u: set() for u in unit_groups}
    for mfqn, m in module.named_modules():
        for p in m._parameters.values():
            if p is not None:
                holders[param_unit[id(p)]].add(mfqn)
    pending_init = set(fresh)
    allocated: set[str] = set()
    with _seeded(init_seed, device), torch.no_grad():
        for mfqn, m in module.named_modules():
            own = [p for p in m._parameters.values() if p is not None]
            units_here = list(dict.fromkeys(param_unit[id(p)] for p in own))
            for u in units_here:
                if u not in allocated:
                    _allocate(unit_groups[u], fresh)
                    allocated.add(u)
            needs = [p for p in own if id(p) in pending_init]
            for key, b in list(m._buffers.items()):
                if b is None:
                    continue
                if b.device.type == "meta":
                    m._buffers[key] = torch.empty_like(b, device=device)
                    needs.append(b)
                elif b.device != device:
                    m._buffers[key] = b.to(device)
            if needs:
                try:
                    init(m)
                except ConfigError as exc:
                    raise ConfigError(f"module {mfqn or '<root>'}: {exc}") from None
                pending_init.difference_update(id(p) for p in own)
            for u in units_here:
                holders[u].discard(mfqn)
                if not holders[u]:
                    for g in unit_groups[u]:
                        g.shard_from_full()
                        g.free()
                    log.debug("unit %r initialized and sharded", u or "<root>")
    for u in unit_groups:  # groups of units no module holds (cannot happen for nn.Module trees)
        for g in unit_groups[u]:
            if g.gathered:
                g.shard_from_full()
                g.free()


def _allocate(groups: list[FlatParamGroup], fresh: set[int]) -> None:
    for g in groups:
        originals = [p.data for p in g.params]
        g.allocate()
        for p, spec, orig in zip(g.params, g.param_specs, originals, strict=True):
            if id(p) not in fresh:
                g.full[spec.offset:spec.offset + spec.numel].copy_(orig.reshape(-1))
