"""The path docs/FORMAT.md names for DCP's storage layer; the module is
:mod:`shardckpt.interop.dcp.storage`."""

from shardckpt.interop.dcp.storage import (  # noqa: F401
    ShardckptReader, ShardckptWriter, WeightsOnlyLoadPlanner,
)

__all__ = ["ShardckptReader", "ShardckptWriter", "WeightsOnlyLoadPlanner"]
