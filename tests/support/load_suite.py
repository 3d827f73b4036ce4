"""Helpers of the load suite (tests/load): its limits, a restartable `pdpool serve`, and
the mix for a server."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx

from devtools.load_mix import MixSpec, Unit, run_units
from devtools.load_targets import ServeTarget, UpTarget, max_model_len, served_model
from pdpool.engine.config import EngineConfig
from pdpool.engine.connector.loads import HANDSHAKE_TIMEOUT_S
from pdpool.engine.kv.leases import longest_hold_s

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}

# A killed engine core comes back within 30 s, plus the time a core takes to start here.
RECOVERY_LIMIT_S = 30.0 + 30.0
# How much one process may grow over a test (the 10 MB prompt's tokens pass through).
MEMORY_GROWTH_LIMIT = 768 << 20
# P/D leases on default flags end within this, even when their consumer died mid-read
# (plus the engine's idle tick and a loaded machine's delays).
BLOCKS_IDLE_WAIT_S = (
    longest_hold_s(
        _DEFAULTS["kv_producer_timeout"],
        _DEFAULTS["kv_load_timeout"],
        _DEFAULTS["kv_load_timeout"] + HANDSHAKE_TIMEOUT_S,
    )
    + 5.0
)


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


class ServeHolder:
    """One `pdpool serve` for a module; a test that finds it unhealthy gets a new one."""

    def __init__(self, model: str, log_dir):
        self.model, self.log_dir = model, log_dir
        self.target: ServeTarget | None = None

    def get(self) -> ServeTarget:
        if self.target is not None and not healthy(self.target.url):
            self.target.stop()
            self.target = None
        if self.target is None:
            self.target = ServeTarget(self.model, self.log_dir).start()
        return self.target

    def stop(self) -> None:
        if self.target is not None:
            self.target.stop()


class UpHolder:
    """One `pdpool up --prefill 1 --decode 2` for a module (a small KV pool per engine: three
    engines on 2 cores); a test that finds an engine or the gateway unhealthy gets a new one."""

    def __init__(self, model: str, log_dir):
        self.model, self.log_dir = model, log_dir
        self.target: UpTarget | None = None
        self.started = 0

    def whole(self) -> bool:
        assert self.target is not None
        urls = [self.target.url] + [n.url for n in self.target.engines()]
        return all(healthy(url) for url in urls)

    def get(self) -> UpTarget:
        if self.target is not None and not self.whole():
            self.target.stop()
            self.target = None
        if self.target is None:
            self.started += 1
            self.target = UpTarget(
                self.log_dir / f"up-{self.started}",
                prefill=1,
                decode=2,
                model=self.model,
                engine_args=("--num-kv-blocks=2048",),
            ).start(timeout_s=300)
        return self.target

    def stop(self) -> None:
        if self.target is not None:
            self.target.stop()


def mix_spec(engine_url: str, model_dir: str) -> MixSpec:
    """The mix for a server: its model name and max_model_len as it reports them."""
    return MixSpec(model_dir, served_model(engine_url), max_model_len(engine_url))


def send(url: str, units: list[Unit], spec: MixSpec, burst: int) -> list:
    """The units in bursts of `burst`, from a fresh event loop."""
    return asyncio.run(run_units(url, units, spec, burst))


def no_problems(problems: list[str]) -> str:
    """The assertion message for a list of problems."""
    return "\n".join(problems)
