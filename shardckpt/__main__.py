"""``python -m shardckpt`` (and ``torchrun ... -m shardckpt``): the ``shardckpt`` command."""

from shardckpt.cli.run import main

if __name__ == "__main__":
    main()
