"""A rollout's mixed revisions never hand KV across: each engine lists its KV fingerprint
in /v1/models, and a decode sidecar sends its prefill legs only to prefill engines of its
decode engine's fingerprint (decode alone when there is none). Real engines over NIXL and a
real sidecar process; the fingerprint parser is tried with hostile answers."""

from __future__ import annotations

import random
import subprocess
import time

import httpx
import pytest

from pdpool.ports import free_port
from pdpool.sidecar.proxy.revision_legs import base_fingerprint
from pdpool.up.topology import pdpool_command

pytest.importorskip("nixl", reason="the nixl extra is not installed")

from devtools.engine_procs import connector_stat
from tests.support.e2e_helpers import metric
from tests.support.pd_router import engine_set, post, text_of

NIXL = ("--kv-connector", "nixl", "--num-kv-blocks", "64")
SKIPPED = "pdpool_sidecar_prefill_other_revision_skipped_total"


@pytest.mark.parametrize(
    "payload, expected",
    [
        ({"data": [{"id": "m", "parent": None, "kv_fingerprint": "ab12"}]}, "ab12"),
        ({"data": [{"id": "a", "parent": "m"}, {"id": "m", "kv_fingerprint": "cd"}]}, "cd"),
        ({"data": [{"id": "m"}]}, ""),  # stock vLLM: none
        ({"data": [{"id": "m", "kv_fingerprint": "x" * 10_000}]}, ""),
        ({"data": [{"id": "m", "kv_fingerprint": ["not", "a", "string"]}]}, ""),
        ({"data": "nope"}, ""),
        ({"data": [None, 3, "x"]}, ""),
        ([1, 2], ""),
        (None, ""),
    ],
)
def test_the_fingerprint_is_read_from_the_base_card_only(payload, expected):
    assert base_fingerprint(payload) == expected


class Sidecar:
    def __init__(self, decode_url: str, prefill_urls: list[str], log_path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = ["sidecar", "--port", str(self.port), "--decode-url", decode_url]
        for url in prefill_urls:
            args += ["--prefill-url", url]
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(pdpool_command(*args), stdout=log, stderr=log)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    # Each worker reads the engines' fingerprints as it starts and at each
                    # prefill probe round (1 s).
                    time.sleep(2.5)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise AssertionError("the sidecar did not become ready")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(15)


def complete(url: str, body: dict) -> tuple[str, str | None]:
    """(text, the prefill engine the sidecar says served the prefill leg, None if none)."""
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return text_of(r.json()), r.headers.get("x-pdpool-prefill-endpoint")


def prompt(seed: int) -> list[int]:
    return [random.Random(seed).randrange(3, 500) for _ in range(70)]


@pytest.mark.slow
def test_prefill_legs_go_only_to_the_decode_engines_revision(
    tiny_qwen3, tmp_path, tmp_path_factory
):
    from pdpool.engine.tiny_model import TinyModelSpec, write_tiny_model

    revised = tmp_path_factory.mktemp("rev2") / "tiny-qwen3-rev2"
    write_tiny_model(revised, TinyModelSpec(arch="qwen3", seed=9))  # same shapes, new weights
    secret = tmp_path / "pool.secret"
    secret.write_text("pool-secret-" + "z" * 32)
    pool = ("--kv-secret-file", str(secret))
    producer, consumer = (
        (*NIXL, "--kv-role", "producer", *pool),
        (*NIXL, "--kv-role", "consumer", *pool),
    )
    with (
        engine_set(tiny_qwen3, tmp_path, {"OLD": producer}) as old,
        engine_set(revised, tmp_path, {"NEW": producer, "D": consumer}) as new,
    ):
        OLD, NEW, D = old["OLD"], new["NEW"], new["D"]
        cards = [httpx.get(f"{e.url}/v1/models", timeout=5).json()["data"][0] for e in (OLD, D)]
        assert (
            cards[0]["kv_fingerprint"] and cards[0]["kv_fingerprint"] != cards[1]["kv_fingerprint"]
        )
        assert (
            httpx.get(f"{NEW.url}/v1/models").json()["data"][0]["kv_fingerprint"]
            == cards[1]["kv_fingerprint"]
        )

        # Both revisions behind one sidecar: the old prefill engine is left out.
        sidecar = Sidecar(D.url, [OLD.url, NEW.url], tmp_path / "sidecar-both.log")
        try:
            deadline = time.monotonic() + 30
            seed = 0
            while metric(sidecar.url, SKIPPED) == 0:  # the fingerprints are read once
                assert time.monotonic() < deadline, "the sidecar never learned the fingerprints"
                seed += 1
                post(
                    sidecar.url, {"prompt": prompt(1000 + seed), "max_tokens": 2, "temperature": 0}
                )
            refused = connector_stat(D, "fingerprint_mismatches", 0)
            for i in range(6):
                body = {"prompt": prompt(i), "max_tokens": 8, "temperature": 0, "ignore_eos": True}
                text, prefilled_by = complete(sidecar.url, body)
                assert prefilled_by == NEW.url.split("://")[1]
                assert text == text_of(post(D.url, body))
            assert connector_stat(D, "fingerprint_mismatches", 0) == refused
            assert connector_stat(D, "tokens_pulled") > 0  # NEW's KV was pulled
            assert metric(sidecar.url, SKIPPED) >= 6
        finally:
            sidecar.stop()

        # Only the old revision: decode serves alone, no KV of the other revision is pulled.
        sidecar = Sidecar(D.url, [OLD.url], tmp_path / "sidecar-old.log")
        try:
            deadline = time.monotonic() + 30
            while metric(sidecar.url, SKIPPED) == 0:
                assert time.monotonic() < deadline, "the sidecar never learned the fingerprints"
                seed += 1
                post(
                    sidecar.url, {"prompt": prompt(2000 + seed), "max_tokens": 2, "temperature": 0}
                )
            refused = connector_stat(D, "fingerprint_mismatches", 0)
            body = {"prompt": prompt(77), "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            text, prefilled_by = complete(sidecar.url, body)
            assert prefilled_by is None  # decode alone
            assert text == text_of(post(D.url, body))
            assert connector_stat(D, "fingerprint_mismatches", 0) == refused
        finally:
            sidecar.stop()
