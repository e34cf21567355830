"""Models the runtime ships for tests, demos and benchmarks: a small Llama
(:mod:`~shardckpt.runtime.models.llama`) and its torch-free config
(:mod:`~shardckpt.runtime.models.llama_config`). Nothing here is imported eagerly."""
