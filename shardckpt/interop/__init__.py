"""Other formats in and out: Hugging Face, torch.distributed.checkpoint (DCP), DeepSpeed.

One package per format (:mod:`.hf`, :mod:`.dcp`, :mod:`.deepspeed`); the importers share one
interface (:mod:`.importer`: ``Importer``, ``ImportOptions``, the registry ``IMPORTERS``) and the
writing and commit of what they import (:mod:`.importing`); the exporters theirs (:mod:`.exporter`:
``Exporter``, ``ExportOptions``; the registry is :data:`shardckpt.tools.exporters.EXPORTERS`). What every format's reader needs:
:mod:`.foreign` (untrusted folders and text), :mod:`.pt_archive` (``torch.save`` archives
checked before a value is read; their zip structure in :mod:`.pt_zip`), :mod:`.safe_unpickle`
(allow-listed unpickling).
"""
