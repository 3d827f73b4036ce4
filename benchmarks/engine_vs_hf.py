"""Output tokens/s of the engine vs transformers' batched `generate`, same checkpoint and
prompts, on CPU.

64 requests with prompts of 16-256 tokens and output lengths of 8-128 tokens (a mix, as in
serving). transformers runs them as one left-padded batch (KV cache on, SDPA attention), so
every row runs until the longest finishes; the engine batches continuously, so a finished
request's slot is reused at once. Useful output tokens (what the requests asked for) per
second are compared.

Fairness: both sides run in the same process with the same torch thread count, float32, a
warm-up first, then `--repeats` timed runs each; the table shows the median and best, the
ratio uses the medians. Process CPU time is shown too: with one thread it is less
sensitive than wall time to other jobs on a shared machine. The engine's steps and batch
sizes are reported, and how many requests got the same greedy tokens from both (the work
done is the same). The engine's prefix cache is reset before each run (same prompts).

Shapes: `tiny` (4 layers, hidden 256, head_dim 32) and `small` (8 layers, hidden 512,
head_dim 64: 4x the KV bytes per token, so decode attention's memory traffic weighs more).

    python benchmarks/engine_vs_hf.py [--requests 64] [--shapes tiny,small] [--threads 1]
                                      [--repeats 3] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import print_table, write_json

SHAPES = {
    "tiny": dict(
        num_layers=4,
        hidden_size=256,
        intermediate_size=768,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
        vocab_size=2048,
    ),
    "small": dict(
        num_layers=8,
        hidden_size=512,
        intermediate_size=1536,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        vocab_size=2048,
    ),
}


def workload(n: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 256))] for _ in range(n)]
    outputs = [rng.randint(8, 128) for _ in range(n)]
    return prompts, outputs


class StepLog:
    """Records what each engine step scheduled, by wrapping the scheduler's decision on this
    one instance (read-only; `close` restores it)."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.steps: list[tuple[int, int, int]] = []  # (sequences, tokens, decodes)
        original = scheduler.schedule

        def schedule():
            out = original()
            if out.scheduled:
                self.steps.append(
                    (
                        len(out.scheduled),
                        out.num_scheduled_tokens,
                        sum(s.num_new_tokens == 1 for s in out.scheduled),
                    )
                )
            return out

        scheduler.schedule = schedule

    def close(self) -> None:
        del self.scheduler.schedule

    def summary(self) -> dict:
        seqs = [s for s, _, _ in self.steps]
        tokens = [t for _, t, _ in self.steps]
        return {
            "steps": len(self.steps),
            "decode_only_steps": sum(s == d for s, _, d in self.steps),
            "mean_batch_seqs": statistics.fmean(seqs),
            "max_batch_seqs": max(seqs),
            "mean_batch_tokens": statistics.fmean(tokens),
            "max_batch_tokens": max(tokens),
        }


def run_engine(model_dir: Path, prompts, outputs, repeats: int):
    from pdpool.engine.config import EngineConfig
    from pdpool.engine.engine_core import LLMEngine
    from pdpool.engine.sampling_params import SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            device="cpu",
            max_num_seqs=len(prompts),
            max_num_batched_tokens=2048,
        )
    )
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in outputs]
    warm = min(8, len(prompts))
    engine.generate(
        prompts[:warm], [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)] * warm
    )
    times, got, log = [], None, None
    for _ in range(repeats):
        # Same prompts every run: forget the previous run's blocks so nothing is a cache hit.
        assert engine.kv.pool.reset_prefix_cache(), "KV blocks still in use between runs"
        log = StepLog(engine.scheduler)
        t, c = time.perf_counter(), time.process_time()
        got = engine.generate(prompts, params)
        times.append((time.perf_counter() - t, time.process_time() - c))
        log.close()
    assert [len(g) for g in got] == outputs, "the engine did not produce the requested tokens"
    return times, got, log.summary()


