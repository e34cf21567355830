"""Hugging Face: safetensors model folders in, and the files beside consolidated weights.

- :mod:`.source` — a model folder, index or ``.safetensors`` file opened and checked (headers only).
- :mod:`.import_` — matching names, planning each rank's ranged reads, the offline import.
- :mod:`.files` — ``config.json`` and tokenizer files beside consolidated weights.
- :mod:`.importer` — the ``hf`` importer (:mod:`shardckpt.interop.importer`).
"""
