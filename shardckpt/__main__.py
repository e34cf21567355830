"""``python -m shardckpt`` (and ``torchrun ... -m shardckpt``): the ``shardckpt`` command."""

from shardckpt.cli.main import app

if __name__ == "__main__":
    app()