def run_hf(model_dir: Path, prompts, outputs, repeats: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as generate expects for decoders
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    times, seqs = [], None
    with torch.inference_mode():
        model.generate(
            ids[:8],
            attention_mask=mask[:8],
            max_new_tokens=4,
            do_sample=False,
            use_cache=True,
            eos_token_id=None,
            pad_token_id=0,
        )  # warm-up
        for _ in range(repeats):
            t, c = time.perf_counter(), time.process_time()
            seqs = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(outputs),
                do_sample=False,
                use_cache=True,
                eos_token_id=None,
                pad_token_id=0,
            )
            times.append((time.perf_counter() - t, time.process_time() - c))
    got = [seqs[i, width : width + n].tolist() for i, n in enumerate(outputs)]
    return times, got


def write_model(shape: str) -> Path:
    from pdpool.engine.tiny_model import TinyModelSpec, write_tiny_model

    out = Path(tempfile.mkdtemp()) / f"bench-qwen3-{shape}"
    write_tiny_model(out, TinyModelSpec(**SHAPES[shape]))
    return out


def measure(label: str, model_dir: Path, n: int, repeats: int) -> dict:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts, outputs = workload(n, vocab)
    useful = sum(outputs)
    t_engine, got_engine, steps = run_engine(model_dir, prompts, outputs, repeats)
    t_hf, got_hf = run_hf(model_dir, prompts, outputs, repeats)
    same = sum(a == b for a, b in zip(got_engine, got_hf, strict=True))
    rows = []
    for system, times in (
        ("pdpool engine (continuous batching)", t_engine),
        ("transformers generate (one padded batch)", t_hf),
    ):
        wall = [w for w, _ in times]
        med = statistics.median(wall)
        rows.append(
            {
                "system": system,
                "median_s": med,
                "best_s": min(wall),
                "output_tok_per_s": useful / med,
                "best_tok_per_s": useful / min(wall),
                "median_cpu_s": statistics.median(c for _, c in times),
            }
        )
    ratio = rows[1]["median_s"] / rows[0]["median_s"]
    cpu_ratio = rows[1]["median_cpu_s"] / rows[0]["median_cpu_s"]
    print_table(
        rows,
        f"[{label}] {n} requests, {useful} output tokens, torch threads "
        f"{torch.get_num_threads()}, {repeats} runs each",
    )
    print(
        f"engine steps: {steps['steps']} ({steps['decode_only_steps']} decode-only), "
        f"batch mean {steps['mean_batch_seqs']:.1f} seqs / {steps['mean_batch_tokens']:.0f} "
        f"tokens, max {steps['max_batch_seqs']} / {steps['max_batch_tokens']}"
    )
    print(f"same greedy tokens as transformers: {same}/{n} requests")
    print(
        f"engine / transformers throughput: {ratio:.2f}x (target: >= 3x); by process CPU "
        f"time {cpu_ratio:.2f}x"
    )
    return {
        "shape": label,
        "requests": n,
        "output_tokens": useful,
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "rows": rows,
        "ratio": ratio,
        "cpu_time_ratio": cpu_ratio,
        "engine_steps": steps,
        "same_tokens_requests": same,
        "engine_wall_cpu_s": t_engine,
        "hf_wall_cpu_s": t_hf,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument(
        "--shapes", default="tiny,small", help=f"comma-separated, from {sorted(SHAPES)}"
    )
    ap.add_argument(
        "--model",
        type=Path,
        default=None,
        help="a checkpoint folder to use instead of the generated shapes",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads for both sides (default 1: on a small, "
        "shared machine more threads mostly wait on each other)",
    )
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.requests < 1 or args.repeats < 1 or args.threads < 1:
        ap.error("--requests, --repeats and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    if args.model is not None:
        targets = [(args.model.name, args.model)]
    else:
        shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
        unknown = [s for s in shapes if s not in SHAPES]
        if unknown or not shapes:
            ap.error(f"--shapes: unknown {unknown}; choose from {sorted(SHAPES)}")
        targets = [(s, write_model(s)) for s in shapes]
    results = [measure(label, path, args.requests, args.repeats) for label, path in targets]
    write_json(
        "engine_vs_hf", {"requests": args.requests, "threads": args.threads, "results": results}
    )


if __name__ == "__main__":
    main()
