"""bench/report.py's pure parts: collected numbers -> tables, verdicts, plots (no benchmark runs)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "bench" / "report.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_report"] = mod
    spec.loader.exec_module(mod)
    return mod


def _save_load(load_ranks: int, load_vs_dcp: float) -> dict:
    return {
        "params": 10_000_000, "ranks": 2, "load_ranks": load_ranks, "reps": 2,
        "seconds": {"save_shardckpt": 0.2, "save_dcp": 1.0, "save_raw": 0.1, "save_dcp_sc": 0.6,
                    "load_shardckpt": 0.2, "load_dcp": 0.2 * load_vs_dcp, "load_dcp_sc": 0.4,
                    "ckpt_sync": 0.12, "ckpt_async_blocking": 0.006},
        "gbps": {"save_shardckpt": 0.6, "save_dcp": 0.12, "save_raw": 1.2},
        "ratios": {"save_vs_dcp": 5.0, "save_vs_raw": 0.5, "load_vs_dcp": load_vs_dcp,
                   "async_blocking_vs_sync": 0.05},
        "load_correct": {"shardckpt": True, "dcp": True, "dcp_sc": True},
    }


def _train(ratio: float) -> list[dict]:
    rows = []
    for precision in ("fp32", "bf16"):
        rows.append({"precision": precision, "side": "shardckpt", "median_s": ratio, "ratio": ratio,
                     "paired_ratio": ratio})
        rows.append({"precision": precision, "side": "fsdp2", "median_s": 1.0, "ratio": 1.0,
                     "paired_ratio": 1.0})
    return rows


def _s3_row(name: str, seconds: float) -> dict:
    return {"name": name, "seconds": seconds, "gbps": round(0.05 / seconds, 3), "ratio": None,
            "ratio_page_cache": None, "peak_rss_mb": 100.0 + seconds, "all_seconds": [seconds]}


def _s3() -> dict:
    """What bench/s3.py prints for one 8:4 geometry, wrapped as report_s3.run_s3 keeps it."""
    rows = [_s3_row(n, t) for n, t in (
        ("reshard S3->S3 (shardckpt)", 2.0), ("streaming s3fs copy S3->S3", 1.0),
        ("server-side fs.copy S3->S3 (reference)", 0.2),
        ("consolidate S3->local (shardckpt)", 1.0), ("s3fs fs.get S3->local", 0.5),
        ("s3fs fs.get S3->local + fsync", 1.6), ("streaming download S3->local + fsync", 1.2),
        ("save S3 (shardckpt)", 0.5), ("s3fs upload per rank (save peer)", 0.45),
        ("load S3 (shardckpt)", 0.25), ("s3fs read per rank (load peer)", 0.25))]
    return {"server": "moto", "runs": [{"server": "moto", "from": 8, "to": 4, "size_gb": 0.05,
                                        "slot_mb": 1.0, "rows": rows}]}


@pytest.fixture
def canned() -> tuple[dict, dict]:
    res = {
        "mode": "quick",
        "plan": {"sizes": [0.25, 0.5]},
        "reshard": {"rows": [
            {"size_gb": 0.26, "reshard_s": 0.8, "copy_s": 0.5, "reshard_gbps": 0.33, "copy_gbps": 0.52,
             "ratio": 0.625, "reshard_in_process_s": 0.3, "ratio_in_process": 1.667,
             "reshard_peak_rss_mb": 60.0, "copy_peak_rss_mb": 4.0},
            {"size_gb": 0.51, "reshard_s": 1.0, "copy_s": 0.8, "reshard_gbps": 0.51, "copy_gbps": 0.64,
             "ratio": 0.8, "reshard_in_process_s": 0.5, "ratio_in_process": 1.6,
             "reshard_peak_rss_mb": 61.0, "copy_peak_rss_mb": 4.0}]},
        "consolidate": {"rows": [
            {"weights_gb": w, "dcp_s": 4.0, "shardckpt_s": 1.0, "ratio": 4.0, "dcp_gbps": w / 4,
             "shardckpt_gbps": w, "dcp_call_s": 1.0, "shardckpt_call_s": c, "call_ratio": 1.0 / c,
             "dcp_peak_rss_mb": 300.0, "shardckpt_peak_rss_mb": 80.0}
            for w, c in ((0.25, 0.25), (0.5, 0.8))]},
        "save_load": {"2": _save_load(2, 0.9), "1": _save_load(1, 3.0)},
        "train_step": {"2": _train(0.9), "4": _train(1.2)},
        "torchrun": {"params": "40M", "from": 64, "to": 16, "bytes": 480_000_000, "reps": 1,
                     "rows": [{"procs": 1, "seconds": 4.0, "speedup": 1.0, "gbps": 0.12,
                               "in_process_s": 1.0, "in_process_speedup": 1.0},
                              {"procs": 2, "seconds": 2.5, "speedup": 1.6, "gbps": 0.19,
                               "in_process_s": 0.8, "in_process_speedup": 1.25}]},
        "s3": _s3(),
        "seconds": {"reshard": 10.0},
    }
    meta = {"machine": {"cpu": "Test CPU", "cpus": 2, "ram_gib": 24.0, "python": "3.11"},
            "command": "python bench/report.py --quick", "date": "2026-01-01 00:00 UTC", "wall_s": 200.0}
    return res, meta


def test_targets_verdicts(report, canned):
    res, _ = canned
    rows = {t["name"]: t for t in report.targets(res)}
    # reshard: only the sizes with a target (0.5 GB here), judged end to end, in-process beside it
    assert [n for n in rows if n.startswith("reshard")] == ["reshard 0.5 GB vs cp -r + sync (speed)"]
    r = rows["reshard 0.5 GB vs cp -r + sync (speed)"]
    assert (r["value"], r["target"], r["met"]) == (0.8, ">= 0.9", False)
    assert "in-process 1.600" in r["beside"]
    assert "0.50 s" in r["why"] and "50%" in r["why"]
    assert rows["consolidate 0.25 GB vs DCP library call (speed)"]["met"] is True
    assert rows["consolidate 0.5 GB vs DCP library call (speed)"]["met"] is False
    assert rows["save vs DCP (speed)"]["met"] is True
    assert rows["save vs raw write (speed)"]["met"] is False
    assert rows["save vs raw write (speed)"]["why"]
    assert rows["async save blocking vs sync save (time)"]["met"] is True
    assert rows["async save blocking vs sync save (time)"]["why"] == ""
    assert rows["load on 1 rank(s) vs DCP (speed)"]["met"] is True
    assert rows["load on 2 rank(s) vs DCP (speed)"]["met"] is False
    assert rows["train step 2 ranks fp32 vs FSDP2 (time)"]["met"] is True
    assert rows["train step 4 ranks bf16 vs FSDP2 (time)"]["met"] is False
    assert rows["train step 4 ranks bf16 vs FSDP2 (time)"]["target"] == "<= 1"


def test_met_boundaries(report):
    assert report._met(0.9, ">=", 0.9) and not report._met(0.899, ">=", 0.9)
    assert report._met(0.1, "<=", 0.1) and not report._met(0.101, "<=", 0.1)


def test_md_table(report):
    text = report.md_table(["a", "b", "c"], [[1, 0.5, True], ["x", None, False]])
    assert text.splitlines() == ["| a | b | c |", "|---|---|---|", "| 1 | 0.500 | yes |", "| x |  | no |"]


def test_markdown(report, canned):
    res, meta = canned
    md = report.render_markdown(res, meta, {"throughput": "bench/throughput.png"})
    assert md.startswith("# Benchmarks (quick run)")
    assert "Test CPU, 2 CPUs, 24.0 GiB RAM" in md
    assert "`python bench/report.py --quick`" in md and "2026-01-01 00:00 UTC" in md
    n = len(report.targets(res))
    met = sum(t["met"] for t in report.targets(res))
    assert f"## Targets ({met} of {n} met)" in md
    assert "![Throughput against size](bench/throughput.png)" in md
    assert "| reshard 0.5 GB vs cp -r + sync (speed) | 0.800 | >= 0.9 | **no** | in-process 1.600 |" in md
    # the load table lists world sizes in order, and the speed-up table has both process counts
    assert md.index("| 1 | 0.200 | 0.600 |") < md.index("| 2 | 0.200 | 0.180 |")
    assert "| 2 | 2.500 | 1.600 | 0.190 | 0.800 | 1.250 |" in md
    for title in report.PLOT_TITLES.values():
        assert f"{title}" in md


def test_plot_is_png(report, canned, tmp_path):
    pytest.importorskip("matplotlib")
    res, meta = canned
    import report_s3

    for name, fn in [*report.PLOTS.items(), ("s3", report_s3.plot_s3)]:
        path = tmp_path / f"{name}.png"
        fn(res, meta, path)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_write_report(report, canned, tmp_path):
    pytest.importorskip("matplotlib")
    res, meta = canned
    md = report.write_report(res, meta, tmp_path)
    text = md.read_text()
    names = [*report.PLOTS, "s3"]
    assert sorted(p.name for p in (tmp_path / "bench").iterdir()) == sorted(f"{n}.png" for n in names)
    assert all(f"(bench/{n}.png)" in text for n in names)


def test_write_report_keeps_the_hand_written_part(report, canned, tmp_path):
    """docs/benchmarks.md opens with prose written by hand: a new report replaces only what
    follows the marker line, and becomes the page's last section."""
    pytest.importorskip("matplotlib")
    res, meta = canned
    marker = "<!-- bench/report.py writes everything below this line and keeps what is above it -->"
    prose = f"# Benchmarks\n\nWritten by hand.\n\n{marker}\n\nold report\n"
    (tmp_path / "benchmarks.md").write_text(prose)
    for _ in range(2):  # and again: nothing of the first report stays
        text = report.write_report(res, meta, tmp_path).read_text()
        assert text.startswith(prose.removesuffix("old report\n"))
        assert "old report" not in text and text.count("# The full report") == 1
        assert text.count("\n# Benchmarks") == 0 and text.count(marker) == 1


