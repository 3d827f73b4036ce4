"""Block lifetimes under random interleavings (a seeded property test): a real Scheduler over
a real KVCacheManager driven through admissions, prefix hits, chunked prefills, preemptions,
finishes, aborts, leases, peer reads, lease expiry, failed and partial loads and core
restarts, with the invariants checked after every operation (devtools/kv_lifetimes.py says
which).

PDPOOL_KV_FUZZ_EXAMPLES=N runs N examples instead of the suite's bounded number
(PDPOOL_KV_FUZZ_SEED picks the first seed); benchmarks/kv_lifetimes_fuzz.py is the long run.
"""

from __future__ import annotations

import os
import time

from devtools.kv_lifetimes import EVENTS, SEEN, SUITE_EXAMPLES, run_examples


def test_block_lifetimes_hold_under_random_interleavings():
    count = int(os.environ.get("PDPOOL_KV_FUZZ_EXAMPLES", SUITE_EXAMPLES))
    SEEN.clear()
    started = time.monotonic()
    run_examples(int(os.environ.get("PDPOOL_KV_FUZZ_SEED", 0)), count)
    print(f"{count} examples in {time.monotonic() - started:.1f} s: {dict(sorted(SEEN.items()))}")
    assert set(SEEN) >= EVENTS, f"never exercised: {EVENTS - set(SEEN)}"
