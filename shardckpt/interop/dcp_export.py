"""The path docs/FORMAT.md names for the DCP export; the module is
:mod:`shardckpt.interop.dcp.export`."""

from shardckpt.interop.dcp.export import blocks, export_dcp  # noqa: F401

__all__ = ["export_dcp", "blocks"]
