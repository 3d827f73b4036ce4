"""A real Prometheus scraping local pdpool processes, and the Grafana dashboard's queries
asked of it: for the dashboard test (tests/sidecar/test_e2e_observability.py) and the
docs' rendering of the panels (devtools/dashboard_png.py).

The binary is built by scripts/prometheus/build-prometheus.sh into a cache outside the
repository ($PDPOOL_PROMETHEUS_BIN, a folder, else ~/.cache/pdpool/prometheus-bin)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Optional

import httpx

from pdpool.ports import free_port

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "charts" / "pdpool-operator" / "dashboards" / "pdpool.json"
# Grafana's variables, as the panels are asked outside Grafana: every pool, a rate window
# that holds several 1-second scrapes.
VARIABLES = {"$__rate_interval": "30s", "$pool": ".*"}


def prometheus_binary() -> Optional[Path]:
    folder = os.environ.get("PDPOOL_PROMETHEUS_BIN") or os.path.join(
        os.path.expanduser("~"), ".cache", "pdpool", "prometheus-bin"
    )
    path = Path(folder) / "prometheus"
    return path if os.access(path, os.X_OK) else None


def panel_queries(dashboard: Path = DASHBOARD) -> list[tuple[str, str, str]]:
    """(panel title, legend, PromQL with Grafana's variables filled in) of every target."""
    doc = json.loads(dashboard.read_text())
    out = []
    for panel in doc["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for name, value in VARIABLES.items():
                expr = expr.replace(name, value)
            out.append((panel["title"], target.get("legendFormat", ""), expr))
    return out


class Prometheus:
    """A Prometheus server scraping `targets` ({job: [host:port, ...]}) every second, with
    its data in `folder`; stop() ends it."""

    def __init__(self, binary: Path, folder: Path, targets: dict[str, list[str]]) -> None:
        self.port = free_port()
        folder.mkdir(parents=True, exist_ok=True)
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": hosts}]}
                for job, hosts in targets.items()
            ],
        }
        (folder / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self.log = open(folder / "prometheus.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                str(binary),
                f"--config.file={folder / 'prometheus.yml'}",
                f"--storage.tsdb.path={folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/-/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError("prometheus not ready")

    def wait_targets_up(self, count: int, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if len(self.query("up == 1")) >= count:
                return
            time.sleep(0.5)
        raise TimeoutError(f"fewer than {count} scrape targets up")

    def query(self, expr: str, at: Optional[float] = None) -> list[dict[str, Any]]:
        """An instant query's result (ValueError when Prometheus refuses the query)."""
        params = {"query": expr, "time": str(at if at is not None else time.time())}
        body = httpx.get(self.url + "/api/v1/query", params=params, timeout=10).json()
        if body.get("status") != "success":
            raise ValueError(f"{expr}: {body.get('error')}")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        params = {"query": expr, "start": str(start), "end": str(end), "step": str(step)}
        body = httpx.get(self.url + "/api/v1/query_range", params=params, timeout=30).json()
        if body.get("status") != "success":
            raise ValueError(f"{expr}: {body.get('error')}")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.log.close()


def scrape_targets(topology: Any) -> dict[str, list[str]]:
    """Every child of a pdpool.up Topology, by role."""
    targets: dict[str, list[str]] = {}
    for child in topology.children:
        targets.setdefault(child.role, []).append(f"127.0.0.1:{child.port}")
    return targets


# Flow control on, so the per-tenant panels have data: a tenant the load runs as, one
# limited to a token a minute (its requests are shed with 429), and a pool bound of one
# request in flight per backend (the load's concurrent clients queue).
TENANT_KEY, LIMITED_KEY = "observability-load-key-0001", "observability-limited-key-01"
TENANTS = {
    "tenants": [
        {"name": "load", "keys": [TENANT_KEY]},
        {"name": "limited", "keys": [LIMITED_KEY], "tokensPerMinute": 1},
    ],
    "pool": {"maxInFlightPerBackend": 1},
}


def write_tenants(path: Path) -> str:
    path.write_text(json.dumps(TENANTS))  # JSON is YAML
    return str(path)


def auth(key: str = TENANT_KEY) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def shed_one(gateway_url: str, model: str) -> int:
    """One request of the limited tenant: its status (429 when shed)."""
    body = {"model": model, "prompt": "over the limit " * 8, "max_tokens": 4}
    r = httpx.post(gateway_url + "/v1/completions", json=body, headers=auth(LIMITED_KEY))
    return r.status_code


def run_load(
    gateway_url: str, model: str, workers: int = 3, per_worker: int = 6, tag: str = ""
) -> None:
    """A little of everything the dashboard shows: cold prompts (decode-first rejected,
    then P/D), warm ones (decode alone, prefix hits), streams (TTFT, phases) and whole
    answers, from a few clients at once. `tag` makes this round's cold prompts new."""
    from concurrent.futures import ThreadPoolExecutor

    def work(w: int) -> None:
        with httpx.Client(timeout=120, headers=auth()) as c:
            for i in range(per_worker):
                cold = i % 2 == 0
                prompt = (f"load {tag}{w}-{i} cold words " if cold else f"warm prefix {w} ") * 12
                body = {"model": model, "prompt": prompt, "max_tokens": 6, "stream": i % 3 != 2}
                c.post(gateway_url + "/v1/completions", json=body).raise_for_status()

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(work, range(workers)))
