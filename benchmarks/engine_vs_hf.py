"""Output tokens/s of the engine vs transformers' batched `generate`, same checkpoint and
prompts, on CPU.

64 requests with prompts of 16-256 tokens and output lengths of 8-128 tokens (a mix, as in
serving). transformers runs them as one padded batch, so every row runs until the longest
finishes; the engine batches continuously, so a finished request's slot is reused at once.
Useful output tokens (what the requests asked for) per second are compared.

    python benchmarks/engine_vs_hf.py [--requests 64] [--model DIR]
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import print_table, write_json  # noqa: E402


def workload(n: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 256))] for _ in range(n)]
    outputs = [rng.randint(8, 128) for _ in range(n)]
    return prompts, outputs


def run_engine(model_dir: Path, prompts, outputs) -> float:
    from pdpool.engine.config import EngineConfig
    from pdpool.engine.engine_core import LLMEngine
    from pdpool.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", max_num_seqs=64,
                                    max_num_batched_tokens=2048))
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in outputs]
    engine.generate(prompts[:2], params[:2])  # warm-up
    t = time.perf_counter()
    got = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t
    assert [len(g) for g in got] == outputs
    return elapsed


def run_hf(model_dir: Path, prompts, outputs) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as generate expects for decoders
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.inference_mode():
        model.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=2, do_sample=False,
                       pad_token_id=0)
        t = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=max(outputs), do_sample=False,
                       eos_token_id=None, pad_token_id=0)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--model", type=Path, default=None,
                    help="checkpoint folder (default: a 4-layer, hidden-256 tiny Qwen3)")
    args = ap.parse_args()
    model_dir = args.model
    if model_dir is None:
        from pdpool.engine.tiny_model import TinyModelSpec, write_tiny_model
        model_dir = Path(tempfile.mkdtemp()) / "bench-qwen3"
        write_tiny_model(model_dir, TinyModelSpec(num_layers=4, hidden_size=256,
                                                  intermediate_size=768, num_heads=8,
                                                  num_kv_heads=4, head_dim=32, vocab_size=2048))
    import json
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts, outputs = workload(args.requests, vocab)
    useful = sum(outputs)
    t_engine = run_engine(model_dir, prompts, outputs)
    t_hf = run_hf(model_dir, prompts, outputs)
    rows = [
        {"system": "pdpool engine (continuous batching)", "seconds": t_engine,
         "output_tok_per_s": useful / t_engine},
        {"system": "transformers generate (one padded batch)", "seconds": t_hf,
         "output_tok_per_s": useful / t_hf},
    ]
    print_table(rows, f"{args.requests} requests, {useful} output tokens, torch threads "
                      f"{torch.get_num_threads()}")
    ratio = t_hf / t_engine
    print(f"\nengine / transformers throughput: {ratio:.2f}x (target: >= 3x)")
    write_json("engine_vs_hf", {"requests": args.requests, "output_tokens": useful,
                                "rows": rows, "ratio": ratio})


if __name__ == "__main__":
    main()
