"""Start real `pdpool serve` processes for tests (and benchmarks), and stop them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import httpx

from pdpool.ports import free_port


def wait_healthy(
    url: str,
    proc: Optional[subprocess.Popen] = None,
    timeout: float = 120.0,
    log: Optional[Path] = None,
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-3000:] if log and log.exists() else ""
            raise RuntimeError(f"process exited with {proc.returncode} before healthy:\n{tail}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy after {timeout}s")


class SpawnedEngine:
    def __init__(
        self,
        model: Path,
        log_dir: Path,
        *flags: str,
        port: Optional[int] = None,
        env: Optional[dict[str, str]] = None,
    ):
        self.model = Path(model)
        self.extra_env = dict(env or {})
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"engine-{self.port}.log"
        self.flags = flags
        self._start()

    def _command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "pdpool.cli",
            "serve",
            str(self.model),
            "--device",
            "cpu",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            *self.flags,
        ]

    def _env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **self.extra_env}

    def _start(self) -> None:
        cmd, env = self._command(), self._env()
        # Appended: a restart on the same port keeps the earlier log. The child holds its own
        # copy of the descriptor.
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def wait(self, timeout: float = 120.0) -> "SpawnedEngine":
        for _ in range(3):
            try:
                wait_healthy(self.url, self.proc, timeout, self.log)
                return self
            except RuntimeError:
                # The free port was taken by someone else before the engine bound it.
                if "address already in use" not in self.log.read_text():
                    raise
                self.port = free_port()
                self.url = f"http://127.0.0.1:{self.port}"
                self.log = self.log.with_name(f"engine-{self.port}.log")
                self._start()
        raise RuntimeError(f"no free port for the engine after 3 tries ({self.log})")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signals the engine's process group and waits for it; `restart` brings it back."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(15)

    def restart(self, timeout: float = 120.0) -> "SpawnedEngine":
        """The same engine again, on the same ports, after `kill`."""
        self._start()
        wait_healthy(self.url, self.proc, timeout, self.log)
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)

    def metric(self, name: str) -> float:
        """Sum of a Prometheus sample over its label sets."""
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total


@contextmanager
def spawned_engine(model: Path, log_dir: Path, *flags: str) -> Iterator[SpawnedEngine]:
    eng = SpawnedEngine(model, log_dir, *flags)
    try:
        yield eng.wait()
    finally:
        eng.stop()


def connector_stat(eng: SpawnedEngine, name: str, default: Optional[float] = None) -> float:
    """One of the engine's `pdpool_kv_connector{stat=...}` figures (`default` when it has not
    published that one; AssertionError without a default)."""
    for line in httpx.get(f"{eng.url}/metrics", timeout=5).text.splitlines():
        if line.startswith("pdpool_kv_connector{") and f'stat="{name}"' in line:
            return float(line.rsplit(" ", 1)[1])
    if default is None:
        raise AssertionError(f"no connector stat {name}")
    return default
