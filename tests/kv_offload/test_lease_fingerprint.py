"""The KV fingerprint rides in the signed lease: a consumer running another revision of the
model (same shapes, other weights, as in a rolling update) refuses the producer's lease and
recomputes, over real NIXL between two engine processes; the same revision pulls."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("nixl", reason="the nixl extra is not installed")

from devtools.engine_procs import connector_stat
from tests.support.pd_router import decode_leg, engine_set, post, prefill_leg, text_of

pytestmark = pytest.mark.slow

NIXL = ("--kv-connector", "nixl", "--num-kv-blocks", "64")


def test_a_lease_from_another_revision_is_refused_and_recomputed(
    tiny_qwen3, tmp_path, tmp_path_factory
):
    from pdpool.engine.tiny_model import TinyModelSpec, write_tiny_model

    revised = tmp_path_factory.mktemp("rev2") / "tiny-qwen3-rev2"
    write_tiny_model(revised, TinyModelSpec(arch="qwen3", seed=9))  # same config, new weights
    secret = tmp_path / "pool.secret"
    secret.write_text("pool-secret-" + "y" * 32)
    pool = ("--kv-secret-file", str(secret))
    prompt = [random.Random(4).randrange(3, 500) for _ in range(70)]
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with (
        engine_set(tiny_qwen3, tmp_path, {"P": (*NIXL, "--kv-role", "producer", *pool)}) as a,
        engine_set(revised, tmp_path, {"D2": (*NIXL, "--kv-role", "consumer", *pool)}) as b,
        engine_set(tiny_qwen3, tmp_path, {"D1": (*NIXL, "--kv-role", "consumer", *pool)}) as c,
    ):
        P, D2, D1 = a["P"], b["D2"], c["D1"]
        kv = prefill_leg(P.url, body)
        assert len(kv["pdpool_lease"]["fp"]) == 64
        out = decode_leg(D2.url, body, kv)
        assert text_of(out) == text_of(post(D2.url, body))  # D2's own recompute
        assert connector_stat(D2, "fingerprint_mismatches") == 1
        assert connector_stat(D2, "tokens_pulled") == 0
        assert "another model, revision" in D2.log.read_text()
        # The same revision pulls the same kind of lease.
        kv = prefill_leg(P.url, body)
        out = decode_leg(D1.url, body, kv)
        assert connector_stat(D1, "tokens_pulled") == 69
        assert connector_stat(D1, "fingerprint_mismatches") == 0
