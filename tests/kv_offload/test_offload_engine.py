"""The offload tier inside real engines (in process): a prefix another engine wrote to the
shared directory is loaded instead of recomputed, with the same greedy tokens as a
recompute, for full attention, sliding windows and Gated DeltaNet state; a corrupt or
foreign record is a miss and the tokens stay right."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from pdpool.engine.config import EngineConfig
from pdpool.engine.engine_core import LLMEngine
from pdpool.engine.kv.offload.keys import KIND_KV, block_key
from pdpool.engine.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
POOL_SECRET = "pool-secret-" + "p" * 32


@pytest.fixture(autouse=True)
def _pool_secret(monkeypatch):
    """The shared tier needs the pool's secret (as `pdpool up` and the operator give it)."""
    monkeypatch.setenv("PDPOOL_KV_SECRET", POOL_SECRET)


def _engine(model: Path, tier: Path | None, backend: str = "shared", **more) -> LLMEngine:
    extra = (
        dict(kv_offloading_size=0.05, kv_offloading_path=str(tier), kv_offloading_backend=backend)
        if tier is not None
        else {}
    )
    extra.update(more)
    # A pool of 24 blocks: two 150-token prompts do not stay cached together.
    return LLMEngine(
        EngineConfig(
            model=str(model),
            device="cpu",
            num_kv_blocks=24,
            max_num_batched_tokens=64,
            max_num_seqs=2,
            **extra,
        )
    )


def _run(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    for prompt in prompts:
        out += engine.generate([prompt], PARAMS)
        deadline = time.monotonic() + 10
        while engine.offload is not None and engine.offload._saving:
            assert time.monotonic() < deadline, "tier writes did not finish"
            engine.idle_tick()
            time.sleep(0.005)
    return out


def _prompts(n: int, length: int = 150, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(length)] for _ in range(n)]


def test_host_memory_tier_serves_returning_prompts(tiny_qwen3):
    """vLLM's native backend: the same records in host memory, no directory."""
    prompts = _prompts(4)
    recompute = _run(_engine(tiny_qwen3, None), prompts)
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_qwen3),
            device="cpu",
            num_kv_blocks=24,
            max_num_batched_tokens=64,
            max_num_seqs=2,
            kv_offloading_size=0.01,
        )
    )
    assert _run(engine, prompts) == recompute
    assert _run(engine, prompts) == recompute
    assert engine.offload is not None and engine.offload.medium == "CPU"
    assert engine.offload.counters["loads_ok"] == 4
    engine.close()


@pytest.mark.parametrize("model", ["tiny_qwen3", "tiny_qwen3_sliding", "tiny_qwen3_5"])
def test_second_engine_serves_first_engines_prefix_from_shared_tier(model, request, tmp_path):
    path = request.getfixturevalue(model)
    prompts = _prompts(3)
    recompute = _run(_engine(path, None), prompts)
    a = _engine(path, tmp_path)
    assert _run(a, prompts) == recompute
    assert a.offload is not None and a.offload.counters["stores"] > 0
    b = _engine(path, tmp_path)
    assert _run(b, prompts) == recompute
    assert b.offload is not None
    # B computed only what no full block (with its state, for Qwen3.5) covered.
    assert b.offload.counters["loads_ok"] == 3
    assert b.stats["prompt_tokens_pulled"] == b.offload.counters["loaded_tokens"] >= 3 * 128
    assert b.stats["prompt_tokens_computed"] <= 3 * 22
    assert b.offload.counters["records_rejected"] == 0
    for e in (a, b):
        assert e.kv.pool.num_used_blocks == 0
        e.close()


def test_returning_prompt_is_loaded_after_the_pool_evicted_it(tiny_qwen3, tmp_path):
    prompts = _prompts(4)
    engine = _engine(tiny_qwen3, tmp_path, backend="disk")
    first = _run(engine, prompts)
    again = _run(engine, prompts)  # each evicted from the 24-block pool by the others
    assert again == first
    assert engine.offload is not None and engine.offload.counters["loads_ok"] == 4
    engine.close()


def _files(tier: Path) -> list[Path]:
    return sorted(tier.rglob("*.kv"))


def test_flipped_byte_is_a_miss_never_a_wrong_token(tiny_qwen3, tmp_path):
    prompts = _prompts(2)
    recompute = _run(_engine(tiny_qwen3, None), prompts)
    a = _engine(tiny_qwen3, tmp_path)
    _run(a, prompts)
    a.close()
    records = {f.stat().st_ino: f for f in _files(tmp_path)}  # a record has many names
    for f in records.values():  # one flipped bit in the middle of every KV payload
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x04
        f.write_bytes(bytes(data))
    # Even under the `fail` policy (for remote loads), a bad record is a miss.
    b = _engine(tiny_qwen3, tmp_path, kv_load_failure_policy="fail")
    assert _run(b, prompts) == recompute
    assert b.offload is not None
    assert b.offload.counters["records_rejected"] >= 1
    assert b.offload.counters["loaded_tokens"] == 0
    # Rejected records are deleted: the next engine does not even try them.
    assert b.stats["prompt_tokens_computed"] == 2 * 150
    b.close()


