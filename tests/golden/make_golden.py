"""Write the golden checkpoint of this format version in ``tests/golden/v<MAJOR>_<MINOR>/`` (run once
per version; commit the files as-is). ``v0_1`` was written by format 0.1, ``v1_0`` by 1.0,
``v1_1`` by 1.1.

    python tests/golden/make_golden.py [DST]

(With ``DST``, it writes elsewhere: values are a pure function of the seed, so a fresh copy prints
the same probes, only ``save_id``, ``created_at`` and the file checksums that depend on them differ.)

It refuses to overwrite an existing golden checkpoint: the point of one is that it never changes,
so that later format versions prove they still read what earlier ones wrote. It prints the values that
``tests/test_golden.py`` hard-codes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from shardckpt.checkpoint.reader import CheckpointReader
from shardckpt.format.manifest import VERSION
from shardckpt.tools.synth import synthesize

HERE = Path(__file__).resolve().parent
DST = HERE / f"v{VERSION[0]}_{VERSION[1]}"
PARAMS, RANKS, SEED, STEP, CHUNK = 3000, 2, 1234, 42, 4096
#: (fqn, state kind, first element): 4 fp32 values each. Element 1038 of the embedding straddles the
#: boundary between shard 0 and shard 1 (its group has 1040 elements per shard).
PROBES = [("model.layers.0.self_attn.q_proj.weight", "master", 0),
          ("model.norm.weight", "master", 0),
          ("model.embed_tokens.weight", "exp_avg_sq", 0),
          ("model.embed_tokens.weight", "master", 1038),
          ("model.frozen_scale", "master", 0)]


def element(reader: CheckpointReader, fqn: str, kind: str, start: int, n: int) -> np.ndarray:
    """Elements ``[start, start + n)`` of a parameter's state, wherever the shards put them."""
    layout = reader.manifest.components["model"].layout
    p = layout.param(fqn)
    s = layout.shard_numel(p.group)
    out = []
    for flat in range(p.offset + start, p.offset + start + n):
        shard, off = divmod(flat, s)
        out.append(np.frombuffer(reader.read_state(shard, p.group, kind, off, off + 1), np.float32)[0])
    return np.array(out, np.float32)


def main() -> None:
    dst = Path(sys.argv[1]) if len(sys.argv) > 1 else DST
    if dst.exists():
        sys.exit(f"{dst} exists; the golden checkpoint is written once and never regenerated")
    m = synthesize(str(dst), PARAMS, RANKS, seed=SEED, step=STEP, chunk_size=CHUNK, workers=1)
    r = CheckpointReader(str(dst))
    print("save_id", m.save_id)
    for f in m.files:
        print("file", f.path, f.size, f"{f.crc32c:08x}")
    for fqn, kind, start in PROBES:
        v = element(r, fqn, kind, start, 4)
        print("probe", fqn, kind, start, [float(x) for x in v], [f"{x:08x}" for x in v.view(np.uint32)])
    slot, data = r.read_buffer("model.rotary_emb.inv_freq")
    print("buffer", slot.shape, [float(x) for x in np.frombuffer(data, np.float32)])


if __name__ == "__main__":
    main()
