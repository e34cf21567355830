"""What a library logs inside a test's process (a rank's, too)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def warnings_of(logger: str) -> Iterator[list[str]]:
    """The messages of the warnings ``logger`` (and those below it) logs meanwhile."""
    got: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            got.append(record.getMessage())

    handler, log = Keep(logging.WARNING), logging.getLogger(logger)
    log.addHandler(handler)
    try:
        yield got
    finally:
        log.removeHandler(handler)
