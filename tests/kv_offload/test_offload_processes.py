"""The offload tier in real `pdpool serve` processes: two engines share one directory and
the second serves the first's prefix from it (tokens equal to a recompute, the counters
show the hit); an engine SIGKILLed in the middle of a record write leaves nothing a later
engine accepts; a disk that refuses writes (a file-size limit) costs hits, not answers."""

from __future__ import annotations

import json
import random
import resource
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from devtools.engine_procs import SpawnedEngine, spawned_engine
from pdpool.engine.kv.offload.store import STALL_WRITE_ENV, TMP_PREFIX

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _pool_secret(monkeypatch):
    """The shared tier needs the pool's secret (engines inherit it from the environment)."""
    monkeypatch.setenv("PDPOOL_KV_SECRET", "pool-secret-" + "p" * 32)


PROMPT = [random.Random(5).randrange(3, 500) for _ in range(200)]


def _tier_flags(path: Path, backend: str = "shared") -> tuple[str, ...]:
    return (
        "--num-kv-blocks",
        "64",
        "--kv-offloading-size",
        "0.05",
        "--kv-offloading-backend",
        backend,
        "--kv-offloading-path",
        str(path),
    )


def _tokens(url: str, prompt: list[int] = PROMPT) -> list[int]:
    """The greedy completion's token ids (streamed: the chunks carry them)."""
    body = {
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    ids: list[int] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ids += json.loads(line[6:])["choices"][0]["token_ids"]
    assert len(ids) == 8
    return ids


def _offload_stat(eng: SpawnedEngine, stat: str) -> float:
    for line in httpx.get(f"{eng.url}/metrics", timeout=5).text.splitlines():
        if line.startswith("pdpool_kv_offload{") and f'stat="{stat}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no pdpool_kv_offload stat {stat}")


def _wait_stat(eng: SpawnedEngine, stat: str, at_least: float, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while _offload_stat(eng, stat) < at_least:
        assert time.monotonic() < deadline, f"{stat} stayed below {at_least}"
        time.sleep(0.2)


def test_two_engines_share_a_tier_and_a_killed_writer_leaves_nothing_accepted(tiny_qwen3, tmp_path):
    tier = tmp_path / "tier"
    with spawned_engine(tiny_qwen3, tmp_path, "--num-kv-blocks", "64") as plain:
        expected = _tokens(plain.url)
    with spawned_engine(tiny_qwen3, tmp_path, *_tier_flags(tier)) as a:
        assert _tokens(a.url) == expected
        _wait_stat(a, "stores", 12)  # the prompt's 12 full blocks reached the tier
        # vLLM's offload counters, under its names, say the same.
        stored = _offload_stat(a, "store_bytes")
        assert a.metric("vllm:kv_offload_store_bytes_total") == stored > 12 * 1024
        assert a.metric("vllm:kv_offload_store_time_total") > 0
        assert a.metric("vllm:kv_offload_load_bytes_total") == 0
    with spawned_engine(tiny_qwen3, tmp_path, *_tier_flags(tier)) as b:
        assert _tokens(b.url) == expected
        assert _offload_stat(b, "loaded_tokens") == 192
        assert _offload_stat(b, "records_rejected") == 0
        loaded = _offload_stat(b, "load_bytes")
        assert b.metric("vllm:kv_offload_load_bytes_total") == loaded > 12 * 1024
        assert b.metric("vllm:kv_offload_load_time_total") == _offload_stat(b, "load_seconds") > 0
        assert b.metric("pdpool_prompt_tokens_by_source_total") > 0
    # An engine killed while writing: its half-written records have temporary names only.
    other = [random.Random(6).randrange(3, 500) for _ in range(200)]
    killed = SpawnedEngine(tiny_qwen3, tmp_path, *_tier_flags(tier), env={STALL_WRITE_ENV: "30"})
    try:
        killed.wait()
        assert _tokens(killed.url, other)
        deadline = time.monotonic() + 30
        while not [p for p in tier.rglob(f"{TMP_PREFIX}*")]:
            assert time.monotonic() < deadline, "no write started"
            time.sleep(0.1)
    finally:
        killed.kill()
    assert [p for p in tier.rglob(f"{TMP_PREFIX}*")], "the torn write should still be there"
    with spawned_engine(tiny_qwen3, tmp_path, *_tier_flags(tier)) as c:
        with spawned_engine(tiny_qwen3, tmp_path, "--num-kv-blocks", "64") as plain:
            expected_other = _tokens(plain.url, other)
        assert _tokens(c.url, other) == expected_other
        assert _offload_stat(c, "loaded_tokens") == 0  # nothing of the killed write counts
        assert _tokens(c.url) == expected  # and A's prefix still serves


class _SizeLimitedEngine(SpawnedEngine):
    """An engine whose files cannot grow past a few KiB (RLIMIT_FSIZE): every tier write
    fails as on a full disk. Its output goes through a pipe (unlimited) to the log."""

    def _start(self) -> None:
        cmd = self._command()
        limit = 8 << 10

        def cap() -> None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=self._env(),
            start_new_session=True,
            preexec_fn=cap,
        )

        def drain() -> None:
            with open(self.log, "ab", buffering=0) as log:
                assert self.proc.stdout is not None
                for line in self.proc.stdout:
                    log.write(line)

        self.drainer = threading.Thread(target=drain, daemon=True)
        self.drainer.start()


def test_a_full_disk_costs_hits_not_answers(tiny_qwen3, tmp_path):
    with spawned_engine(tiny_qwen3, tmp_path, "--num-kv-blocks", "64") as plain:
        expected = _tokens(plain.url)
    eng = _SizeLimitedEngine(tiny_qwen3, tmp_path, *_tier_flags(tmp_path / "tier", "disk"))
    try:
        eng.wait()
        for _ in range(2):
            assert _tokens(eng.url) == expected
        _wait_stat(eng, "store_failures", 12)
        assert _offload_stat(eng, "stores") == 0
        assert not [p for p in (tmp_path / "tier").rglob("*") if p.is_file()]
        assert httpx.get(f"{eng.url}/health", timeout=5).status_code == 200
    finally:
        eng.stop()
        eng.drainer.join(10)
    assert "File too large" in eng.log.read_text()  # the reason is logged


def test_shared_tier_without_a_secret_refuses_to_start(tiny_qwen3, tmp_path, monkeypatch):
    """Without the pool's secret anyone who can write the directory could plant records:
    `pdpool serve` stops with one line saying so."""
    import os
    import sys

    monkeypatch.delenv("PDPOOL_KV_SECRET")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDPOOL_KV_SECRET")}
    argv = [sys.executable, "-m", "pdpool.cli", "serve", str(tiny_qwen3), "--device", "cpu"]
    done = subprocess.run(
        [*argv, *_tier_flags(tmp_path / "tier")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "shared needs the pool's secret" in done.stderr
    assert "Traceback" not in done.stderr
