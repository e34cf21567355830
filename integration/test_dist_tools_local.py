"""The offline tools under torchrun: 1, 2, 3 and 4 gloo processes on 127.0.0.1 give the same bytes
as the single-process command (reshard, consolidate, verify, diff, and the imports from Hugging
Face, DeepSpeed and DCP); a process killed mid-run fails the job, commits nothing, and a rerun
succeeds.

One torchrun job per process count runs that count's commands one after another
(:func:`testing.save_runs.torchrun_commands`), shared by every test here (module-scoped): the
2-process job runs the reshard, verify, diff, the three imports, the rerun after its root was
killed and, last, the reshard that fails on purpose. The jobs killed mid-run are torchrun jobs of
``-m shardckpt`` of their own. The single-process commands run in this process.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from shardckpt.checkpoint.verify import verify
from shardckpt.format.manifest import MANIFEST_NAME
from shardckpt.tools.synth import synthesize
from testing.cli import cli
from testing.save_runs import CommandRun, torchrun_commands
from testing.torchrun import contents, kill_when, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "deepspeed"
IMPORTS = ("hf", "deepspeed", "dcp")


def _damage(path: str, at: int) -> None:
    data = bytearray(Path(path).read_bytes())
    data[at] ^= 0xFF
    Path(path).write_bytes(bytes(data))


def _manifest(ckpt: str) -> dict[str, Any]:
    return json.loads(Path(ckpt, MANIFEST_NAME).read_text())


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dist")


@pytest.fixture(scope="module")
def src(work: Path) -> str:
    path = str(work / "src")
    synthesize(path, 300_000, ranks=4, units=3, seed=5)
    return path


@pytest.fixture(scope="module")
def reference(src: str, work: Path) -> dict[str, Any]:
    out = str(work / "ref")
    r = cli("reshard", src, out, "--to", "6")
    assert r.exit_code == 0, r.output
    return contents(out)


@pytest.fixture(scope="module")
def hf_src(src: str, work: Path) -> str:
    """A Hugging Face folder of several safetensors files and an index: ``src`` consolidated."""
    out = str(work / "hf")
    r = cli("consolidate", src, out, "--max-shard-size", "300KB")
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture(scope="module")
def dcp_src(work: Path) -> str:
    """A stock DCP checkpoint of a model (two blocks, a buffer) and AdamW after one step."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(3)
    m = torch.nn.Module()
    m.layers = torch.nn.ModuleList([torch.nn.Linear(40, 40) for _ in range(2)])
    m.head = torch.nn.Linear(40, 9)
    m.register_buffer("pos", torch.arange(5.0))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x = torch.randn(3, 40)
    m.head(m.layers[1](m.layers[0](x))).pow(2).sum().backward()
    opt.step()
    msd, osd = get_state_dict(m, opt)
    path = str(work / "dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    return path


def _import_source(kind: str, hf_src: str, dcp_src: str) -> str:
    return {"hf": hf_src, "deepspeed": str(FIXTURES / "zero2-bf16-3"), "dcp": dcp_src}[kind]


@pytest.fixture(scope="module")
def killed(work: Path) -> dict[int, dict[str, Any]]:
    """``reshard`` of ~50 MB by 2 processes, process ``victim`` SIGKILLed once both write (for
    victim 0 and 1, each into its own destination): what the job left."""
    big = str(work / "big")
    synthesize(big, 4_000_000, ranks=4, units=4)  # ~50 MB
    out = {}
    for victim in (0, 1):
        dst = str(work / f"killed-{victim}")
        proc = torchrun(2, "reshard", big, dst, "--to", "8", "--buffer", "64KiB", wait=False)

        def both_writing(dst: str = dst) -> bool:
            return len([f for _, _, fs in os.walk(dst) for f in fs if f.startswith("shard-")]) >= 3
        pid, err = kill_when(proc, both_writing, victim)
        out[victim] = {"src": big, "dst": dst, "killed": pid, "returncode": proc.returncode,
                       "stderr": err, "manifest": os.path.exists(os.path.join(dst, MANIFEST_NAME)),
                       "verified": bool(verify(dst))}
    return out


@pytest.fixture(scope="module")
def runs(work: Path, src: str, hf_src: str, dcp_src: str,
         killed: dict[int, dict[str, Any]]) -> dict[tuple[int, str], CommandRun]:
    """(processes, name) -> the command's run in the torchrun job of that many processes."""
    # the last source shard damaged: only the process writing the last target shards reads it
    bad_write = str(work / "bad-write")
    shutil.copytree(src, bad_write)
    last = [f for f in _manifest(bad_write)["files"] if f["role"] == "shard"][-1]
    _damage(os.path.join(bad_write, last["path"]), -100)
    # one damaged file for each of two processes
    bad_verify = str(work / "bad-verify")
    shutil.copytree(src, bad_verify)
    m = _manifest(bad_verify)
    for f in (m["files"][1], m["files"][3]):
        _damage(os.path.join(bad_verify, f["path"]), -5)
    other = str(work / "other")
    synthesize(other, 300_000, ranks=2, units=3, seed=6)

    def reshard(n: int) -> list[str]:
        return ["reshard", src, str(work / f"reshard-{n}"), "--to", "6"]

    plans: dict[int, dict[str, list[str]]] = {
        1: {"reshard": reshard(1)},
        2: {"reshard": reshard(2),
            "verify": ["verify", bad_verify, "--json"],
            "diff": ["diff", src, other, "--json"],
            **{f"import-{k}": ["import", k, _import_source(k, hf_src, dcp_src),
                               str(work / f"import-{k}"), "--ranks", "4", "--json"]
               for k in IMPORTS},
            # the rerun of the job whose root (rank 0) was killed, as a job
            "rerun": ["reshard", killed[0]["src"], killed[0]["dst"], "--to", "8", "--overwrite"],
            # fails on purpose: last
            "bad-write": ["reshard", bad_write, str(work / "bad-write-dst"), "--to", "6"]},
        3: {"consolidate": ["consolidate", src, str(work / "consolidate-3"),
                            "--max-shard-size", "300KB", "--optimizer"]},
        4: {"reshard": reshard(4)},
    }
    out = {}
    for n, plan in plans.items():
        for name, run in zip(plan, torchrun_commands(n, list(plan.values())), strict=True):
            out[n, name] = run
    return out


def _ok(run: CommandRun) -> None:
    assert run.codes == [0] * len(run.codes), run.describe()


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_reshard_under_torchrun_equals_one_process(runs: dict, reference: dict[str, Any],
                                                   work: Path, nproc: int) -> None:
    r = runs[nproc, "reshard"]
    _ok(r)
    dst = str(work / f"reshard-{nproc}")
    assert r.stdout.count("resharded ") == 1, r.stdout  # rank 0 reports, once
    assert verify(dst), verify(dst).problems
    assert contents(dst) == reference
    # the attempt's lease went with the commit: only the manifest and the save directory remain
    m = _manifest(dst)
    assert sorted(os.listdir(dst)) == sorted([MANIFEST_NAME, m["save_id"]])
    assert not [f for f in os.listdir(Path(dst, m["save_id"])) if f.startswith(".lease-")]


def test_a_write_failing_on_one_process_fails_every_process_and_leaves_nothing(
        runs: dict, work: Path) -> None:
    """The last source shard is damaged: only the process writing the last target shards reads
    it, yet every process fails with its error, and the attempt's files are removed."""
    r = runs[2, "bad-write"]
    last = [f for f in _manifest(str(work / "bad-write"))["files"] if f["role"] == "shard"][-1]
    damaged = last["path"].split("/")[-1]
    assert all(c != 0 for c in r.codes), r.describe()
    assert not any(r.errors), r.describe()
    errs = [line for line in r.stderr.splitlines() if "error: " in line]
    assert len(errs) == 2 and all(damaged in e for e in errs), r.stderr[-3000:]
    dst = work / "bad-write-dst"
    assert not dst.exists() or os.listdir(dst) == []


@pytest.mark.parametrize("victim", [0, 1])
def test_sigkill_of_a_process_commits_nothing_and_a_rerun_succeeds(
        killed: dict[int, dict[str, Any]], runs: dict, victim: int) -> None:
    k = killed[victim]
    assert k["killed"] is not None, "the job finished before a process could be killed; make it bigger"
    assert k["returncode"] != 0, k["stderr"][-3000:]
    assert not k["manifest"]
    assert not k["verified"]
    # the rerun: as a job where the job's root was killed, else on its own
    if victim == 0:
        _ok(runs[2, "rerun"])
    else:
        r = cli("reshard", k["src"], k["dst"], "--to", "8", "--overwrite")
        assert r.exit_code == 0, r.output
    result = verify(k["dst"])
    assert result, result.problems
    # the killed attempt's directory went with the rerun (its lease's writer is gone)
    assert sorted(os.listdir(k["dst"])) == sorted([MANIFEST_NAME, result.manifest.save_id])


def tree(path: str) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(Path(path).rglob("*")) if p.is_file()}


