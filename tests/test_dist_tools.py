"""The plan the processes of a torchrun job split: balanced by bytes, at 70B scale too; the
job's error handling and the imports' job path, without launching processes."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardckpt.checkpoint.collective import same_error as _same_error
from shardckpt.tools.distributed import Job, job_from_environment, launched
from shardckpt.errors import CollectiveError, ConfigError, IncompatibleLayoutError
from shardckpt.format.dtypes import itemsize
from shardckpt.format.layout import Mesh
from shardckpt.format.manifest import shard_slots
from shardckpt.tools.reshard import target_spec
from shardckpt.tools.split import balance, contiguous_split, shard_bytes
from shardckpt.tools.synth import synth_spec

from testing.ckpts import manifest_from_spec


def test_balance_splits_by_bytes_not_by_count() -> None:
    costs = [90, 10, 10, 10, 10, 10, 10, 10, 10, 10]
    parts = balance(costs, 2)
    assert sorted(i for p in parts for i in p) == list(range(10))
    assert sorted(sum(costs[i] for i in p) for p in parts) == [90, 90]
    assert balance(costs, 2) == parts  # the same split on every process
    # more processes than items: some get nothing
    assert sorted(map(len, balance([5, 5], 4))) == [0, 0, 1, 1]


def test_plan_of_70b_from_1024_to_768_ranks_on_64_processes_is_balanced() -> None:
    """A Llama of 70B parameters (80 blocks) with AdamW state: each of 64 processes reads and
    writes within 5% of the mean."""
    m = manifest_from_spec(synth_spec(70_000_000_000, 1024, 1, 80, 100, 0))
    layout = m.components["model"].layout
    assert len({g.unit for g in layout.groups}) == 81  # 80 blocks and the root
    assert 70e9 < sum(p.numel for p in m.components["model"].layout.params) < 71e9
    t0 = time.perf_counter()
    spec, plans = target_spec(m, Mesh.for_world(768))
    per_shard = shard_bytes(spec, plans)
    parts = balance([r + w for r, w in per_shard], 64)
    elapsed = time.perf_counter() - t0
    reads = [sum(per_shard[i][0] for i in p) for p in parts]
    writes = [sum(per_shard[i][1] for i in p) for p in parts]
    # every target byte of data is read once: the sum of reads is the source's state bytes
    per_elem: dict[str, int] = {}
    for slot in shard_slots(m.components, m.mesh):
        group = slot.name.rsplit(".", 1)[0]
        per_elem[group] = per_elem.get(group, 0) + itemsize(slot.dtype)
    assert sum(reads) == sum(per_elem[g.name] * g.numel for g in layout.groups)
    assert sorted(i for p in parts for i in p) == list(range(768))
    for what, xs in (("read", reads), ("written", writes)):
        mean = statistics.mean(xs)
        worst = max(abs(x - mean) / mean for x in xs)
        assert worst <= 0.05, (what, worst)
    print(f"planned 70B 1024 -> 768 ranks on 64 processes in {elapsed:.2f} s; "
          f"{statistics.mean(reads) / 1e9:.1f} GB read, {statistics.mean(writes) / 1e9:.1f} GB "
          "written per process")


def test_launched_only_with_every_torchrun_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(k, "0")
    assert launched()
    monkeypatch.setenv("SHARDCKPT_DIST", "0")  # a command started inside a training job's worker
    assert not launched()
    monkeypatch.delenv("SHARDCKPT_DIST")
    monkeypatch.delenv("MASTER_PORT")
    assert not launched()


def test_every_process_raises_the_failing_rank_error_with_its_class() -> None:
    same = _same_error(CollectiveError("x", {1: "ConfigError: --to 0: bad", 2: "ConfigError: --to 0: bad"}),
                       "reshard")
    assert type(same) is ConfigError and str(same) == "--to 0: bad"
    mixed = _same_error(CollectiveError("x", {3: "OSError: disk", 1: "IncompatibleLayoutError: no"}),
                        "reshard: writing")
    assert type(mixed) is IncompatibleLayoutError and str(mixed) == "reshard: writing: rank 1: no"
    foreign = _same_error(CollectiveError("x", {0: "ValueError: odd"}), "reshard")
    assert type(foreign) is CollectiveError and "ValueError" in str(foreign)
    lost = CollectiveError("reshard: lost contact with another rank")
    assert _same_error(lost, "reshard") is lost


def test_a_job_of_one_without_a_process_group_runs_locally() -> None:
    job = Job(0, 1)
    assert job.on_root(lambda: {"a": 1}, "x") == {"a": 1}
    with pytest.raises(ConfigError, match="bad"):
        job.agree(lambda: (_ for _ in ()).throw(ConfigError("bad")), "x")


def test_contiguous_split_balances_runs_by_bytes() -> None:
    assert contiguous_split([5, 5, 5, 5, 90, 5, 5], 3) == [range(0, 4), range(4, 5), range(5, 7)]
    assert contiguous_split([1] * 10, 4) == [range(0, 3), range(3, 5), range(5, 8), range(8, 10)]
    assert contiguous_split([], 2) == [range(0, 0), range(0, 0)]


def test_python_dash_m_shardckpt_runs_the_command_without_torch() -> None:
    """``torchrun -m shardckpt`` needs ``python -m shardckpt``; launched plainly it loads no torch."""
    code = ("import runpy, sys; sys.argv = ['shardckpt', '--help']\n"
            "try:\n    runpy.run_module('shardckpt', run_name='__main__')\n"
            "except SystemExit as e:\n    assert e.code in (0, None), e.code\n"
            "assert 'torch' not in sys.modules\nprint('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "reshard" in r.stdout and r.stdout.endswith("ok\n"), r.stderr


def test_a_bad_timeout_is_one_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(k, "1")
    monkeypatch.setenv("SHARDCKPT_DIST_TIMEOUT_S", "soon")
    with pytest.raises(ConfigError, match="SHARDCKPT_DIST_TIMEOUT_S='soon'"):
        with job_from_environment():
            pass


def _hf_folder(path: Path) -> str:
    """A one-file Hugging Face folder of three small tensors."""
    import numpy as np
    from safetensors.numpy import save_file

    path.mkdir()
    rng = np.random.default_rng(1)
    save_file({"model.layers.0.w": rng.standard_normal((7, 5), np.float32),
               "model.layers.1.w": rng.standard_normal(11, np.float32),
               "model.norm.weight": np.ones(5, np.float32)}, str(path / "model.safetensors"))
    return str(path)


def test_an_import_as_a_job_of_one_writes_what_the_import_alone_does(tmp_path: Path) -> None:
    """The job's path of :func:`write_import` (agreement, rank 0's lease and commit) in one
    process without a process group: the same files and manifest as the import alone."""
    from shardckpt.interop.hf.importer import HF
    from shardckpt.interop.importer import ImportOptions
    from shardckpt.tools.jobs import run_import
    from testing.torchrun import contents

    src = _hf_folder(tmp_path / "hf")
    alone = run_import(HF, ImportOptions(src, str(tmp_path / "one"), 3), None)
    as_job = run_import(HF, ImportOptions(src, str(tmp_path / "job"), 3), Job(0, 1))
    assert alone is not None and as_job is not None
    assert len(as_job.files) == 3 and contents(str(tmp_path / "job")) == contents(str(tmp_path / "one"))
    assert sorted(p.name for p in (tmp_path / "job").iterdir()) == sorted(["manifest.json", as_job.save_id])
    with pytest.raises(ConfigError, match="exists; import into an empty location"):
        run_import(HF, ImportOptions(src, str(tmp_path / "job"), 3), Job(0, 1))


def test_an_import_that_does_not_split_runs_on_rank_0_alone() -> None:
    """An importer whose work does not split is run by rank 0 alone, without the job; one that
    splits gets the job; a process other than rank 0 reports no manifest."""
    from dataclasses import dataclass

    from shardckpt.interop.importer import ImportOptions, ImporterConfig, ImportPlan
    from shardckpt.tools.jobs import run_import

    calls: list[tuple[str, Job]] = []

    @dataclass(frozen=True)
    class Fake:
        name: str = "fake"
        Config: type = ImporterConfig
        split: bool = False

        def splits(self, options: ImportOptions) -> bool:
            return self.split

        def plan(self, options: ImportOptions) -> ImportPlan:
            return ImportPlan(options, None, type("Spec", (), {"signing_key": None})(), "fake")  # type: ignore[arg-type]

        def write(self, plan: ImportPlan, job: Job | None = None) -> str:
            calls.append((plan.options.src, job))
            return "manifest"

    assert run_import(Fake(), ImportOptions("a", "x"), Job(0, 1)) == "manifest"  # type: ignore[arg-type]
    assert run_import(Fake(split=True), ImportOptions("b", "x"), Job(0, 1)) == "manifest"  # type: ignore[arg-type]
    assert calls == [("a", Job.single()), ("b", Job(0, 1))]
    assert run_import(Fake(split=True), ImportOptions("c", "x"), Job(1, 2, group=None)) is None  # type: ignore[arg-type]


def test_import_hf_outside_torchrun_loads_no_torch(tmp_path: Path) -> None:
    src = _hf_folder(tmp_path / "hf")
    code = ("import sys\nfrom shardckpt.cli.main import app\n"
            f"sys.argv = ['shardckpt', 'import', 'hf', {src!r}, {str(tmp_path / 'ck')!r}, "
            "'--ranks', '2']\n"
            "try:\n    app()\nexcept SystemExit as e:\n    assert e.code in (0, None), e.code\n"
            "assert 'torch' not in sys.modules\nprint('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.endswith("ok\n"), r.stderr
