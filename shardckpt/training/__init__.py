"""The training-loop side: save and load from a running job, the Checkpointer, collectives, local launch."""
