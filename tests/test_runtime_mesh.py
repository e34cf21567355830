"""Torchrun environment, process meshes and collectives in one process (no torch.distributed)."""

from __future__ import annotations

import pytest
import torch

from shardckpt.errors import ConfigError
from shardckpt.format.layout import Mesh
from shardckpt.runtime import collectives
from shardckpt.runtime.mesh import ProcessMesh, TorchrunEnv, init_distributed, pick_device
from shardckpt.runtime.units import as_policy, plan_units, units_by_type


def test_torchrun_env_is_read_and_validated():
    env = TorchrunEnv.from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                                "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"})
    assert env == TorchrunEnv(3, 4, 1, "10.0.0.1", 1234) and env.is_launched
    assert TorchrunEnv.from_env({}) == TorchrunEnv()
    with pytest.raises(ConfigError, match="RANK='x'.*MASTER_PORT='y'"):
        TorchrunEnv.from_env({"RANK": "x", "MASTER_PORT": "y"})
    with pytest.raises(ConfigError, match="RANK is 4"):
        TorchrunEnv.from_env({"RANK": "4", "WORLD_SIZE": "4"})


def test_without_a_launcher_the_runtime_is_a_single_process():
    pm = init_distributed(environ={})
    assert not pm.is_distributed and pm.world_size == 1 and pm.shard_rank == 0
    assert pm.device == pick_device(0) and pm.mesh == Mesh.for_world(1)
    assert pick_device(0, "gloo") == torch.device("cpu")


def test_single_process_collectives_are_local_copies():
    pm = ProcessMesh.single()
    shard = torch.arange(16, dtype=torch.bfloat16)
    assert torch.equal(collectives.all_gather_flat(pm, shard), shard)
    grad = torch.arange(32, dtype=torch.bfloat16)
    out = collectives.reduce_scatter_mean(pm, grad, deterministic=True)
    assert out.dtype == torch.float32 and torch.equal(out, grad.float())


def test_unit_policies():
    from torch import nn

    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.ReLU()), nn.Linear(2, 2))
    plan = plan_units(model, lambda fqn, m: fqn == "1")
    assert plan.units == ("", "1")
    assert [(f, u) for f, _, u in plan.params] == [
        ("0.weight", ""), ("0.bias", ""), ("1.0.weight", "1"), ("1.0.bias", "1"),
        ("2.weight", ""), ("2.bias", "")]
    assert plan_units(model, nn.Linear).units == ("0", "1.0", "2")  # root has nothing left
    assert as_policy((nn.Linear,))("x", nn.Linear(1, 1))
    assert units_by_type(nn.ReLU)("x", nn.ReLU()) and not as_policy(None)("x", nn.ReLU())
    with pytest.raises(ConfigError):
        as_policy(3)
