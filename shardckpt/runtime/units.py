"""Unit policy: which modules are gathered together, and which unit owns each parameter.

A *unit* is a module chosen by the policy plus the root; a parameter belongs to its innermost
enclosing unit (so the root holds the leftovers). Tied parameters (one ``nn.Parameter`` registered
under several names) appear once, under their first name in ``named_parameters()`` order; the other
names are recorded as aliases.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable

from torch import nn

from shardckpt.errors import ConfigError
from shardckpt.format.layout import ParamInfo
from shardckpt.runtime.precision import dtype_name

#: Decides whether the module at ``fqn`` is its own unit. The root is always a unit.
UnitPolicy = Callable[[str, nn.Module], bool]
PolicyLike = UnitPolicy | type | tuple | None

ROOT = ""


def units_by_type(*types: type) -> UnitPolicy:
    """A policy that makes every instance of ``types`` a unit ("each decoder layer, then the root")."""

    def policy(fqn: str, module: nn.Module) -> bool:
        return isinstance(module, types)

    policy.__qualname__ = f"units_by_type({', '.join(t.__name__ for t in types)})"
    return policy


def as_policy(policy: PolicyLike) -> UnitPolicy:
    """Accept a callable, a module class or a tuple of classes; ``None`` means "the root only"."""
    if policy is None:
        return lambda fqn, module: False
    if isinstance(policy, type):
        return units_by_type(policy)
    if isinstance(policy, tuple):
        return units_by_type(*policy)
    if callable(policy):
        return policy
    raise ConfigError(f"a unit policy is a callable (fqn, module) -> bool or module classes; "
                      f"got {policy!r}")


@dataclass(frozen=True)
class UnitPlan:
    """The result of applying a policy to a module tree (pure; holds references, copies nothing).

    ``units`` are module FQNs in ``named_modules()`` order, root (``""``) first. ``params`` lists
    each distinct parameter once, in ``named_parameters()`` order, with its owning unit.
    """

    units: tuple[str, ...]
    modules: dict[str, nn.Module]
    params: tuple[tuple[str, nn.Parameter, str], ...]   # (fqn, parameter, unit)
    aliases: dict[str, str]                             # alias fqn -> canonical fqn

    def param_infos(self) -> list[ParamInfo]:
        return [ParamInfo(fqn, tuple(p.shape), dtype_name(p.dtype), p.requires_grad, unit)
                for fqn, p, unit in self.params]


def _owner(fqn: str, unit_set: set[str]) -> str:
    parts = fqn.split(".")[:-1]
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in unit_set:
            return prefix
    return ROOT


def plan_units(module: nn.Module, policy: PolicyLike) -> UnitPlan:
    """Apply ``policy`` to ``module``; refuses a tied parameter whose uses sit in unrelated units.

    A tie is allowed when the canonical owner's unit encloses every alias's unit (e.g. both in the
    root), because an enclosing unit stays gathered while the units inside it run.
    """
    decide = as_policy(policy)
    modules = dict(module.named_modules())
    unit_names = [ROOT] + [fqn for fqn, m in modules.items() if fqn and decide(fqn, m)]
    unit_set = set(unit_names)
    params: list[tuple[str, nn.Parameter, str]] = []
    first: dict[int, tuple[str, str]] = {}
    aliases: dict[str, str] = {}
    bad = []
    for fqn, p in module.named_parameters(remove_duplicate=False):
        unit = _owner(fqn, unit_set)
        if id(p) in first:
            canon, canon_unit = first[id(p)]
            aliases[fqn] = canon
            if not (canon_unit == unit or canon_unit == ROOT or unit.startswith(canon_unit + ".")):
                bad.append(f"{fqn} (unit {unit or '<root>'}) is tied to {canon} "
                           f"(unit {canon_unit or '<root>'})")
            continue
        first[id(p)] = (fqn, unit)
        params.append((fqn, p, unit))
    if bad:
        raise ConfigError("tied parameters span units that are gathered separately: "
                          + "; ".join(bad) + ". Keep tied modules in one unit (e.g. the root).")
    used = {unit for _, _, unit in params}
    units = tuple(u for u in unit_names if u in used)
    return UnitPlan(units, {u: modules[u] for u in units}, tuple(params), aliases)
