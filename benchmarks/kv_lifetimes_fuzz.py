"""The long run of the KV block-lifetime property test (devtools/kv_lifetimes.py).

    python benchmarks/kv_lifetimes_fuzz.py                      # 5000 examples from seed 0
    python benchmarks/kv_lifetimes_fuzz.py --examples 20000 --seed 100000

The suite (tests/engine/test_kv_lifetimes.py) runs a bounded number of examples; this runs
as many as asked, in batches, with
the same generator and the same invariants checked after every operation (a real Scheduler
over a real KVCacheManager, the connector's scheduler-facing half scripted). It stops at the
first example that breaks an invariant, names its seed and its last steps, and exits 1.
Reported: examples, seconds, examples per second, and how often each kind of event
occurred; the same in benchmarks/results/kv_lifetimes_fuzz.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))  # devtools
from common import print_table, write_json

from devtools import kv_lifetimes as lifetimes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=0, help="the first example's seed")
    ap.add_argument("--batch", type=int, default=500, help="examples between progress lines")
    args = ap.parse_args()
    lifetimes.SEEN.clear()
    started = time.monotonic()
    done = 0
    while done < args.examples:
        count = min(args.batch, args.examples - done)
        try:
            lifetimes.run_examples(args.seed + done, count)
        except AssertionError as exc:
            print(f"an invariant broke: {exc}", file=sys.stderr)
            return 1
        done += count
        print(f"  {done} examples, {time.monotonic() - started:.0f} s", flush=True)
    seconds = time.monotonic() - started
    rows = [{"event": k, "times": v} for k, v in sorted(lifetimes.SEEN.items())]
    print_table(
        rows,
        f"{done} examples from seed {args.seed} in {seconds:.1f} s "
        f"({done / seconds:.0f}/s), every invariant held",
    )
    write_json(
        "kv_lifetimes_fuzz",
        {"examples": done, "first_seed": args.seed, "seconds": seconds, "events": lifetimes.SEEN},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
