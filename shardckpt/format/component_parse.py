"""The components of a manifest, parsed strictly: flat groups, parameters, aliases and buffers.

Part of :func:`shardckpt.format.manifest_parse.parse`. Each group, parameter and buffer is
checked on its own and every problem is recorded in the :class:`ParseContext`; the parameters
of each flat group must tile it exactly, and a group name may belong to one component only.
"""

from __future__ import annotations

import itertools
import re
from typing import Any
from collections.abc import Mapping

from shardckpt.format.integrity import MAX_SHORT
from shardckpt.format.layout import SHARD_ALIGN, FlatGroup, Layout, Mesh, ParamSpec
from shardckpt.format.manifest import SAFE_NAME, BufferSpec, Component
from shardckpt.format.parse_context import ParseContext, Problem, listed

_KIND = re.compile(r"[A-Za-z0-9_]+")


def parse_components(ctx: ParseContext, comps_doc: dict[str, Any] | None,
                     mesh: Mesh | None) -> dict[str, Component] | None:
    """Every component, or None when one has a problem (or the mesh has: each is still checked)."""
    if comps_doc is None:
        return None
    mark = ctx.mark()
    components = {}
    for name, c in comps_doc.items():
        comp = _parse_component(ctx, name, c, mesh)
        if comp is not None:
            components[name] = comp
    if not ctx.clean_since(mark) or mesh is None:
        return None
    _check_unique_groups(ctx, components)
    return components if ctx.clean_since(mark) else None


def _parse_component(ctx: ParseContext, name: str, v: Any, mesh: Mesh | None) -> Component | None:
    w = f"components.{name[:64]}"
    mark = ctx.mark()
    if len(name) > MAX_SHORT or not SAFE_NAME.match(name):
        ctx.note(w, "component names are letters, digits, _ . -")
    try:
        c = ctx.obj(v, w)
        groups_doc = ctx.lst(ctx.key(c, "groups", w), f"{w}.groups")
        params_doc = ctx.lst(ctx.key(c, "params", w), f"{w}.params")
    except Problem as p:
        ctx.add(p)
        return None
    groups, states = _parse_groups(ctx, w, groups_doc, mesh)
    groups_ok = ctx.clean_since(mark)
    specs, members, seen = _parse_params(ctx, w, params_doc, groups, groups_ok)
    if ctx.clean_since(mark):
        _check_tiling(ctx, w, groups, members)
    aliases = ctx.attempt(_parse_aliases, ctx, w, c.get("aliases", {}), seen if ctx.clean_since(mark) else None)
    buffers = _parse_buffers(ctx, w, c.get("buffers", []), seen)
    if not ctx.clean_since(mark) or mesh is None:
        return None
    final_groups = [FlatGroup(g.name, g.unit, g.dtype, g.requires_grad, g.numel, g.padded_numel,
                              tuple(p.fqn for p in members[g.name])) for g in groups]
    layout = Layout(mesh, tuple(final_groups), tuple(specs))
    return Component(name, layout, states, aliases, buffers)  # type: ignore[arg-type]


def _parse_groups(ctx: ParseContext, w: str, groups_doc: list[Any], mesh: Mesh | None,
                  ) -> tuple[list[FlatGroup], dict[str, tuple[tuple[str, str], ...]]]:
    """The flat groups (their parameters not yet filled in) and each one's state kinds."""
    groups: list[FlatGroup] = []
    states: dict[str, tuple[tuple[str, str], ...]] = {}
    for i, gd in enumerate(groups_doc):
        gw = f"{w}.groups[{i}]"
        try:
            g, kinds = _parse_group(ctx, gw, gd, mesh)
        except Problem as p:
            ctx.add(p)
            continue
        if g.name in states:
            ctx.note(f"{gw}.name", f"group {g.name!r} appears twice")
            continue
        groups.append(g)
        states[g.name] = kinds
    return groups, states


def _parse_group(ctx: ParseContext, gw: str, v: Any,
                 mesh: Mesh | None) -> tuple[FlatGroup, tuple[tuple[str, str], ...]]:
    gd = ctx.obj(v, gw)
    gname = ctx.str_(ctx.key(gd, "name", gw), f"{gw}.name")
    if not SAFE_NAME.match(gname):
        raise ctx.fail(f"{gw}.name", f"{gname!r} is not letters, digits, _ . -")
    numel = ctx.int_(ctx.key(gd, "numel", gw), f"{gw}.numel")
    padded = ctx.int_(ctx.key(gd, "padded_numel", gw), f"{gw}.padded_numel")
    if mesh is not None and (padded < numel or padded % (SHARD_ALIGN * mesh.shard_degree) or padded == 0):
        raise ctx.fail(f"{gw}.padded_numel", f"{padded} is not a positive multiple of 16 x "
                       f"{mesh.shard_degree} shards that holds {numel} elements")
    kinds = []
    for j, sd in enumerate(ctx.lst(ctx.key(gd, "states", gw), f"{gw}.states")):
        sw = f"{gw}.states[{j}]"
        sd = ctx.obj(sd, sw)
        kind = ctx.str_(ctx.key(sd, "kind", sw), f"{sw}.kind", MAX_SHORT)
        if not _KIND.fullmatch(kind):
            raise ctx.fail(f"{sw}.kind", f"{kind!r} is not letters, digits and _")
        kinds.append((kind, ctx.dtype(ctx.key(sd, "dtype", sw), f"{sw}.dtype")))
    if len({k for k, _ in kinds}) != len(kinds):
        raise ctx.fail(f"{gw}.states", "state kinds repeat")
    if not kinds or kinds[0][0] != "master":
        raise ctx.fail(f"{gw}.states", "the first state kind of every group must be 'master'")
    group = FlatGroup(gname, ctx.str_(gd.get("unit", ""), f"{gw}.unit"),
                      ctx.dtype(ctx.key(gd, "dtype", gw), f"{gw}.dtype"),
                      ctx.bool_(ctx.key(gd, "requires_grad", gw), f"{gw}.requires_grad"),
                      numel, padded, ())
    return group, tuple(kinds)


