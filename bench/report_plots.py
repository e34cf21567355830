"""The plots of ``bench/report.py``: one PNG per figure, each captioned with the machine, the date
and the command (matplotlib, Agg backend); and the markdown tables under them."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def fmt(x: Any, digits: int = 3) -> str:
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return "" if x is None else str(x)


def md_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def machine_line(meta: dict[str, Any]) -> str:
    m = meta["machine"]
    ram = f"{m['ram_gib']} GiB RAM" if m.get("ram_gib") is not None else "RAM unknown"
    return f"{m['cpu']}, {m['cpus']} CPUs, {ram}"


def pairs(rows: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(shardckpt row, FSDP2 row) per precision."""
    by = {}
    for r in rows:
        by.setdefault(r["precision"], {})[r["side"]] = r
    return [(d["shardckpt"], d["fsdp2"]) for d in by.values() if "shardckpt" in d and "fsdp2" in d]


PLOT_TITLES = {
    "throughput": "Throughput against size",
    "rss": "Peak RSS against size",
    "load": "Load time against target world size",
    "train": "Train step time, shardckpt ZeRO-3 / FSDP2",
    "torchrun": "torchrun -m shardckpt reshard: speed-up against processes",
}


def caption(meta: dict[str, Any]) -> str:
    return f"{machine_line(meta)} | {meta['date']} | {meta['command']}"


def _figure(title: str, meta: dict[str, Any], ncols: int = 1):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(6.5 * ncols, 4.6), squeeze=False)
    fig.suptitle(title)
    fig.text(0.5, 0.01, caption(meta), ha="center", va="bottom", fontsize=7, wrap=True)
    return plt, fig, list(axes[0])


def _save(plt, fig, path: Path) -> None:
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _finish(*axes: Any, fontsize: int = 8) -> None:
    """Every plot's axes: y from 0, a legend, a light grid."""
    for ax in axes:
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=fontsize)
        ax.grid(alpha=0.3)


def plot_throughput(res: dict[str, Any], meta: dict[str, Any], path: Path) -> None:
    plt, fig, (a, b) = _figure(PLOT_TITLES["throughput"], meta, 2)
    rs = res.get("reshard", {}).get("rows", [])
    cs = res.get("consolidate", {}).get("rows", [])
    x = [r["size_gb"] for r in rs]
    a.plot(x, [r["reshard_gbps"] for r in rs], "o-", label="shardckpt reshard (command)")
    a.plot(x, [r["size_gb"] / r["reshard_in_process_s"] for r in rs], "o:", label="shardckpt reshard (in-process)")
    a.plot(x, [r["copy_gbps"] for r in rs], "s-", label="cp -r + sync")
    a.set(xlabel="checkpoint size (GB)", ylabel="GB/s", title="reshard 64 -> 16 ranks")
    x = [r["weights_gb"] for r in cs]
    b.plot(x, [r["shardckpt_gbps"] for r in cs], "o-", label="shardckpt consolidate (command)")
    b.plot(x, [r["dcp_gbps"] for r in cs], "s-", label="DCP consolidate_safetensors_files (command)")
    b.plot(x, [r["weights_gb"] / r["shardckpt_call_s"] for r in cs], "o:", label="shardckpt (library call)")
    b.plot(x, [r["weights_gb"] / r["dcp_call_s"] for r in cs], "s:", label="DCP (library call)")
    b.set(xlabel="fp32 weights (GB)", ylabel="GB/s", title="consolidate to safetensors")
    _finish(a, b, fontsize=7)
    _save(plt, fig, path)


def plot_rss(res: dict[str, Any], meta: dict[str, Any], path: Path) -> None:
    plt, fig, (a, b) = _figure(PLOT_TITLES["rss"], meta, 2)
    rs = res.get("reshard", {}).get("rows", [])
    cs = res.get("consolidate", {}).get("rows", [])
    x = [r["size_gb"] for r in rs]
    a.plot(x, [r["reshard_peak_rss_mb"] for r in rs], "o-", label="shardckpt reshard")
    a.plot(x, [r["copy_peak_rss_mb"] for r in rs], "s-", label="cp -r + sync")
    a.set(xlabel="checkpoint size (GB)", ylabel="peak RSS (MB)", title="reshard 64 -> 16 ranks")
    x = [r["weights_gb"] for r in cs]
    b.plot(x, [r["shardckpt_peak_rss_mb"] for r in cs], "o-", label="shardckpt consolidate")
    b.plot(x, [r["dcp_peak_rss_mb"] for r in cs], "s-", label="DCP consolidate")
    b.set(xlabel="fp32 weights (GB)", ylabel="peak RSS (MB)", title="consolidate to safetensors")
    _finish(a, b, fontsize=7)
    _save(plt, fig, path)


def plot_load(res: dict[str, Any], meta: dict[str, Any], path: Path) -> None:
    plt, fig, (a,) = _figure(PLOT_TITLES["load"], meta)
    runs = sorted(res.get("save_load", {}).items(), key=lambda kv: int(kv[0]))
    x = [int(k) for k, _ in runs]
    for key, label, style in (("load_shardckpt", "shardckpt", "o-"), ("load_dcp", "DCP (FS reader)", "s-"),
                              ("load_dcp_sc", "DCP (shardckpt reader)", "^--")):
        a.plot(x, [v["seconds"][key] for _, v in runs], style, label=label)
    a.set(xlabel="ranks that load", ylabel="load time (s)", xticks=x)
    _finish(a)
    _save(plt, fig, path)


def plot_train(res: dict[str, Any], meta: dict[str, Any], path: Path) -> None:
    plt, fig, (a,) = _figure(PLOT_TITLES["train"], meta)
    labels, ratios, paired = [], [], []
    for k, rows in sorted(res.get("train_step", {}).items(), key=lambda kv: int(kv[0])):
        for s, _ in pairs(rows):
            labels.append(f"{k} ranks\n{s['precision']}")
            ratios.append(s["ratio"])
            paired.append(s["paired_ratio"])
    xs = range(len(labels))
    a.bar([i - 0.2 for i in xs], ratios, 0.4, label="median step / FSDP2's")
    a.bar([i + 0.2 for i in xs], paired, 0.4, label="paired steps")
    a.axhline(1.0, color="k", lw=1, ls="--", label="target <= 1.0")
    a.set_xticks(list(xs), labels)
    a.set(ylabel="time ratio (lower is better)")
    a.legend(fontsize=8)
    a.grid(alpha=0.3, axis="y")
    _save(plt, fig, path)


def plot_torchrun(res: dict[str, Any], meta: dict[str, Any], path: Path) -> None:
    plt, fig, (a,) = _figure(PLOT_TITLES["torchrun"], meta)
    rows = res.get("torchrun", {}).get("rows", [])
    x = [r["procs"] for r in rows]
    a.plot(x, [r["speedup"] for r in rows], "o-", label="whole command (with start-up)")
    a.plot(x, [r["in_process_speedup"] for r in rows], "s-", label="reshard alone (reported by the job)")
    a.plot(x, [p / x[0] for p in x] if x else [], "k--", lw=1, label="linear")
    a.set(xlabel="processes (--nproc_per_node)", ylabel=f"speed-up over {x[0] if x else 1}",
          xticks=x)
    a.legend(fontsize=8)
    a.grid(alpha=0.3)
    _save(plt, fig, path)


PLOTS = {"throughput": plot_throughput, "rss": plot_rss, "load": plot_load, "train": plot_train,
         "torchrun": plot_torchrun}