def test_consolidate_under_torchrun_equals_one_process(runs: dict, work: Path, src: str) -> None:
    one, job = str(work / "consolidate-1"), str(work / "consolidate-3")
    r = cli("consolidate", src, one, "--max-shard-size", "300KB", "--optimizer")
    assert r.exit_code == 0, r.output
    r3 = runs[3, "consolidate"]
    _ok(r3)
    assert r3.stdout.count("consolidated ") == 1, r3.stdout
    out = tree(job)
    assert len([n for n in out if n.endswith(".safetensors")]) >= 4  # split over the processes
    assert out == tree(one)


def test_verify_under_torchrun_reports_what_one_process_does(runs: dict) -> None:
    r = runs[2, "verify"]
    one = cli(*r.args)
    assert one.exit_code == 1
    assert all(c != 0 for c in r.codes), r.describe()
    assert json.loads(r.stdout) == json.loads(one.stdout)
    assert len(json.loads(r.stdout)["problems"]) == 2


def test_diff_under_torchrun_reports_what_one_process_does(runs: dict) -> None:
    r = runs[2, "diff"]
    one = cli(*r.args)
    assert one.exit_code == 1, one.output
    assert all(c != 0 for c in r.codes), r.describe()
    a, b = json.loads(one.stdout), json.loads(r.stdout)
    for doc in (a, b):  # time, and bytes read (whole checksum chunks, per process) differ
        doc.pop("seconds"), doc.pop("bytes_read")
    assert a == b and a["differences"]


