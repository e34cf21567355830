"""The S3 part of ``bench/report.py``: ``bench/s3.py`` against a local Ceph RGW (moto's S3 where
Ceph is not installed; the report says which), and its table, target rows and plot.

``res["s3"]`` (in ``results.json``) is ``{"server": "ceph" | "moto", "runs": [...]}``, ``runs``
being what ``bench/s3.py --json`` prints: one entry per FROM:TO geometry with its rows.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any
from collections.abc import Callable

HERE = Path(__file__).resolve().parent

#: What ``bench/s3.py`` is given in each mode: about 1 GB checkpoints in full mode, 50 MB quick.
S3_PLANS: dict[str, list[str]] = {
    "full": ["--size", "1.0", "--geometries", "16:4,64:16", "--reps", "3"],
    "quick": ["--size", "0.05", "--geometries", "8:4", "--reps", "1"],
}
S3_TITLE = "S3: save, load, reshard and consolidate against plain s3fs"
#: The speed ratio each operation is held to against its plain-s3fs peer (``bench/s3.py``'s).
S3_TARGET = 0.8
#: shardckpt's row in ``bench/s3.py``'s output -> (operation, its peers: the fastest is compared).
S3_OPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "save S3 (shardckpt)": ("save", ("s3fs upload per rank (save peer)",)),
    "load S3 (shardckpt)": ("load", ("s3fs read per rank (load peer)",)),
    "reshard S3->S3 (shardckpt)": ("reshard", ("streaming s3fs copy S3->S3",)),
    "consolidate S3->local (shardckpt)": ("consolidate", ("s3fs fs.get S3->local + fsync",
                                                          "streaming download S3->local + fsync")),
}
SERVERS = {"ceph": "Ceph RGW on 127.0.0.1 (memstore OSD)",
           "moto": "moto's S3 on 127.0.0.1 (Ceph not installed)"}


def s3_server() -> str:
    """``ceph`` where the gateway ``scripts/ceph-rgw.sh install`` provides is installed, else
    ``moto``."""
    return "ceph" if all(shutil.which(b) for b in ("radosgw", "ceph-mon", "ceph-osd")) else "moto"


def run_s3(mode: str, run_json: Callable[[list[str]], Any]) -> dict[str, Any]:
    """Run ``bench/s3.py`` with the mode's sizes on the server there is."""
    server = s3_server()
    runs = run_json([sys.executable, str(HERE / "s3.py"), *S3_PLANS[mode], "--server", server,
                     "--json"])
    return {"server": server, "runs": runs}


# ----------------------------------------------------------------------------------- pure part


def s3_rows(s3: dict[str, Any] | None) -> list[dict[str, Any]]:
    """One row per operation and geometry: shardckpt's GB/s, its fastest peer's, the ratio
    (the peer's time over shardckpt's: higher is better) and shardckpt's peak RSS. Pure."""
    out = []
    for run in (s3 or {}).get("runs", []):
        by_name = {r["name"]: r for r in run["rows"]}
        for name, (op, peers) in S3_OPS.items():
            row = by_name.get(name)
            found = [by_name[p] for p in peers if p in by_name]
            if row is None or not found:
                continue
            peer = min(found, key=lambda r: r["seconds"])
            geometry = (f"{run['from']} ranks" if op in ("save", "load")
                        else f"{run['from']} -> {run['to']}")
            out.append({"op": op, "geometry": geometry, "size_gb": run["size_gb"],
                        "gbps": row["gbps"], "peer": peer["name"], "peer_gbps": peer["gbps"],
                        "ratio": round(peer["seconds"] / row["seconds"], 3),
                        "rss_mb": row["peak_rss_mb"]})
    return out


def s3_table(s3: dict[str, Any] | None) -> str:
    from report_plots import md_table

    return md_table(["operation", "geometry", "checkpoint GB", "shardckpt GB/s", "peer (plain s3fs)",
                     "peer GB/s", "ratio (speed)", "shardckpt peak RSS MB"],
                    [[r["op"], r["geometry"], r["size_gb"], r["gbps"], r["peer"], r["peer_gbps"],
                      r["ratio"], r["rss_mb"]] for r in s3_rows(s3)])


def s3_targets(s3: dict[str, Any] | None) -> list[tuple[str, float, str, float, str, str]]:
    """(name, value, op, bound, why not met, beside) of each S3 ratio with a target. Pure."""
    out = []
    for r in s3_rows(s3):
        why = (f"{r['gbps']:.3f} GB/s against {r['peer_gbps']:.3f} GB/s for {r['peer']} "
               f"({r['size_gb']:g} GB on {SERVERS.get((s3 or {}).get('server', ''), 'S3')})")
        out.append((f"S3 {r['op']} {r['geometry']} vs plain s3fs (speed)", r["ratio"], ">=",
                     S3_TARGET, why, f"peak RSS {r['rss_mb']:.0f} MB"))
    return out


def s3_note(s3: dict[str, Any]) -> str:
    server = SERVERS.get(s3.get("server", ""), str(s3.get("server")))
    return (f"Server: {server}. A synthetic checkpoint (fp32 masters and AdamW moments) in one "
            "bucket; each operation against plain s3fs moving the same bytes through the same "
            "server: save, one process per rank writing its shard from memory (manifest "
            "committed after) against each uploading it as one object; load, each reading its "
            "shard with checked ranged reads against a whole-object read; reshard S3->S3 against "
            "a streaming copy; consolidate S3->local against the faster of `fs.get` and a "
            "streaming download, fsynced. Save and load are timed inside the job (from a barrier, "
            "without start-up); reshard and consolidate as whole commands. Medians, interleaved; peak "
            "RSS summed over each command's processes (save and load: one per rank).")


def plot_s3(res: dict[str, Any], meta: dict[str, Any], path: Path) -> None:
    from report_plots import _figure, _save

    plt, fig, (a,) = _figure(S3_TITLE, meta)
    rows = s3_rows(res.get("s3"))
    labels = [f"{r['op']}\n{r['geometry']}" for r in rows]
    xs = range(len(rows))
    a.bar([i - 0.2 for i in xs], [r["gbps"] for r in rows], 0.4, label="shardckpt")
    a.bar([i + 0.2 for i in xs], [r["peer_gbps"] for r in rows], 0.4, label="plain s3fs (peer)")
    a.set_xticks(list(xs), labels, fontsize=7)
    server = (res.get("s3") or {}).get("server", "")
    a.set(ylabel="GB/s (higher is better)", title=SERVERS.get(server, server))
    a.legend(fontsize=8)
    a.grid(alpha=0.3, axis="y")
    _save(plt, fig, path)
