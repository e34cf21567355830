"""DeepSpeed: ZeRO-1/2/3 checkpoints that ``engine.save_checkpoint`` wrote, in and out.

- :mod:`.files` — finding and loading its files (allow-listed ``torch.load``), staging, and the
  segments that undo its flat partitions.
- :mod:`.import_` — the import: weights, Adam state, buffers, tied weights.
- :mod:`.rank_files` — what one rank's optimizer file and the model states file hold, read one
  file at a time.
- :mod:`.importer` — the ``deepspeed`` importer (:mod:`shardckpt.interop.importer`); :mod:`.config`
  its options and origin record (``extras.deepspeed``).
- :mod:`.export` — the export: the folder ``engine.load_checkpoint`` reads, for ZeRO-1/2/3 at N ranks;
  :mod:`.exporter` the ``deepspeed`` exporter (:mod:`shardckpt.interop.exporter`).
"""
