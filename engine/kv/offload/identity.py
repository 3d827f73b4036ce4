"""A digest of a checkpoint's identity, for the KV fingerprint (keys.py).

Reading every weight would cost minutes on a large model at each start, so the digest
covers config.json whole, and of each weight file its name, size and the first and last
MiB (where safetensors keep their header and the last tensors): two revisions of a model
differ there in practice, and a retrained checkpoint of the same shape does too. A HF
snapshot's revision, when the folder is one (`.../snapshots/<revision>/`), is taken as well.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

EDGE_BYTES = 1 << 20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


def weights_digest(model_dir: str | Path) -> str:
    path = Path(model_dir)
    h = hashlib.sha256()
    h.update((path / "config.json").read_bytes())
    if path.resolve().parent.name == "snapshots":
        h.update(b"revision:" + path.resolve().name.encode())
    for f in sorted(p for p in path.iterdir() if p.name.endswith(WEIGHT_SUFFIXES)):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(EDGE_BYTES))
            if size > 2 * EDGE_BYTES:
                fh.seek(size - EDGE_BYTES)
                h.update(fh.read(EDGE_BYTES))
            elif size > EDGE_BYTES:
                h.update(fh.read())
    return h.hexdigest()
