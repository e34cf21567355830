"""bench/gpu_check.py: the listing works anywhere, the parity code runs on CPU, and (on a machine
with CUDA) stage-3 parity holds on the device."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.py"


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True,
                          text=True)


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_lists_sections_a_to_f_without_torch():
    res = run_script("--dry-run")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert [c["section"] for c in doc["checks"]] == ["a", "b", "b2", "c", "d", "e", "f"]
    for check in doc["checks"]:
        assert check["name"] and check["measures"] and check["size"] and check["selected"]
    assert doc["sizes"] == "full" and "1.03 B params" in doc["checks"][1]["size"]
    assert doc["torch_imported"] is False


def test_dry_run_honours_only_and_small():
    doc = json.loads(run_script("--dry-run", "--small", "--only", "c,a").stdout)
    assert doc["sizes"] == "small"
    assert [c["section"] for c in doc["checks"] if c["selected"]] == ["a", "c"]
    res = run_script("--dry-run", "--only", "a,x")
    assert res.returncode == 2 and "sections are a, b, b2, c, d, e, f" in res.stderr


def test_a_default_run_reaches_parity_and_the_runtime_sections_within_the_budget():
    """Sections run in RUN_ORDER whatever order --only names them in, and by the script's own
    estimates a default run (--budget-s 420, one GPU) reaches parity, compile, offload and the
    ZeRO++ kernels before the budget could skip anything."""
    gc = load_script()
    assert sorted(gc.RUN_ORDER) == sorted(gc.SECTIONS)
    assert gc.parse_args(["--only", "c,e,a,b2"]).only == ["a", "b2", "e", "c"]
    budget = gc.parse_args([]).budget_s
    spent = 0
    for sid in gc.parse_args([]).only:
        spent += gc.ESTIMATE_S[sid][0]
        if sid in ("a", "b2", "d", "e"):
            assert spent <= budget, (sid, spent, budget)


def test_without_cuda_it_refuses_in_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    res = run_script("--only", "e")
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and "no CUDA device" in res.stderr


def test_parity_section_runs_on_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    res = run_script("--device", "cpu", "--small", "--only", "a", "--no-isolate", "--out",
                     str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads(res.stdout)
    assert json.loads(out.read_text())["sections"] == doc["sections"]
    a = doc["sections"]["a"]
    assert a["status"] == "ok", a
    assert {c["stage"] for c in a["cases"]} == {1, 2, 3}
    assert any(c["accumulation"] == "no_sync" for c in a["cases"])
    assert all(c["equal"] for c in a["cases"]), [c for c in a["cases"] if not c["equal"]]
    assert a["reference_repeatable"] is True


def test_compile_section_runs_on_cpu():
    res = run_script("--device", "cpu", "--small", "--only", "b2", "--no-isolate")
    assert res.returncode == 0, res.stderr[-3000:]
    b2 = json.loads(res.stdout)["sections"]["b2"]
    assert b2["status"] == "ok", b2
    assert "compile" in b2["name"] and b2["settings"]["fsdp2_weights"]["same_weights_as_shardckpt"]
    ours, fsdp2 = b2["results"]["shardckpt"], b2["results"]["fsdp2"]
    assert ours["first_step_dynamo"] == {"graph_breaks": 0, "graphs": 1}  # one graph, both layers
    assert fsdp2["first_step_dynamo"]["graph_breaks"] == 0
    assert ours["recompiled_graphs"] == fsdp2["recompiled_graphs"] == 0
    for row in (ours, fsdp2):
        assert row["median_step_s"] > 0 and row["tokens_per_s"] > 0 and "mfu" in row
    assert b2["ratio_step_time_shardckpt_over_fsdp2"] > 0 and b2["paired_ratio"] > 0
    assert ours["losses"] == pytest.approx(fsdp2["losses"], rel=1e-3)  # same weights, batches


def test_quantization_section_runs_on_cpu(tmp_path):
    """Section e: the fused ZeRO++ kernels against the eager reference in one run (bit-equal on
    CPU), the copy bandwidth they are compared with, and the share of a step spent quantizing."""
    res = run_script("--device", "cpu", "--small", "--only", "e", "--no-isolate")
    assert res.returncode == 0, res.stderr[-3000:]
    e = json.loads(res.stdout)["sections"]["e"]
    assert e["status"] == "ok" and "errors" not in e, e
    assert [c["bits"] for c in e["cases"]] == [8, 4, 8]
    for c in e["cases"]:
        assert c["bit_equal"] and c["within_error_bound_fused"], c
        assert c["quantize_fused_gbs"] > 0 and c["dequantize_eager_gbs"] > 0
        assert c["quantize_fused_over_eager"] > 0 and c["quantize_fused_over_hbm"] is None
    assert e["memory_bandwidth"]["copy_gbs"] > 0 and e["target"]["met"] is None
    for kernel in ("eager", "fused"):
        share = e["step_share"][kernel]
        assert 0 < share["quantization_s_per_step"] < share["median_step_s"] * 2, share
        assert share["quantization_share"] > 0


@pytest.mark.cuda
def test_stage3_parity_on_cuda_world1():
    import torch

    from shardckpt.runtime.mesh import ProcessMesh

    g = load_script()
    cfg = g.llama_config(g.LLAMA_TINY, 8)
    device = torch.device("cuda", 0)
    gen = torch.Generator().manual_seed(7)
    batches = [[torch.randint(0, cfg.vocab_size, (2, 8), generator=gen).to(device)
                for _ in range(2)] for _ in range(2)]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        ref = g._parity_reference(cfg, device, batches, 2, "no_sync")
        engine, losses = g._parity_engine(cfg, ProcessMesh.single(device), 3, batches, 2,
                                          "no_sync")
        result = g._compare(engine, ref, losses)
    assert result["equal"], result


def test_offload_section_runs_on_cpu_old_and_new_paths(tmp_path):
    """Section d on ``--device cpu --small``: the resident run, the pipelined offload, the
    unpipelined one (the old path) and the fused opt-in, with the ratios against resident and
    the host memory against the offloaded state."""
    res = run_script("--device", "cpu", "--small", "--only", "d", "--no-isolate")
    assert res.returncode == 0, res.stderr[-3000:]
    d = json.loads(res.stdout)["sections"]["d"]
    assert d["status"] == "ok", d
    rows = d["results"]
    assert set(rows) == {"resident", "offload_cpu", "offload_cpu_unpipelined",
                         "offload_cpu_fused"}
    assert all(row["median_step_s"] > 0 and "errors" not in row for row in rows.values()), rows
    for key in ("offload_cpu", "offload_cpu_unpipelined", "offload_cpu_fused"):
        assert rows[key]["offloaded_state_gb"] > 0 and rows[key]["pinned_gb"] == 0
        assert rows[key]["host_rss_growth_over_offloaded_state"] is not None
    assert d["host_rss_growth_over_offloaded_state"] is not None
    for key in ("step_time_offload_over_resident", "step_time_offload_unpipelined_over_resident",
                "step_time_offload_fused_over_resident", "step_time_offload_over_unpipelined"):
        assert d[key] > 0, key
    assert d["targets"] == {"step_time_offload_over_resident": 1.5,
                            "host_rss_growth_over_offloaded_state": 1.3}
