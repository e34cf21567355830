"""A running job's side: save and load of its shards, the ``Checkpointer``, loading chunked
checkpoints into ``ZeroEngine``, and the local launcher the demo and examples use."""