def _parse_params(ctx: ParseContext, w: str, plist: list[Any], groups: list[FlatGroup], groups_ok: bool,
                  ) -> tuple[list[ParamSpec], dict[str, list[ParamSpec]], set[str]]:
    """Each parameter's spec, the specs of each group in list order, and every FQN seen. A
    parameter naming a group that does not exist is a problem only when every group parsed."""
    by_name = {g.name: g for g in groups}
    members: dict[str, list[ParamSpec]] = {g.name: [] for g in groups}
    specs: list[ParamSpec] = []
    seen: set[str] = set()
    for i, pd in enumerate(plist):
        plist[i] = None  # its spec replaces it: each parameter is held in one form, not two
        pw = f"{w}.params[{i}]"
        try:
            pd = ctx.obj(pd, pw)
            fqn = ctx.str_(ctx.key(pd, "fqn", pw), f"{pw}.fqn")
            if fqn in seen:
                raise ctx.fail(pw, f"parameter {fqn!r} appears twice")
            seen.add(fqn)
            gname = ctx.str_(ctx.key(pd, "group", pw), f"{pw}.group")
            group = by_name.get(gname)  # its name and dtype strings are shared by all its parameters
            if group is None:
                if groups_ok:
                    raise ctx.fail(f"{pw}.group", f"{fqn!r} names group {gname!r}, which does not exist")
                continue
            spec = ParamSpec(fqn, ctx.shape(ctx.key(pd, "shape", pw), f"{pw}.shape"),
                             group.dtype, group.name, ctx.int_(ctx.key(pd, "offset", pw), f"{pw}.offset"))
        except Problem as p:
            ctx.add(p)
            continue
        specs.append(spec)
        members[group.name].append(spec)
    return specs, members, seen


def _parse_aliases(ctx: ParseContext, w: str, v: Any, params: set[str] | None) -> dict[str, str]:
    """Alias FQN -> canonical FQN; each names a parameter (checked when ``params`` is known)."""
    aliases = {}
    for a, t in ctx.obj(v, f"{w}.aliases").items():
        ctx.str_(a, f"{w}.aliases (a key)")
        t = ctx.str_(t, f"{w}.aliases.{a}")
        if params is not None and (t not in params or a in params):
            raise ctx.fail(f"{w}.aliases.{a}", f"alias must name an existing parameter and not be one; "
                           f"{a!r} -> {t!r}")
        aliases[a] = t
    return aliases


def _parse_buffers(ctx: ParseContext, w: str, v: Any, params: set[str]) -> tuple[BufferSpec, ...]:
    try:
        buffers_doc = ctx.lst(v, f"{w}.buffers")
    except Problem as p:
        ctx.add(p)
        return ()
    buffers = []
    for i, bd in enumerate(buffers_doc):
        bw = f"{w}.buffers[{i}]"
        try:
            bd = ctx.obj(bd, bw)
            buffers.append(BufferSpec(ctx.str_(ctx.key(bd, "fqn", bw), f"{bw}.fqn"),
                                      ctx.shape(ctx.key(bd, "shape", bw), f"{bw}.shape"),
                                      ctx.dtype(ctx.key(bd, "dtype", bw), f"{bw}.dtype")))
        except Problem as p:
            ctx.add(p)
    if len({b.fqn for b in buffers}) != len(buffers):
        ctx.note(f"{w}.buffers", "buffer names repeat")
    clash = sorted({b.fqn for b in buffers} & params)
    if clash:
        ctx.note(f"{w}.buffers", f"names used by both a buffer and a parameter: {', '.join(clash[:10])}")
    return tuple(buffers)


def _check_tiling(ctx: ParseContext, w: str, groups: list[FlatGroup],
                  members: Mapping[str, list[ParamSpec]]) -> None:
    """Each group's parameters, in list order, tile ``[0, numel)``: every offender is named."""
    order: list[str] = []
    tiles: list[str] = []
    totals: list[str] = []
    for g in groups:
        ps = members[g.name]
        late = [f"{p.fqn!r} (offset {p.offset}) after {q.fqn!r} (offset {q.offset}) in group "
                f"{g.name!r}" for q, p in itertools.pairwise(ps) if p.offset < q.offset]
        if late:
            order += late
            continue
        pos, bad = 0, False
        for p in ps:
            if p.offset != pos:
                what = "overlaps the parameter before it" if p.offset < pos else "leaves a gap before it"
                tiles.append(f"{p.fqn!r} at offset {p.offset} in group {g.name!r} {what} "
                             f"(expected offset {pos})")
                bad = True
            pos = p.offset + p.numel
        if not bad and pos != g.numel:
            totals.append(f"group {g.name!r} says {g.numel} elements but its parameters hold {pos}")
    if order:
        ctx.note(f"{w}.params", "parameters are listed out of flat order (each group's "
                 f"parameters must be listed by increasing offset): {listed(order)}")
    if tiles:
        ctx.note(f"{w}.params", listed(tiles))
    if totals:
        ctx.note(f"{w}.groups", listed(totals))


def _check_unique_groups(ctx: ParseContext, components: Mapping[str, Component]) -> None:
    seen: dict[str, str] = {}
    both = []
    for c in components.values():
        for g in c.layout.groups:
            if g.name in seen:
                both.append(f"group {g.name!r} is in both {seen[g.name]!r} and {c.name!r}")
            else:
                seen[g.name] = c.name
    if both:
        ctx.note("components", listed(both))
