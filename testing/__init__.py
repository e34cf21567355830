"""Helpers shared by the test suites (``tests/``, ``integration/``) and the benchmarks; not
installed. pytest puts the repository root on ``sys.path`` (``pythonpath`` in pyproject.toml).

- :mod:`testing.ranks`: run a function on N local ranks over gloo; suites sharing one job.
- :mod:`testing.models`: tiny models, batches and losses.
- :mod:`testing.reference`: plain-PyTorch references and comparisons with an engine's shards.
- :mod:`testing.ckpts`: tiny checkpoints and manifests.
- :mod:`testing.cli`: run the CLI in process or as a child; check the outcome.
- :mod:`testing.fsspec_probes`: fsspec filesystems that count reads or die mid-write.
- :mod:`testing.s3servers`, :mod:`testing.faultproxy`: local S3 servers and a fault proxy.
"""