def test_parse_json_output(report):
    import report_run  # beside bench/report.py, which put its folder on the path

    assert report_run.parse_json_output('note\n{"a": [1]}\n') == {"a": [1]}
    assert report_run.parse_json_output('[{"x": 1}]') == [{"x": 1}]
    with pytest.raises(ValueError):
        report_run.parse_json_output("nothing")


def test_s3_rows_compare_each_operation_with_its_fastest_peer(report):
    import report_s3

    rows = {r["op"]: r for r in report_s3.s3_rows(_s3())}
    assert list(rows) == ["save", "load", "reshard", "consolidate"]
    assert rows["reshard"]["ratio"] == 0.5 and rows["reshard"]["geometry"] == "8 -> 4"
    # consolidate against the faster of the two durable downloads (1.2 s), not the cached one
    assert rows["consolidate"]["peer"] == "streaming download S3->local + fsync"
    assert rows["consolidate"]["ratio"] == 1.2
    assert rows["save"]["geometry"] == "8 ranks" and rows["save"]["ratio"] == 0.9
    assert report_s3.s3_rows(None) == [] and report_s3.s3_rows({"server": "ceph", "runs": []}) == []


def test_s3_verdicts_table_and_section(report, canned):
    res, meta = canned
    rows = {t["name"]: t for t in report.targets(res)}
    assert rows["S3 reshard 8 -> 4 vs plain s3fs (speed)"]["met"] is False
    assert "moto" in rows["S3 reshard 8 -> 4 vs plain s3fs (speed)"]["why"]
    assert rows["S3 consolidate 8 -> 4 vs plain s3fs (speed)"]["met"] is True
    assert rows["S3 save 8 ranks vs plain s3fs (speed)"]["target"] == ">= 0.8"
    assert rows["S3 load 8 ranks vs plain s3fs (speed)"]["met"] is True
    md = report.render_markdown(res, meta, {"s3": "bench/s3.png"})
    import report_s3

    title = f"## {len(report.PLOTS) + 1}. {report_s3.S3_TITLE}"
    assert title in md and f"![{report_s3.S3_TITLE}](bench/s3.png)" in md
    assert "Ceph not installed" in md
    assert ("| reshard | 8 -> 4 | 0.050 | 0.025 | streaming s3fs copy S3->S3 | 0.050 | 0.500 | "
            "102.000 |") in md
    del res["s3"]  # a report without S3 numbers has no S3 section and no S3 targets
    assert report_s3.S3_TITLE not in report.render_markdown(res, meta, {})
    assert not [t for t in report.targets(res) if t["name"].startswith("S3 ")]
