"""shardckpt: sharded checkpoints for ZeRO-3 / FSDP training."""
__version__ = "0.1.0"
