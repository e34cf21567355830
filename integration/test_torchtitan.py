"""torchtitan's checkpoint manager over shardckpt (``shardckpt.integrations.torchtitan``), against
the installed torchtitan release (0.3.0; ``.ci/run`` installs it).

One 2-rank gloo job (``testing/titan_job.py``): torchtitan's optimizer, LR scheduler and stateful
dataloader around an FSDP2 model, trained with checkpoints off (the reference); then, in a local
folder and in an ``s3://`` one, with saves every 2 steps and a stop after step 5, then resumed
from another seed with ``async_mode="async"``. The losses and the final model and optimizer state
of the interrupted and resumed runs equal the reference's bit for bit; what is left in each
folder is the newest ``keep_latest_k`` committed checkpoints, ``latest``, and the uncommitted
directory, untouched.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import importlib.util
import os

import pytest

if importlib.util.find_spec("torchtitan") is None:
    if os.environ.get("SHARDCKPT_REQUIRE_TORCHTITAN") == "1":
        raise RuntimeError("SHARDCKPT_REQUIRE_TORCHTITAN=1 but torchtitan is not installed "
                           "(.ci/run installs it: pip install --no-deps torchtitan==0.3.0)")
    pytest.skip("torchtitan is not installed (.ci/run installs it)", allow_module_level=True)

from testing.cli import cli, ok  # noqa: E402
from testing.ranks import run_distributed  # noqa: E402
from testing.titan_job import STRAY, titan_job  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

TOTAL, INTERVAL, CRASH_AT, KEEP = 8, 2, 5, 2
KEPT = ["step-00000006", "step-00000008"]


class Job:
    def __init__(self, folder: Path, s3_folder: str, s3_options: dict[str, Any],
                 ranks: list[dict[str, Any]]) -> None:
        self.folder, self.s3_folder, self.s3_options, self.ranks = folder, s3_folder, s3_options, ranks


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory, moto_server: Any) -> Any:
    """The one launch: a local folder and an S3 one. shardckpt's reads and writes get the
    bucket's storage options; torchtitan's own existence checks (fsspec with its defaults) read
    the endpoint and keys from the environment."""
    from testing.s3servers import REGION

    folder = tmp_path_factory.mktemp("titan") / "checkpoint"
    bucket = moto_server.create_bucket()
    opts = moto_server.storage_options()
    env = {"AWS_ENDPOINT_URL": opts["client_kwargs"]["endpoint_url"], "AWS_ACCESS_KEY_ID": opts["key"],
           "AWS_SECRET_ACCESS_KEY": opts["secret"], "AWS_DEFAULT_REGION": REGION}
    s3_folder = f"s3://{bucket}/run"
    try:
        ranks = run_distributed(titan_job, 2, args=([(str(folder), {}), (s3_folder, opts)], TOTAL,
                                                    INTERVAL, CRASH_AT, KEEP),
                                timeout_s=300, env=env)
        yield Job(folder, s3_folder, opts, ranks)
    finally:
        moto_server.delete_bucket(bucket)


@pytest.mark.parametrize("where", [0, pytest.param(1, marks=pytest.mark.s3)], ids=["local", "s3"])
def test_resume_equals_an_uninterrupted_run(job: Job, where: int) -> None:
    for r in job.ranks:
        run = r["runs"][where]
        assert len(r["ref_losses"]) == TOTAL
        assert run["resumed_from"] == 4  # the newest committed save, not the torn step-00000099
        assert run["first_losses"] == r["ref_losses"][:CRASH_AT]
        assert run["resumed_losses"] == r["ref_losses"][4:]  # step 5 again, then 6..8
        assert run["fresh_state"] != r["ref_state"]  # the resumed run started elsewhere
        differ = [k for k in r["ref_state"] if run["resumed_state"].get(k) != r["ref_state"][k]]
        assert differ == [] and r["ref_state"]["step"] == str(TOTAL)
        assert sum(k.startswith("optim.") and k.endswith("exp_avg_sq") for k in r["ref_state"]) >= 10


@pytest.mark.parametrize("where", [0, pytest.param(1, marks=pytest.mark.s3)], ids=["local", "s3"])
def test_retention_keeps_k_committed_and_moves_latest(job: Job, where: int) -> None:
    run = job.ranks[0]["runs"][where]
    assert run["committed"] == KEPT
    assert run["step_dirs"] == KEPT + [STRAY]  # the uncommitted one neither counted nor deleted
    assert run["latest"] == KEPT[-1]


def test_every_save_is_a_committed_shardckpt_checkpoint(job: Job) -> None:
    assert not list(job.folder.rglob(".metadata"))  # nothing went through DCP's FileSystemWriter
    for name in KEPT:
        manifest = json.loads((job.folder / name / "manifest.json").read_text())
        assert manifest["extras"]["step"] == int(name[len("step-"):])
        ok(cli("verify", str(job.folder / name)))
    r = ok(cli("inspect", str(job.folder)))  # the folder is a run directory: latest resolves
    assert KEPT[-1] in r.stdout + r.stderr


@pytest.mark.s3
def test_s3_checkpoint_verifies(job: Job) -> None:
    from shardckpt.checkpoint.verify import verify

    assert verify(f"{job.s3_folder}/{KEPT[-1]}", job.s3_options)


# ---------------------------------------------------------------- one process, no job


def _manager(folder: Path, model: Any = None, states: dict[str, Any] | None = None,
             **config: Any) -> Any:
    """A manager in this process (no process group: DCP saves and loads as one rank)."""
    from torch import nn

    from shardckpt.integrations.torchtitan import ShardckptCheckpointManager

    return ShardckptCheckpointManager.Config(enable=True, folder=str(folder), **config).build(
        dataloader=None, model_parts=[model or nn.Linear(2, 2)], optimizers=None,
        lr_schedulers=None, states=states or {}, sd_adapter=None, base_folder="")


class _TrainState:
    def __init__(self, step: int) -> None:
        self.step = step

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = sd["step"]


def test_a_folder_of_torchtitan_dcp_checkpoints_is_named_then_converted(tmp_path: Path) -> None:
    """A folder that holds only what torchtitan's own manager wrote (DCP's FileSystemWriter) is
    not taken for a fresh start: one error names the folder, the newest checkpoint and the
    command that converts it; after that command the manager resumes from it, bit for bit."""
    import torch
    from torch import nn
    from torchtitan.components.checkpointer import CheckpointManager

    from shardckpt.errors import IncompleteCheckpointError

    torch.manual_seed(0)
    model, state = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2)), _TrainState(0)
    stock = CheckpointManager.Config(enable=True, folder=str(tmp_path), interval=10,
                                     keep_latest_k=0).build(
        dataloader=None, model_parts=[model], optimizers=None, lr_schedulers=None,
        states={"train_state": state}, sd_adapter=None, base_folder="")
    for step in (10, 20):
        state.step = step
        with torch.no_grad():
            model[0].weight.add_(1.0)
        stock.save(step)
    stock.close()

    torch.manual_seed(1)
    fresh, fresh_state = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2)), _TrainState(0)
    ours = _manager(tmp_path, model=fresh, states={"train_state": fresh_state})
    try:
        with pytest.raises(IncompleteCheckpointError) as e:
            ours.load()
        msg = str(e.value)
        assert str(tmp_path) in msg and "newest step-20" in msg
        command = msg.split("`")[1].split()
        assert command == ["shardckpt", "import", "dcp", f"{tmp_path}/step-20",
                           f"{tmp_path}/step-00000020"]
        ok(cli(*command[1:]))
        assert ours.load() is True and fresh_state.step == 20
    finally:
        ours.close()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 fresh.state_dict().values(), strict=True))


def test_an_empty_folder_is_a_fresh_start(tmp_path: Path) -> None:
    m = _manager(tmp_path / "none")
    try:
        assert m.load() is False
    finally:
        m.close()


def test_shardckpt_config_keeps_every_torchtitan_setting() -> None:
    from torchtitan.components.checkpointer import CheckpointManager

    from shardckpt.errors import ConfigError
    from shardckpt.integrations.torchtitan import ShardckptCheckpointManager, shardckpt_config

    theirs = CheckpointManager.Config(enable=True, folder="s3://b/run", interval=7, keep_latest_k=4,
                                      async_mode="async", exclude_from_loading=["dataloader"])
    ours = shardckpt_config(theirs, storage_options={"anon": False}, full_verify=True)
    assert isinstance(ours, ShardckptCheckpointManager.Config) and ours._owner is ShardckptCheckpointManager
    for name in ("enable", "folder", "interval", "keep_latest_k", "async_mode", "exclude_from_loading"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.storage_options == {"anon": False} and ours.full_verify and not ours.allow_pickle
    with pytest.raises(ConfigError, match="CheckpointManager.Config"):
        shardckpt_config({"folder": "x"})


# ------------------------------------------------- the data loader's pickled state, one process


class _Plant:
    """Unpickled, it creates a file (what a hostile checkpoint's code would do, harmlessly)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (open, (self.marker, "w"))


class _HostileLoader:
    """A writer's data loader whose state is torchtitan's layout with a pickle that runs code."""

    def __init__(self, marker: str) -> None:
        import pickle

        self.payload = pickle.dumps(_Plant(marker))

    def state_dict(self) -> dict[str, Any]:
        return {"dp_rank_0": self.payload, "world_size": 1}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        raise AssertionError("only written")


def _loader() -> Any:
    from torchtitan.components.dataloader import ParallelAwareDataloader

    from testing.titan_job import Tokens

    return ParallelAwareDataloader(Tokens(0), dp_rank=0, dp_world_size=1, batch_size=2)


def _with_loader(folder: Path, loader: Any, **config: Any) -> Any:
    from torch import nn

    from shardckpt.integrations.torchtitan import ShardckptCheckpointManager

    return ShardckptCheckpointManager.Config(enable=True, folder=str(folder), interval=10,
                                             **config).build(
        dataloader=loader, model_parts=[nn.Linear(2, 2)], optimizers=None, lr_schedulers=None,
        states={"train_state": _TrainState(10)}, sd_adapter=None, base_folder="")


def _save_step_10(folder: Path, loader: Any) -> None:
    m = _with_loader(folder, loader)
    try:
        m.save(10)
    finally:
        m.close()


def test_a_data_loader_pickle_that_names_code_is_refused(tmp_path: Path) -> None:
    """A checkpoint that verifies, whose dp_rank_0 bytes are a pickle that opens a file:
    the resume is one UnsafePickleError naming the value and the global (io.open), and nothing ran."""
    from shardckpt.errors import UnsafePickleError

    marker = tmp_path / "ran"
    _save_step_10(tmp_path / "run", _HostileLoader(str(marker)))
    ok(cli("verify", str(tmp_path / "run" / "step-00000010")))
    m = _with_loader(tmp_path / "run", _loader())
    try:
        with pytest.raises(UnsafePickleError) as e:
            m.load()
    finally:
        m.close()
    msg = str(e.value)
    assert "dp_rank_0" in msg and "global io.open" in msg and "pickle.loads" in msg, msg
    assert "allow_pickle=True" in msg and "step-00000010" in msg, msg
    assert not marker.exists()


def test_a_plain_data_loader_state_resumes_and_allow_pickle_warns_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """torchtitan's own loader state (a pickle of plain data) resumes without the opt-in, at the
    position saved; with allow_pickle=True it loads too, and says so once per manager."""
    import torch

    first = _loader()
    batches = iter(first)
    for _ in range(3):
        next(batches)
    _save_step_10(tmp_path / "run", first)
    expected = next(batches)
    for allow in (False, True):
        caplog.clear()
        loader = _loader()
        m = _with_loader(tmp_path / "run", loader, allow_pickle=allow)
        try:
            assert m.load() is True and m.load() is True  # twice: warned once
        finally:
            m.close()
        got = next(iter(loader))
        assert torch.equal(got[0]["input"], expected[0]["input"]) and torch.equal(got[1], expected[1])
        warned = [r for r in caplog.records if "allow_pickle=True" in r.getMessage()]
        assert len(warned) == (1 if allow else 0), [r.getMessage() for r in warned]
