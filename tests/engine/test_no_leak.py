"""After any mix of finished, aborted, preempted and rejected requests, every block is free."""

from __future__ import annotations

import random

from pdpool.engine.config import EngineConfig
from pdpool.engine.engine_core import LLMEngine
from pdpool.engine.sampling_params import SamplingParams


def test_random_mix_leaves_no_block_behind(tiny_qwen3):
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_qwen3),
            device="cpu",
            num_kv_blocks=24,
            max_num_batched_tokens=64,
            max_num_seqs=6,
        )
    )
    rng = random.Random(3)
    shared = [rng.randrange(3, 500) for _ in range(40)]  # a common prefix: cache hits too
    live, n_aborted, finished = set(), 0, 0
    for i in range(40):
        own = [rng.randrange(3, 500) for _ in range(rng.randint(1, 80))]
        prompt = (shared if i % 2 else []) + own
        threshold = 0.9 if i % 7 == 0 else None
        engine.add_request(
            f"r{i}",
            prompt,
            SamplingParams(
                max_tokens=rng.randint(1, 30),
                temperature=rng.choice([0.0, 0.8]),
                seed=i,
                ignore_eos=True,
            ),
            cache_hit_threshold=threshold,
        )
        live.add(f"r{i}")
        for _ in range(rng.randint(0, 3)):
            for out in engine.step():
                if out.finished:
                    live.discard(out.request_id)
                    finished += 1
        if live and rng.random() < 0.3:
            victim = rng.choice(sorted(live))
            engine.abort_request(victim)
            live.discard(victim)
            n_aborted += 1
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
                finished += 1
    assert not live and not engine.requests
    assert engine.scheduler.num_preemptions > 0, "the mix must include preemptions"
    assert n_aborted > 0 and finished + n_aborted == 40
    assert sum(engine.scheduler.num_threshold_rejections.values()) > 0
    pool = engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert not engine.kv.req_blocks
