"""Fixtures shared by the format-core tests; the helpers behind them are in ``testing/ckpts.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from testing.ckpts import make_ckpt, manifest_doc_of_tiny
from shardckpt.format.manifest import Manifest


@pytest.fixture
def manifest_doc() -> dict[str, Any]:
    """The JSON document of a small valid manifest (2 shards, buffers, one rank file), to mutate."""
    return manifest_doc_of_tiny()


@pytest.fixture
def tiny_ckpt(tmp_path: Path) -> tuple[str, Manifest]:
    """A committed 2-rank synthetic checkpoint with 4 KiB chunks (several chunks per shard)."""
    return make_ckpt(tmp_path)


@pytest.fixture
def one_thread():
    """torch on one intra-op thread for the test (single-process runtime tests: steadier and no
    oversubscription of a small machine); the previous count is restored."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint stock DCP's ``FileSystemWriter`` wrote (``testing.dcp_states.state(0)``);
    shared by the DCP tests, which only read it (a test that damages one copies it first)."""
    pytest.importorskip("torch.distributed.checkpoint")
    from testing.dcp_states import dcp_save, state

    path = tmp_path_factory.mktemp("dcp") / "src"
    dcp_save(state(0), path)
    return path


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip ``cuda``-marked tests without a CUDA device (torch imported only for those)."""
    if item.get_closest_marker("cuda") is not None:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
