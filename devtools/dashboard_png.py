"""Renders the Grafana dashboard's panels to one PNG, from a real Prometheus scraping a live
`pdpool up` under a little load: Grafana itself is not packaged here, so matplotlib draws
what each panel's queries return (docs/images/dashboard.png).

    scripts/prometheus/build-prometheus.sh      # once: the Prometheus binary
    python devtools/dashboard_png.py [--out docs/images/dashboard.png] [--seconds 60]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from devtools.prometheus_run import (
    DASHBOARD,
    VARIABLES,
    Prometheus,
    auth,
    prometheus_binary,
    run_load,
    scrape_targets,
    shed_one,
    write_tenants,
)
from pdpool.up.topology import SIDE_BY_SIDE, Topology, TopologySpec, ensure_tiny_model


def legend(fmt: str, labels: dict[str, str]) -> str:
    out = fmt
    for key, value in labels.items():
        out = out.replace("{{" + key + "}}", value)
    return out


def render(prom: Prometheus, start: float, end: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = json.loads(DASHBOARD.read_text())["panels"]
    cols = 4
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows))
    for ax, panel in zip(axes.flat, panels, strict=False):
        for target in panel["targets"]:
            expr = target["expr"]
            for name, value in VARIABLES.items():
                expr = expr.replace(name, value)
            for series in prom.query_range(expr, start, end, step=2):
                points = [(float(t) - start, float(v)) for t, v in series["values"]]
                points = [(t, v) for t, v in points if math.isfinite(v)]
                if points:
                    xs, ys = zip(*points, strict=True)
                    label = legend(target.get("legendFormat", ""), series["metric"])
                    ax.plot(xs, ys, label=label[:40])
        ax.set_title(panel["title"], fontsize=9)
        ax.set_xlabel("s", fontsize=7)
        ax.tick_params(labelsize=7)
        ax.text(
            0.99, 0.97, panel["fieldConfig"]["defaults"].get("unit", ""),
            transform=ax.transAxes, ha="right", va="top", fontsize=7, color="gray",
        )  # fmt: skip
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, loc="upper left")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(
        "pdpool dashboard panels (Prometheus query_range, drawn with matplotlib; "
        "Grafana is not packaged here)",
        fontsize=11,
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/images/dashboard.png")
    ap.add_argument("--seconds", type=float, default=60.0, help="how long the load runs")
    args = ap.parse_args()
    binary = prometheus_binary()
    if binary is None:
        print("no Prometheus binary: run scripts/prometheus/build-prometheus.sh", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="pdpool-dashboard-"))
    spec = TopologySpec(
        model=ensure_tiny_model("qwen3"),
        log_dir=str(work / "logs"),
        engine_args=["--max-model-len", "2048", "--num-kv-blocks", "512"],
        tenants_file=write_tenants(work / "tenants.yaml"),
        **SIDE_BY_SIDE,
    )
    topo = Topology(spec)
    topo.start(240)
    prom = Prometheus(binary, work / "prometheus", scrape_targets(topo))
    try:
        prom.wait_ready()
        prom.wait_targets_up(len(topo.children))
        model = httpx.get(topo.gateway.url + "/v1/models", headers=auth()).json()["data"][0]["id"]
        start, rounds = time.time(), 0
        while time.time() - start < args.seconds:
            run_load(topo.gateway.url, model, tag=f"r{rounds}-")
            shed_one(topo.gateway.url, model)
            rounds += 1
        time.sleep(5)
        render(prom, start - 10, time.time(), Path(args.out))
    finally:
        prom.stop()
        topo.stop()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
