"""Property tests of the pure layout math: padding, shard ranges, meshes and the reshard plan.

The plan is checked two ways: structurally (:func:`check_plan`: every copy lies inside both shards
and maps element i of a parameter to element i of the same parameter; the copies of each target
shard tile its unpadded elements exactly once) and by simulation (fill the source shards with a
global numbering per (fqn, element), apply the copies with numpy, compare with the numbering the
target layout implies).
"""

from __future__ import annotations

import time
from bisect import bisect_right

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardckpt.errors import ConfigError, IncompatibleLayoutError
from shardckpt.format.dtypes import DTYPES, itemsize
from shardckpt.format.layout import SHARD_ALIGN, Layout, Mesh, ParamInfo, build_layout, padded_numel, regroup
from shardckpt.format.reshard_plan import ReshardPlan, plan_reshard

PROPS = settings(max_examples=100, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# ------------------------------------------------------------------------------ strategies

DTYPE_NAMES = sorted(DTYPES)
UNITS = ["", "layers.0", "layers.1", "layers.2"]

shapes = st.one_of(
    st.just(()),                                              # a scalar: one element
    st.just((1,)),
    st.just((0,)),
    st.lists(st.integers(0, 4), min_size=1, max_size=3).map(tuple),   # zero-size dims included
    st.lists(st.integers(1, 70), min_size=1, max_size=2).map(tuple),
)


@st.composite
def param_infos(draw: st.DrawFn, min_size: int = 1, max_size: int = 12) -> list[ParamInfo]:
    n = draw(st.integers(min_size, max_size))
    out = []
    for i in range(n):
        out.append(ParamInfo(
            fqn=f"m.p{i}.weight",
            shape=draw(shapes),
            dtype=draw(st.sampled_from(["float32", "bfloat16"]) | st.sampled_from(DTYPE_NAMES)),
            requires_grad=draw(st.booleans()),
            unit=draw(st.sampled_from(UNITS)),
        ))
    order = draw(st.permutations(range(n)))
    return [out[i] for i in order]


degrees = st.integers(1, 128)


# ---------------------------------------------------------------------------- plan checking


def ids_of(layout: Layout) -> dict[str, int]:
    """A global numbering: element e of parameter fqn is ``base[fqn] + e`` (stable across layouts)."""
    base, pos = {}, 0
    for fqn in sorted(p.fqn for p in layout.params):
        base[fqn] = pos
        pos += layout.param(fqn).numel
    return base


def numbered_shards(layout: Layout, base: dict[str, int]) -> dict[str, list[np.ndarray]]:
    """Per group, the S shard slices of a flat buffer holding each element's global id (-1 = pad)."""
    out = {}
    for g in layout.groups:
        flat = np.full(g.padded_numel, -1, np.int64)
        for p in layout.group_params(g):
            flat[p.offset:p.offset + p.numel] = base[p.fqn] + np.arange(p.numel)
        s = layout.shard_numel(g)
        out[g.name] = [flat[r * s:(r + 1) * s] for r in range(layout.shard_degree)]
    return out


def apply_plan(plan: ReshardPlan, src: dict[str, list[np.ndarray]], fill: int, item: int = 1,
               dtype: type = np.int64) -> tuple[dict[str, list[np.ndarray]], dict[str, list[np.ndarray]]]:
    """Run every copy of ``plan`` on numpy shards; returns (target shards, writes per element).

    ``item`` > 1 treats the shards as raw bytes (offsets and counts times the itemsize).
    """
    dst, writes = {}, {}
    for g in plan.dst.groups:
        s = plan.dst.shard_numel(g)
        dst[g.name] = [np.full(s * item, fill, dtype) for _ in range(plan.dst.shard_degree)]
        writes[g.name] = [np.zeros(s, np.int32) for _ in range(plan.dst.shard_degree)]
    for c in plan.copies:
        a, n = c.dst_offset * item, c.numel * item
        b = c.src_offset * item
        dst[c.dst_group][c.dst_shard][a:a + n] = src[c.src_group][c.src_shard][b:b + n]
        writes[c.dst_group][c.dst_shard][c.dst_offset:c.dst_offset + c.numel] += 1
    return dst, writes


def expected_target(layout: Layout, base: dict[str, int], planned: set[str]) -> dict[str, np.ndarray]:
    """Flat target buffers: ids for planned params, -2 (untouched) everywhere else."""
    out = {}
    for g in layout.groups:
        flat = np.full(g.padded_numel, -2, np.int64)
        for p in layout.group_params(g):
            if p.fqn in planned:
                flat[p.offset:p.offset + p.numel] = base[p.fqn] + np.arange(p.numel)
        out[g.name] = flat
    return out


def simulate(plan: ReshardPlan, planned: set[str]) -> None:
    """Numbered source shards through the plan must give the numbered target, each element once."""
    base = ids_of(plan.src)
    got, writes = apply_plan(plan, numbered_shards(plan.src, base), fill=-2)
    want = expected_target(plan.dst, base, planned)
    for g in plan.dst.groups:
        flat = np.concatenate(got[g.name])
        np.testing.assert_array_equal(flat, want[g.name], err_msg=f"group {g.name}")
        count = np.concatenate(writes[g.name])
        assert set(np.unique(count[want[g.name] >= 0])) <= {1}, f"{g.name}: element written twice"
        assert not count[want[g.name] < 0].any(), f"{g.name}: padding or skipped param written"


def check_plan(plan: ReshardPlan, planned: set[str] | None = None) -> int:
    """Structural validity without materialising data (usable at 70B scale). Returns #elements."""
    src, dst = plan.src, plan.dst
    planned = {p.fqn for p in dst.params} if planned is None else planned
    offsets = {g.name: [dst.param(f).offset for f in g.params] for g in dst.groups}
    pieces: dict[tuple[int, str], list[tuple[int, int]]] = {}
    total = 0
    last_key = None
    group_rank = {g.name: i for i, g in enumerate(dst.groups)}
    for c in plan.copies:
        key = (c.dst_shard, group_rank[c.dst_group], c.dst_offset)
        assert last_key is None or key > last_key, "copies are not sorted by target"
        last_key = key
        assert c.numel > 0
        g, sg = dst.group(c.dst_group), src.group(c.src_group)
        s_dst, s_src = dst.shard_numel(g), src.shard_numel(sg)
        assert 0 <= c.dst_shard < dst.shard_degree and 0 <= c.src_shard < src.shard_degree
        assert 0 <= c.dst_offset and c.dst_offset + c.numel <= s_dst
        assert 0 <= c.src_offset and c.src_offset + c.numel <= s_src
        d0 = c.dst_shard * s_dst + c.dst_offset
        s0 = c.src_shard * s_src + c.src_offset
        assert d0 + c.numel <= g.numel, "copy writes padding"
        assert s0 + c.numel <= sg.numel, "copy reads padding"
        # Walk the target params the copy spans: each piece must read the same param's elements.
        names, offs = g.params, offsets[g.name]
        i = bisect_right(offs, d0) - 1
        x = d0
        while x < d0 + c.numel:
            while dst.param(names[i]).numel == 0 or dst.param(names[i]).offset + dst.param(names[i]).numel <= x:
                i += 1
            p = dst.param(names[i])
            assert p.fqn in planned, f"{p.fqn} copied but not planned"
            y = min(d0 + c.numel, p.offset + p.numel)
            q = src.param(p.fqn)
            assert q.group == c.src_group, f"{p.fqn}: read from the wrong source group"
            assert s0 + (x - d0) == q.offset + (x - p.offset), f"{p.fqn}: element shifted"
            x = y
        pieces.setdefault((c.dst_shard, c.dst_group), []).append((c.dst_offset, c.numel))
        total += c.numel
    # Coverage: every planned element written exactly once (counted per target param).
    want = 0
    for g in dst.groups:
        for p in dst.group_params(g):
            if p.fqn in planned:
                want += p.numel
    assert total == want, f"copies move {total} elements, planned params hold {want}"
    for spans in pieces.values():
        spans.sort()
        for (a, n), (b, _) in zip(spans, spans[1:]):
            assert a + n <= b, "two copies write the same target element"
    return total


# ------------------------------------------------------------------------- padding / ranges


@PROPS
@given(numel=st.integers(0, 10**7), S=degrees)
def test_padded_numel(numel: int, S: int) -> None:
    p = padded_numel(numel, S)
    assert p >= max(numel, 1) and p % (SHARD_ALIGN * S) == 0
    assert p - numel < SHARD_ALIGN * S or numel == 0   # the smallest such multiple
    assert (p // S) % SHARD_ALIGN == 0


@PROPS
@given(infos=param_infos(), S=degrees, R=st.integers(1, 4))
def test_groups_padding_and_shard_ranges_tile(infos: list[ParamInfo], S: int, R: int) -> None:
    layout = build_layout(infos, Mesh.hsdp(R, S))
    assert layout.shard_degree == S
    assert sorted(p.fqn for p in layout.params) == sorted(i.fqn for i in infos)
    for g in layout.groups:
        assert g.padded_numel % (16 * S) == 0 and g.padded_numel >= g.numel and g.padded_numel > 0
        assert g.padded_numel - g.numel < 16 * S or g.numel == 0
        s = layout.shard_numel(g)
        assert s % 16 == 0 and s * S == g.padded_numel
        ranges = [layout.shard_range(g, r) for r in range(S)]
        assert ranges[0][0] == 0 and ranges[-1][1] == g.padded_numel
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert all(r == (i * s, (i + 1) * s) for i, r in enumerate(ranges))
        # params tile [0, numel) in order; all share the group's dtype, unit and trainability
        pos = 0
        for p in layout.group_params(g):
            assert p.offset == pos and p.group == g.name and p.dtype == g.dtype
            pos += p.numel
        assert pos == g.numel
        assert g.master_dtype == ("float32" if g.requires_grad else g.dtype)
    # each (unit, dtype, requires_grad) has exactly one group; params keep their given order
    keys = [(g.unit, g.dtype, g.requires_grad) for g in layout.groups]
    assert len(set(keys)) == len(keys)
    by = {i.fqn: i for i in infos}
    for g in layout.groups:
        assert all((by[f].unit, by[f].dtype, by[f].requires_grad) == (g.unit, g.dtype, g.requires_grad)
                   for f in g.params)
        idx = [infos.index(by[f]) for f in g.params]
        assert idx == sorted(idx)


def test_zero_size_and_scalar_params() -> None:
    layout = build_layout([ParamInfo("a", (0,), "float32"), ParamInfo("b", (), "float32"),
                           ParamInfo("c", (3, 0), "float32"), ParamInfo("d", (1,), "float32")],
                          Mesh.for_world(4))
    g = layout.groups[0]
    assert [(p.fqn, p.offset, p.numel) for p in layout.params] == [
        ("a", 0, 0), ("b", 0, 1), ("c", 1, 0), ("d", 1, 1)]
    assert (g.numel, g.padded_numel) == (2, 64)
    only_empty = build_layout([ParamInfo("e", (0, 5), "bfloat16")], Mesh.for_world(3))
    assert (only_empty.groups[0].numel, only_empty.groups[0].padded_numel) == (0, 48)


def test_build_layout_refuses_bad_input() -> None:
    with pytest.raises(ConfigError, match="repeat: a"):
        build_layout([ParamInfo("a", (2,), "float32"), ParamInfo("a", (3,), "float32")], Mesh.for_world(1))
    with pytest.raises(ConfigError, match="unknown dtype 'complex64'"):
        build_layout([ParamInfo("a", (2,), "complex64")], Mesh.for_world(1))
    with pytest.raises(ConfigError, match="invalid shape"):
        build_layout([ParamInfo("a", (2, -1), "float32")], Mesh.for_world(1))


# ------------------------------------------------------------------------------------- mesh


@PROPS
@given(R=st.integers(1, 8), S=st.integers(1, 16))
def test_mesh_is_row_major_replicate_outer(R: int, S: int) -> None:
    mesh = Mesh.hsdp(R, S)
    assert mesh.world_size == R * S and mesh.shard_degree == S and mesh.replicate_degree == R
    for rank in range(R * S):
        assert mesh.coords(rank) == {"dp_replicate": rank // S, "dp_shard": rank % S}
        assert mesh.shard_rank(rank) == rank % S and mesh.replicate_rank(rank) == rank // S
        assert mesh.ranks_along("dp_shard", rank) == [rank // S * S + i for i in range(S)]
        assert mesh.ranks_along("dp_replicate", rank) == [i * S + rank % S for i in range(R)]
    with pytest.raises(ConfigError):
        mesh.coords(R * S)


def test_mesh_validation() -> None:
    assert Mesh.for_world(12, 3).axes == (("dp_replicate", 3), ("dp_shard", 4))
    with pytest.raises(ConfigError, match="not divisible"):
        Mesh.for_world(10, 3)
    with pytest.raises(ConfigError, match="dp_shard"):
        Mesh((("dp_replicate", 2),))
    with pytest.raises(ConfigError, match="repeat"):
        Mesh((("dp_shard", 2), ("dp_shard", 2)))
    with pytest.raises(ConfigError, match="sizes are integers"):
        Mesh((("dp_shard", 0),))


# ------------------------------------------------------------------------------ reshard plan


@PROPS
@given(infos=param_infos(), S=degrees, T=degrees)
def test_plan_covers_every_element_once_and_maps_it_to_itself(infos: list[ParamInfo], S: int,
                                                                T: int) -> None:
    src = build_layout(infos, Mesh.for_world(S))
    dst = build_layout(infos, Mesh.for_world(T))
    plan = plan_reshard(src, dst)
    assert (plan.missing, plan.unexpected, plan.mismatched) == ((), (), ())
    check_plan(plan)
    simulate(plan, {p.fqn for p in dst.params})
    # the per-target index agrees with the copy list
    for t in range(T):
        assert all(c.dst_shard == t for c in plan.for_dst_shard(t))
        assert plan.src_shards_for(t) == {c.src_shard for c in plan.copies if c.dst_shard == t}
    assert sum(len(plan.for_dst_shard(t)) for t in range(T)) == len(plan.copies)


@PROPS
@given(infos=param_infos(), S=degrees, T=degrees, data=st.data())
def test_n_to_m_to_n_is_identity_on_bytes(infos: list[ParamInfo], S: int, T: int,
                                          data: st.DataObject) -> None:
    mesh_a = Mesh.hsdp(data.draw(st.integers(1, 3)), S)
    a = build_layout(infos, mesh_a)
    b = a.with_mesh(Mesh.for_world(T))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    # Random bytes per group, itemsize of the group's master dtype; padding is zero.
    shards = {}
    for g in a.groups:
        n = itemsize(g.master_dtype)
        flat = np.zeros(g.padded_numel * n, np.uint8)
        flat[:g.numel * n] = rng.integers(0, 256, g.numel * n, dtype=np.uint8)
        s = a.shard_numel(g) * n
        shards[g.name] = [flat[r * s:(r + 1) * s] for r in range(S)]
    there = plan_reshard(a, b)
    back = plan_reshard(b, a)
    mid = _apply_bytes(there, shards)
    out = _apply_bytes(back, mid)
    for g in a.groups:
        assert np.array_equal(np.concatenate(out[g.name]), np.concatenate(shards[g.name])), g.name


def _apply_bytes(plan: ReshardPlan, src: dict[str, list[np.ndarray]]) -> dict[str, list[np.ndarray]]:
    """Apply on bytes, one itemsize per group (both sides of a copy hold the same dtype)."""
    dst = {g.name: [np.zeros(plan.dst.shard_numel(g) * itemsize(g.master_dtype), np.uint8)
                    for _ in range(plan.dst.shard_degree)] for g in plan.dst.groups}
    for c in plan.copies:
        n = itemsize(plan.dst.group(c.dst_group).master_dtype)
        assert n == itemsize(plan.src.group(c.src_group).master_dtype)
        dst[c.dst_group][c.dst_shard][c.dst_offset * n:(c.dst_offset + c.numel) * n] = \
            src[c.src_group][c.src_shard][c.src_offset * n:(c.src_offset + c.numel) * n]
    return dst


@PROPS
@given(infos=param_infos(min_size=2), S=degrees, T=degrees, data=st.data())
def test_regroup_and_reorder_is_lossless(infos: list[ParamInfo], S: int, T: int,
                                         data: st.DataObject) -> None:
    a = build_layout(infos, Mesh.for_world(S), prefix="model.")
    unit_of = {i.fqn: data.draw(st.sampled_from(["", "x", "y"])) for i in infos}
    order = data.draw(st.permutations([i.fqn for i in infos]))
    b = regroup(a, unit_of, order, Mesh.for_world(T), prefix="model.")
    assert sorted(p.fqn for p in b.params) == sorted(p.fqn for p in a.params)
    assert all(b.param(f).shape == a.param(f).shape for f in order)
    assert all(b.group(b.param(f).group).unit == unit_of[f] for f in order)
    there, back = plan_reshard(a, b), plan_reshard(b, a)
    check_plan(there)
    check_plan(back)
    simulate(there, set(order))
    simulate(back, set(order))
    # numbered a -> b -> a gives a back exactly, padding included (untouched = -1 fill)
    base = ids_of(a)
    src = numbered_shards(a, base)
    mid, _ = apply_plan(there, src, fill=-1)
    out, _ = apply_plan(back, mid, fill=-1)
    for g in a.groups:
        assert np.array_equal(np.concatenate(out[g.name]), np.concatenate(src[g.name]))


def test_regroup_keeps_units_by_default() -> None:
    a = build_layout([ParamInfo("a", (3,), "float32", True, "u1"),
                      ParamInfo("b", (5,), "float32", True, "u2")], Mesh.for_world(2))
    b = regroup(a, {}, ["b", "a"])
    assert [(g.unit, g.params) for g in b.groups] == [("u2", ("b",)), ("u1", ("a",))]


# ------------------------------------------------------------------------- incompatibilities


@st.composite
def incompatible_pair(draw: st.DrawFn) -> tuple[list[ParamInfo], list[ParamInfo], set[str], set[str], set[str]]:
    infos = draw(param_infos(min_size=3))
    n = len(infos)
    fate = draw(st.lists(st.sampled_from(["same", "drop_src", "drop_dst", "reshape", "retype", "freeze"]),
                         min_size=n, max_size=n))
    src, dst = [], []
    missing, unexpected, mismatched = set(), set(), set()
    for info, f in zip(infos, fate):
        if f == "drop_src":          # only in the target: missing from the source
            dst.append(info)
            missing.add(info.fqn)
        elif f == "drop_dst":        # only in the source: unexpected
            src.append(info)
            unexpected.add(info.fqn)
        elif f == "reshape":
            src.append(info)
            dst.append(ParamInfo(info.fqn, info.shape + (2,), info.dtype, info.requires_grad, info.unit))
            mismatched.add(info.fqn)
        elif f == "freeze":
            src.append(info)
            dst.append(ParamInfo(info.fqn, info.shape, info.dtype, not info.requires_grad, info.unit))
            mismatched.add(info.fqn)
        elif f == "retype":
            # a dtype change only matters where it changes the stored master dtype (frozen groups)
            other = "float16" if info.dtype != "float16" else "int8"
            src.append(info)
            dst.append(ParamInfo(info.fqn, info.shape, other, info.requires_grad, info.unit))
            if not info.requires_grad:
                mismatched.add(info.fqn)
        else:
            src.append(info)
            dst.append(info)
    return src, dst, missing, unexpected, mismatched


@PROPS
@given(pair=incompatible_pair(), S=degrees, T=degrees)
def test_strict_lists_every_offender_and_lenient_plans_the_rest(pair, S: int, T: int) -> None:
    src_infos, dst_infos, missing, unexpected, mismatched = pair
    src = build_layout(src_infos, Mesh.for_world(S))
    dst = build_layout(dst_infos, Mesh.for_world(T))
    if missing or unexpected or mismatched:
        with pytest.raises(IncompatibleLayoutError) as ei:
            plan_reshard(src, dst, strict=True)
        e = ei.value
        assert set(e.missing) == missing and set(e.unexpected) == unexpected
        assert set(e.mismatched) == mismatched
        for name in missing | unexpected | mismatched:
            assert name in str(e)
    else:
        plan_reshard(src, dst, strict=True)
    plan = plan_reshard(src, dst, strict=False)
    assert set(plan.missing) == missing and set(plan.unexpected) == unexpected
    assert set(plan.mismatched) == mismatched
    planned = {p.fqn for p in dst.params} - missing - mismatched
    check_plan(plan, planned)
    simulate(plan, planned)


def test_strict_error_message_names_each_kind() -> None:
    src = build_layout([ParamInfo("keep", (4,), "float32"), ParamInfo("old", (4,), "float32"),
                        ParamInfo("w", (4, 4), "float32")], Mesh.for_world(2))
    dst = build_layout([ParamInfo("keep", (4,), "float32"), ParamInfo("new", (4,), "float32"),
                        ParamInfo("w", (4, 5), "float32")], Mesh.for_world(3))
    with pytest.raises(IncompatibleLayoutError) as ei:
        plan_reshard(src, dst)
    msg = str(ei.value)
    assert "missing from the source: new" in msg
    assert "not in the target: old" in msg
    assert "w (source [4, 4] float32, target [4, 5] float32)" in msg
    assert (ei.value.missing, ei.value.unexpected, ei.value.mismatched) == (("new",), ("old",), ("w",))


def test_a_plan_is_made_once_for_equal_layouts_and_strict_still_checks() -> None:
    """A resume asks which files each rank reads, then loads: both plan the same layouts, and
    the second gets the first's plan. A plan kept from a lenient call never lets a strict one
    through."""
    infos = [ParamInfo("keep", (4,), "float32"), ParamInfo("w", (4, 4), "float32")]
    first = plan_reshard(build_layout(infos, Mesh.for_world(2)), build_layout(infos, Mesh.for_world(3)))
    again = plan_reshard(build_layout(infos, Mesh.for_world(2)), build_layout(infos, Mesh.for_world(3)),
                         strict=False)
    assert again is first
    other = build_layout(infos[:1] + [ParamInfo("w", (4, 5), "float32")], Mesh.for_world(3))
    src = build_layout(infos, Mesh.for_world(2))
    assert plan_reshard(src, other, strict=False).mismatched == ("w",)
    with pytest.raises(IncompatibleLayoutError, match="different shape or dtype: w"):
        plan_reshard(src, other)


# ---------------------------------------------------------------------------------- 70B scale


def llama70b(S: int) -> Layout:
    d, ff, vocab, kv = 8192, 28672, 128256, 1024
    infos = []
    for i in range(80):
        u = f"model.layers.{i}"
        for name, shape in (("input_layernorm.weight", (d,)),
                            ("self_attn.q_proj.weight", (d, d)), ("self_attn.k_proj.weight", (kv, d)),
                            ("self_attn.v_proj.weight", (kv, d)), ("self_attn.o_proj.weight", (d, d)),
                            ("post_attention_layernorm.weight", (d,)),
                            ("mlp.gate_proj.weight", (ff, d)), ("mlp.up_proj.weight", (ff, d)),
                            ("mlp.down_proj.weight", (d, ff))):
            infos.append(ParamInfo(f"{u}.{name}", shape, "bfloat16", True, u))
    infos += [ParamInfo("model.embed_tokens.weight", (vocab, d), "bfloat16"),
              ParamInfo("model.norm.weight", (d,), "bfloat16"),
              ParamInfo("lm_head.weight", (vocab, d), "bfloat16")]
    return build_layout(infos, Mesh.for_world(S), prefix="model.")


def test_plan_70b_from_1024_to_768_ranks() -> None:
    src, dst = llama70b(1024), llama70b(768)
    total = sum(p.numel for p in src.params)
    assert 70_000_000_000 < total < 71_000_000_000
    t0 = time.perf_counter()
    plan = plan_reshard(src, dst)
    elapsed = time.perf_counter() - t0
    assert len(plan.src.groups) == len(plan.dst.groups) == 81
    moved = check_plan(plan)
    assert moved == total
    # every target shard is fed, each from the few source shards its range overlaps
    assert {c.dst_shard for c in plan.copies} == set(range(768))
    for t in (0, 1, 383, 767):
        assert len(plan.src_shards_for(t)) in (1, 2, 3)
    # shard 0 of group 0 starts with the first layer's norm, read from source shard 0
    first = plan.for_dst_shard(0)[0]
    assert (first.dst_group, first.dst_offset, first.src_shard, first.src_offset) == (
        dst.groups[0].name, 0, 0, 0)
    print(f"planned {len(plan.copies)} copies for 70B 1024 -> 768 in {elapsed:.2f}s")