def test_record_of_another_model_is_a_miss(tiny_qwen3, tmp_path, tmp_path_factory):
    from pdpool.engine.tiny_model import TinyModelSpec, write_tiny_model

    other = tmp_path_factory.mktemp("other") / "tiny-qwen3-seed9"
    write_tiny_model(other, TinyModelSpec(arch="qwen3", seed=9))  # same shapes, other weights
    prompts = _prompts(2)
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    a = _engine(tiny_qwen3, theirs)
    _run(a, prompts)
    b_alone = _engine(other, None)
    expected = _run(b_alone, prompts)
    b = _engine(other, mine)
    assert b.memory.fingerprint != a.memory.fingerprint
    # Sharing one directory: the other model's records are simply not B's keys.
    shared = _engine(other, theirs)
    assert _run(shared, prompts) == expected
    assert shared.offload is not None and shared.offload.counters["hit_tokens"] == 0
    # Worse: A's records put at B's keys (a renamed file). The header check refuses them.
    _run(b, prompts)
    assert b.offload is not None
    replaced = 0
    for prompt in prompts:
        hashes = _hashes(prompt, 16)
        for h in hashes:
            src = a.offload.store.path_of(block_key(a.memory.fingerprint, KIND_KV, 0, h))
            dst = b.offload.store.path_of(block_key(b.memory.fingerprint, KIND_KV, 0, h))
            if src.exists() and dst.exists():
                dst.write_bytes(src.read_bytes())
                replaced += 1
    assert replaced >= 2 * 9
    b2 = _engine(other, mine)
    assert _run(b2, prompts) == expected
    assert b2.offload is not None and b2.offload.counters["records_rejected"] >= 1
    assert b2.offload.counters["loaded_tokens"] == 0
    for e in (a, b_alone, b, shared, b2):
        e.close()


def test_planted_records_are_misses_never_wrong_tokens(tiny_qwen3, tmp_path, monkeypatch):
    """Someone who can write the shared directory but lacks the pool's secret plants
    records under the right names, with the right fingerprint and keys (zeroed KV): every
    one fails its MAC, is deleted, and the tokens are a recompute's."""
    from pdpool.engine.kv.offload.record import Entry, TensorBlob, decode_record, encode_record

    prompts = _prompts(2)
    recompute = _run(_engine(tiny_qwen3, None), prompts)
    a = _engine(tiny_qwen3, tmp_path)
    _run(a, prompts)
    a.close()
    fp = a.memory.fingerprint
    files = _files(tmp_path)
    for i, f in enumerate(files):
        key = f.name[: -len(".kv")]
        entries = decode_record(f.read_bytes(), fp, key, POOL_SECRET.encode())
        zeroed = [
            Entry(k, [TensorBlob(t.dtype, t.shape, bytes(len(t.data))) for t in ts])
            for k, ts in entries.items()
        ]
        # Unsigned, or signed with another pool's secret.
        secret = None if i % 2 else b"another-pool-secret-" + b"x" * 16
        f.unlink()  # a file of its own under the name (the record's other names keep theirs)
        f.write_bytes(encode_record(fp, zeroed, secret))
    assert len(files) >= 2 * 9
    b = _engine(tiny_qwen3, tmp_path)
    assert _run(b, prompts) == recompute
    assert b.offload is not None and b.offload.counters["records_rejected"] >= 1
    assert b.offload.counters["loaded_tokens"] == 0
    b.close()
    monkeypatch.delenv("PDPOOL_KV_SECRET")
    with pytest.raises(ValueError, match="shared needs the pool's secret"):
        _engine(tiny_qwen3, tmp_path)  # no secret: the shared tier refuses to start


def _hashes(prompt: list[int], block_size: int) -> list[bytes]:
    from pdpool.block_hash import chain_hashes

    return chain_hashes(prompt, block_size)


def test_offload_flags_are_checked(tmp_path):
    for bad, why in (
        (dict(kv_offloading_size=1.0, kv_offloading_backend="disk"), "kv-offloading-path"),
        (dict(kv_offloading_size=1.0, kv_offloading_backend="shared"), "kv-offloading-path"),
        (dict(kv_offloading_size=-1.0, kv_offloading_path=str(tmp_path)), "must be > 0"),
        (dict(kv_offloading_size=float("nan"), kv_offloading_path=str(tmp_path)), "must be > 0"),
        (dict(kv_offloading_backend="lmcache"), "kv-offloading-backend"),
        (
            dict(
                kv_offloading_size=1.0,
                kv_offloading_path=str(tmp_path),
                enable_prefix_caching=False,
            ),
            "prefix caching",
        ),
    ):
        with pytest.raises(ValueError, match=why):
            EngineConfig(model="m", **bad).validate()  # type: ignore[arg-type]


def _request(prompt: list[int]):
    from pdpool.engine.request import Request

    return Request("probe", list(prompt), PARAMS, eos_token_ids=(), block_size=16)


