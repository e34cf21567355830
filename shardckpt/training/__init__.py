"""A running job's side: save and load of its shards, the ``Checkpointer``, loading chunked
checkpoints into ``ZeroEngine``, starting from Hugging Face weights (``hf_load``), and the local
launcher the demo and examples use."""