# ------------------------------------------------------------------------------------ import


def _import_alone(kind: str, source: str, dst: str) -> None:
    if kind == "hf":
        from shardckpt.interop.hf.import_ import import_hf

        import_hf(source, dst, 4)
    elif kind == "deepspeed":
        from shardckpt.interop.deepspeed.import_ import import_deepspeed

        import_deepspeed(source, dst, 4)
    else:
        from shardckpt.interop.dcp.to_flat import import_dcp_flat

        import_dcp_flat(source, dst, 4)


@pytest.mark.parametrize("kind", IMPORTS)
def test_import_under_torchrun_equals_one_process(tmp_path: Path, runs: dict, work: Path,
                                                  kind: str, hf_src: str, dcp_src: str) -> None:
    """Two processes write the shard files of ``import KIND SRC DST --ranks 4`` between them:
    the same manifest (save id and time apart) and the same bytes as the import alone."""
    one, job = str(tmp_path / "one"), str(work / f"import-{kind}")
    _import_alone(kind, _import_source(kind, hf_src, dcp_src), one)
    r = runs[2, f"import-{kind}"]
    _ok(r)
    summary = json.loads(r.stdout)  # rank 0 reports, once
    assert summary["destination"] == job and summary["ranks"] == 4
    assert contents(job) == contents(one)
    m = _manifest(job)
    assert sorted(os.listdir(job)) == sorted([MANIFEST_NAME, m["save_id"]])  # lease released
    assert verify(job), verify(job).problems


def test_sigkill_of_a_process_mid_import_commits_nothing(tmp_path: Path) -> None:
    """``import hf`` of 32 MiB into 8 shard files: the second process is killed once a first
    target file is there; the job fails and no manifest is written."""
    import numpy as np
    from safetensors.numpy import save_file

    source, dst = tmp_path / "hf", str(tmp_path / "dst")
    source.mkdir()
    rng = np.random.default_rng(0)
    weight_map = {}
    for f in range(2):  # 2 files x 4 tensors of 4 MiB
        names = [f"model.layers.{4 * f + i}.w" for i in range(4)]
        save_file({n: rng.standard_normal(1 << 20, np.float32) for n in names},
                  str(source / f"model-{f}.safetensors"))
        weight_map.update({n: f"model-{f}.safetensors" for n in names})
    (source / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 32 << 20}, "weight_map": weight_map}))
    proc = torchrun(2, "import", "hf", str(source), dst, "--ranks", "8", "--buffer", "64KiB",
                    wait=False)

    def writing() -> bool:  # mid-write: a first target file is there
        return any(f.startswith("shard-") for _, _, fs in os.walk(dst) for f in fs)
    killed, err = kill_when(proc, writing, 1)
    assert killed is not None, "the job finished before a process could be killed; make it bigger"
    assert proc.returncode != 0, err[-3000:]
    assert not os.path.exists(os.path.join(dst, MANIFEST_NAME))
    assert not verify(dst)
