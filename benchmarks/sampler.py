"""The engine's random sampling, per decode step: its batched inverse-CDF draw against a
torch.multinomial per row (what the engine did before, and what a per-row sampler does).

    python benchmarks/sampler.py              # vocabularies of 512 (tiny model), 151936 (Qwen3)
    python benchmarks/sampler.py --threads 2

Rows sample at temperature 1 (the API's default) with nothing else, or with top_p 0.9 over
nearly flat logits (the worst case: the kept tokens are most of the vocabulary) or peaked
ones (a trained model's, where they are few). The engine's Sampler is timed whole (logits
in, token ids out; it writes into the logits, so each call gets a copy made before the clock
starts), the reference over the same softmax, top-p and draw. Prints a table and writes
benchmarks/results/sampler.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, write_json

from pdpool.engine.sampling import Sampler
from pdpool.engine.sampling_params import SamplingParams


def per_row_multinomial(logits: torch.Tensor, params: list[SamplingParams]) -> list[int]:
    out = []
    for b, p in enumerate(params):
        probs = torch.softmax(logits[b] / p.temperature, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            keep = sorted_probs.cumsum(-1) - sorted_probs < p.top_p
            keep[0] = True
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
        out.append(int(torch.multinomial(probs, 1).item()))
    return out


def seconds_per_call(fn, inputs: list) -> float:
    """The median seconds of `fn(x)` over `inputs` (the first call, a warm-up, untimed)."""
    fn(inputs[0])
    times = []
    for x in inputs[1:]:
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(
    vocab: int, batch: int, p: SamplingParams, spread: float, repeats: int
) -> tuple[float, float]:
    """(seconds a step per row with torch.multinomial, seconds with the engine's Sampler),
    over logits of standard deviation `spread` (1: nearly flat; 5: a few tokens hold most
    of the mass, as in a trained model)."""
    logits = torch.randn(batch, vocab) * spread
    params = [p] * batch
    ids = [f"r{i}" for i in range(batch)]
    sampler = Sampler()
    before = seconds_per_call(lambda x: per_row_multinomial(x, params), [logits] * (repeats + 1))
    copies = [logits.clone() for _ in range(repeats + 1)]
    ours = seconds_per_call(lambda x: sampler.sample(x, ids, params, [None] * batch), copies)
    return before, ours


KINDS = (
    ("temperature 1", SamplingParams(), 1.0),
    ("top_p 0.9, flat", SamplingParams(top_p=0.9), 1.0),
    ("top_p 0.9, peaked", SamplingParams(top_p=0.9), 5.0),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocabs", default="512,151936")
    ap.add_argument("--batches", default="1,8,40,64")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for vocab in map(int, args.vocabs.split(",")):
        for batch in map(int, args.batches.split(",")):
            for kind, p, spread in KINDS:
                before, ours = measure(vocab, batch, p, spread, args.repeats)
                rows.append(
                    {
                        "vocab": vocab,
                        "batch": batch,
                        "rows": kind,
                        "multinomial per row ms": before * 1e3,
                        "engine ms": ours * 1e3,
                        "speed-up": before / ours,
                    }
                )
                print_table(rows[-1:])
    load = os.getloadavg()[0]
    print_table(rows, f"sampling one decode step, {args.threads} thread(s), load {load:.1f}")
    write_json("sampler", {"threads": args.threads, "load_average": load, "rows": rows})


if __name__ == "__main__":
    main()
