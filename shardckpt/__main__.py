"""``python -m shardckpt`` (and ``torchrun ... -m shardckpt``): the ``shardckpt`` command."""

from shardckpt.cli.run import main  # type: ignore[import-not-found]  # shardckpt.cli is cli/ (setuptools package-dir), a mapping mypy cannot follow

if __name__ == "__main__":
    main()
