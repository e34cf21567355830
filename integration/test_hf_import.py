"""``shardckpt import hf`` streams: a 2 GB Hugging Face folder is imported with peak RSS under
512 MB and without importing torch; reading the result back gives the source's bytes.

The peak is the importing process's ``VmHWM`` (measured by the kernel, not by shardckpt). Not
``ru_maxrss``: Linux carries into it the RSS of the image replaced by ``exec``, so a child of a
pytest process that has imported torch reports the parent's few hundred MB.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

GB = 1 << 30


def write_big(folder: Path, total: int, files: int = 4, tensors_per_file: int = 4) -> dict[str, tuple]:
    """fp32 tensors named like a decoder's, written piecewise (never held whole)."""
    folder.mkdir(parents=True)
    per = total // (files * tensors_per_file) // 4 // 1024 * 1024
    weight_map, layout = {}, {}
    k = 0
    for i in range(files):
        fname = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        header, pos = {}, 0
        names = []
        for _ in range(tensors_per_file):
            name = f"model.layers.{k}.mlp.up_proj.weight"
            header[name] = {"dtype": "F32", "shape": [per // 1024, 1024],
                            "data_offsets": [pos, pos + per * 4]}
            pos += per * 4
            names.append(name)
            layout[name] = (fname, k)
            weight_map[name] = fname
            k += 1
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        with open(folder / fname, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
            for name in names:
                seed = layout[name][1]
                for a in range(0, per, 1 << 22):
                    n = min(1 << 22, per - a)
                    f.write((np.arange(a, a + n).astype(np.float32) * np.float32(seed + 1)).tobytes())
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "tie_word_embeddings": False}))
    return {"per": per}


def test_import_of_two_gigabytes_stays_under_512_mb(tmp_path: Path) -> None:
    src, dst = tmp_path / "hf", tmp_path / "ck"
    info = write_big(src, 2 * GB)
    code = (
        "import sys, json\n"
        "from shardckpt.interop.hf.import_ import import_hf\n"
        f"import_hf({str(src)!r}, {str(dst)!r}, 4)\n"
        "hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM:'))\n"
        "print(json.dumps({'peak_kb': int(hwm.split()[1]), 'torch': 'torch' in sys.modules}))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert not out["torch"]
    print(f"import hf of 2 GB: peak RSS {out['peak_kb'] / 1024:.0f} MB")
    assert out["peak_kb"] * 1024 < 512 * 2**20, f"peak RSS {out['peak_kb'] / 1024:.0f} MB"

    from shardckpt.checkpoint.reader import CheckpointReader

    reader = CheckpointReader(str(dst))
    layout = reader.manifest.components["model"].layout
    per = info["per"]
    for name in ("model.layers.0.mlp.up_proj.weight", "model.layers.15.mlp.up_proj.weight"):
        p = layout.param(name)
        s = layout.shard_numel(p.group)
        seed = int(name.split(".")[2])
        for elem in (0, per // 2 + 7, per - 1):  # spot checks on different shards
            flat = p.offset + elem
            got = np.frombuffer(reader.read_state(flat // s, p.group, "master", flat % s,
                                                  flat % s + 1), np.float32)[0]
            assert got == np.float32(elem) * np.float32(seed + 1), (name, elem)
