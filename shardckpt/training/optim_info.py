"""An optimizer's param groups (hyper-parameters and steps) as a manifest's
:class:`~shardckpt.format.manifest.OptimizerInfo` records them, restored from one, and a fresh
optimizer state; shared by :mod:`shardckpt.training.save_load`, :mod:`shardckpt.training.hf_load`
and :mod:`shardckpt.training.chunked_load`."""

from __future__ import annotations

from typing import Any

from shardckpt.format.manifest import OptimizerInfo
from shardckpt.format.records import ParamGroupRecord, param_groups

__all__ = ["fresh_optimizer_state", "load_optimizer_info", "optimizer_info"]


def load_optimizer_info(model: Any, info: OptimizerInfo, strict: bool = True) -> None:
    """Restore hyper-parameters and steps. Param groups match by their FQN sets; when not
    ``strict``, by the FQNs both sides know (a group with no counterpart keeps its own)."""
    opt = getattr(model, "optimizer", None)
    if opt is None:
        return
    saved: list[dict[str, Any]] = [{"params": list(g.params), "hparams": dict(g.hparams), "step": g.step}
             for g in param_groups(info)]
    if not strict:
        current = opt.optimizer_metadata()["param_groups"]
        known_saved = {f for g in saved for f in g["params"]}
        known_now = {f for g in current for f in g["params"]}
        merged = []
        for g in current:
            mine = set(g["params"]) & known_saved
            match = next((s for s in saved if mine and set(s["params"]) & known_now == mine), None)
            merged.append({"params": g["params"], "hparams": (match or g)["hparams"],
                           "step": (match or g)["step"]})
        saved = merged
    opt.load_optimizer_metadata({"name": info.name, "param_groups": saved})


def optimizer_info(model: Any) -> OptimizerInfo | None:
    """The optimizer's name and param groups (``params``, ``hparams``, ``step``)."""
    opt = getattr(model, "optimizer", None)
    if opt is None:
        return None
    meta = opt.optimizer_metadata()
    return OptimizerInfo(meta["name"], tuple(
        ParamGroupRecord(tuple(g["params"]), dict(g["hparams"]), int(g["step"])).to_doc()
        for g in meta["param_groups"]))


def fresh_optimizer_state(model: Any) -> None:
    """Zero every per-element optimizer state of ``model``'s shards and set each step to 0: the
    state a newly built optimizer has."""
    import torch

    opt = getattr(model, "optimizer", None)
    if opt is None:
        return
    with torch.no_grad():
        for kinds in model.local_shards().values():
            for kind, t in kinds.items():
                if kind != "master":
                    t.zero_()
    meta = opt.optimizer_metadata()
    for g in meta["param_groups"]:
        g["step"] = 0
    opt.load_optimizer_metadata(meta)