def test_cache_hit_threshold_counts_tier_tokens(tiny_qwen3, tmp_path):
    """Decode-first: a prefix the tier holds is as good as a cached one for the threshold
    (the engine loads it rather than rejecting the request to a prefill engine)."""
    prompts = _prompts(3)
    engine = _engine(tiny_qwen3, tmp_path, backend="disk")
    _run(engine, prompts)  # the later ones evict the first from the 24-block pool
    local = engine.kv.get_computed_blocks(_request(prompts[0]))[1]
    assert local <= 64  # the pool kept at most the head of it (tails go first)
    reasons = {}
    for name, prompt in (("tiered", prompts[0]), ("new", _prompts(1, seed=99)[0])):
        engine.add_request(name, prompt, PARAMS, cache_hit_threshold=0.8)
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    reasons[name] = out.finish_reason
    assert reasons == {"tiered": "length", "new": "cache_threshold"}
    assert engine.offload is not None and engine.offload.counters["loads_ok"] == 1
    assert engine.offload.counters["loaded_tokens"] == 144 - local  # 9 full blocks in all
    engine.close()


def _drain_reads(engine: LLMEngine) -> None:
    deadline = time.monotonic() + 10
    while engine.offload is not None and engine.offload._reads:
        assert time.monotonic() < deadline, "tier reads did not come back"
        engine.idle_tick()  # a dropped read's result comes back and is discarded
        time.sleep(0.005)


def test_aborting_a_request_while_its_tier_read_runs_frees_its_blocks(tiny_qwen3, tmp_path):
    prompts = _prompts(3)
    engine = _engine(tiny_qwen3, tmp_path, backend="disk")
    _run(engine, prompts)
    assert engine.offload is not None
    engine.offload.stage_max_bytes = 0  # no read at arrival: it starts at admission
    engine.add_request("gone", prompts[0], PARAMS)
    engine.step()  # admitted: its tier read starts
    assert "gone" in engine.scheduler.tier_loading
    assert engine.offload.counters["staged_skipped"] == 1
    engine.abort_request("gone")
    assert engine.kv.pool.num_used_blocks == 0  # at once: the read lands in host memory
    _drain_reads(engine)
    assert engine.kv.pool.num_used_blocks == 0 and not engine.has_unfinished()
    assert _run(engine, [prompts[0]]) == _run(_engine(tiny_qwen3, None), [prompts[0]])
    engine.close()


def test_read_staged_at_arrival_is_copied_at_admission(tiny_qwen3, tmp_path):
    """A returning request's tier read starts when it arrives (while it waits in line):
    once it is done, admission copies it into the blocks and the request runs in the same
    step, without waiting on a load; an aborted request's staged read is dropped."""
    prompts = _prompts(3)
    expected = _run(_engine(tiny_qwen3, None), [prompts[0]])
    writer = _engine(tiny_qwen3, tmp_path)
    _run(writer, prompts)
    writer.close()
    engine = _engine(tiny_qwen3, tmp_path)  # its pool empty: every prefix is in the tier
    tier = engine.offload
    assert tier is not None
    engine.add_request("dropped", prompts[1], PARAMS)
    assert tier.counters["staged_reads"] == 1 and tier.stats()["staged_bytes"] > 0
    engine.abort_request("dropped")
    _drain_reads(engine)
    assert tier.stats()["staged_bytes"] == 0 and engine.kv.pool.num_used_blocks == 0
    engine.add_request("back", prompts[0], PARAMS)
    assert tier.counters["staged_reads"] == 2
    deadline = time.monotonic() + 10
    while not any(r.result is not None for r in tier._reads.values()):
        assert time.monotonic() < deadline, "the staged read did not finish"
        engine.idle_tick()  # the engine thread takes the I/O thread's results
        time.sleep(0.005)
    first = engine.step()  # not in a step of its own: it runs (and samples) in this one
    assert tier.counters["staged_ready"] == 1
    assert "back" not in engine.scheduler.loading
    req = engine.requests["back"]
    assert req.num_pulled_tokens == tier.counters["loaded_tokens"] == 144
    tokens = [t for out in first for t in out.new_token_ids]
    assert len(tokens) == 1
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    assert [tokens] == expected
    assert tier.stats()["staged_bytes"] == 0 and not tier._reads
    engine.close()


def test_staged_read_is_bounded(tiny_qwen3, tmp_path):
    """Reads staged for requests in line hold at most the staging budget: past it a
    request reads at admission, with the same tokens."""
    prompts = _prompts(3)
    expected = _run(_engine(tiny_qwen3, None), prompts)
    writer = _engine(tiny_qwen3, tmp_path)
    _run(writer, prompts)
    writer.close()
    engine = _engine(tiny_qwen3, tmp_path)  # its pool empty: every prefix is in the tier
    tier = engine.offload
    assert tier is not None
    one = 9 * tier._block_bytes()  # 9 full blocks of a 150-token prompt
    tier.stage_max_bytes = one + one // 2
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, PARAMS)
    assert tier.counters["staged_reads"] == 1 and tier.counters["staged_skipped"] == 2
    assert tier.stats()["staged_bytes"] <= tier.stage_max_bytes
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert [got[f"r{i}"] for i in range(3)] == expected
    assert tier.counters["loads_ok"] == 3 and not tier._reads
    engine.close()
