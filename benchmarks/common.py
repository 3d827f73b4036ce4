"""Helpers shared by the benchmark scripts: result tables and JSON files."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def print_table(rows: list[dict], title: str = "") -> None:
    if title:
        print(f"\n{title}")
    if not rows:
        print("(no rows)")
        return
    cols = list(rows[0])
    fmt = [(c, max(len(c), *(len(_cell(r.get(c))) for r in rows))) for c in cols]
    print("  ".join(c.rjust(w) for c, w in fmt))
    for r in rows:
        print("  ".join(_cell(r.get(c)).rjust(w) for c, w in fmt))


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{name}.json"
    payload = {
        "benchmark": name,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"platform": platform.platform(), "processor": platform.processor()},
        **payload,
    }
    out.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {out}")
    return out
