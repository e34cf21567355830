"""What the importers (Hugging Face, DeepSpeed, DCP) share: the unit patterns
that group parameters into units, and the summary of what an import wrote."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Sequence

from shardckpt.errors import ConfigError

if TYPE_CHECKING:
    from shardckpt.format.manifest import Manifest

#: One unit per transformer block (``...layers.<i>``, under any prefix); everything else in the
#: root. The unit patterns of the DeepSpeed and DCP imports.
BLOCK_UNITS = (r"(?:.*\.)?layers\.\d+",)
#: The hyper-parameters of an Adam-family param group that an import keeps.
ADAM_HPARAMS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")


def unit_of(fqn: str, patterns: Sequence["re.Pattern[str]"]) -> str:
    """The unit of ``fqn``: the prefix the first matching pattern covers (whole name components),
    else the root (``""``)."""
    for p in patterns:
        m = p.match(fqn)
        if m:
            return m.group(0)
    return ""


def compile_units(patterns: Sequence[str]) -> list["re.Pattern[str]"]:
    """Each pattern, anchored to match whole name components; a bad one is a :class:`ConfigError`."""
    out = []
    for pat in patterns:
        try:
            out.append(re.compile(rf"(?:{pat})(?=\.|$)"))
        except re.error as e:
            raise ConfigError(f"unit pattern {pat!r} is not a regular expression: {e}") from None
    return out


def import_summary(m: "Manifest", dst: str, source_format: str) -> dict[str, Any]:
    """What an import wrote to ``dst``, as plain data (what ``shardckpt import --json`` prints).

    Flat groups: the mesh, parameters, units and bytes, and per ``source_format`` (``hf``,
    ``deepspeed``, ``dcp``) what the source recorded; DCP's chunks kept as they are: tensors,
    other values, files and bytes."""
    if m.chunked is not None:
        return {"destination": dst, "save_id": m.save_id, "tensors": len(m.chunked.tensors),
                "values": len(m.chunked.blobs), "files": len(m.files), "bytes": m.total_bytes}
    layout = m.components["model"].layout
    out: dict[str, Any] = {"destination": dst, "save_id": m.save_id, "ranks": m.mesh.world_size,
                           "replicate": m.mesh.replicate_degree, "params": len(layout.params),
                           "units": len({g.unit for g in layout.groups}), "bytes": m.total_bytes}
    if source_format == "hf":
        out["hf_config"] = "hf_config" in m.extras
    elif source_format == "deepspeed":
        ds = m.extras.get("deepspeed", {})
        out.update(step=m.extras.get("step"), zero_stage=ds.get("stage"),
                   source_world_size=ds.get("world_size"))
    else:
        out["step"] = m.extras.get("step")
    return out
