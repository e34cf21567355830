"""``shardckpt watch``: the checkpoint pipeline service."""
