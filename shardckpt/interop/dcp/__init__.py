"""torch.distributed.checkpoint (DCP): its storage layer over shardckpt, the import of what its
``FileSystemWriter`` wrote, and the export back.

- :mod:`.storage` — ``ShardckptWriter`` / ``ShardckptReader``, DCP's storage layer over shardckpt.
- :mod:`.checkpointer` — ``DcpCheckpointer``: ``latest``, retention and resume for an FSDP2 loop.
- :mod:`.import_` — a DCP directory as a checkpoint of chunked tensors (its chunks kept).
- :mod:`.to_flat` — a DCP directory as ``ZeroEngine`` flat groups (``import dcp --ranks N``).
- :mod:`.model_state` — which chunked tensor is a parameter, its optimizer state, a frozen
  parameter or a buffer (what ``.to_flat`` builds its flat groups from).
- :mod:`.export` — any shardckpt checkpoint as a directory stock ``dcp.load`` reads.
- :mod:`.metadata`, :mod:`.records`, :mod:`.payload`, :mod:`.flat_view` — DCP's metadata as
  JSON and as plain records, tensor payloads without torch, flat groups as DCP's pieces.
- :mod:`.importer` — the ``dcp`` importer (:mod:`shardckpt.interop.importer`); :mod:`.exporter`
  the ``dcp`` exporter (:mod:`shardckpt.interop.exporter`); :mod:`.config` their options and the
  import's origin record (``extras.dcp``).
"""
