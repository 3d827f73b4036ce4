"""Engine decode tokens/s: the Triton path against the torch path (PDPOOL_FORCE_TORCH=1).

Builds a random-weight checkpoint shaped like Qwen3-0.6B (28 layers, hidden 1024, 16 query /
8 KV heads of 128, MLP 3072, vocab 151936; bf16) with `pdpool.engine.tiny_model`, runs the real
engine (`pdpool.engine.engine_core.LLMEngine`) on `--batch` requests of `--prompt-len` random
tokens, and times the steps after every request has its first token, i.e. pure decode
batches. Both paths run in one process, one engine after the other; `ops` reads the switch
on every call. The target: the Triton path at least 3x the torch path at batch 64.

    python benchmarks/engine_decode_triton.py                 # on a GPU
    python benchmarks/engine_decode_triton.py --smoke         # CPU: tiny model, torch path only
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import tempfile
import time
from pathlib import Path

from kernels_common import print_table, write_json

QWEN3_0_6B = dict(
    num_layers=28,
    hidden_size=1024,
    intermediate_size=3072,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    dtype="bfloat16",
)
TINY = dict(
    num_layers=2,
    hidden_size=64,
    intermediate_size=128,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    vocab_size=512,
    max_position_embeddings=4096,
    dtype="float32",
)


def build_checkpoint(out_dir: Path, shape: dict) -> Path:
    from pdpool.engine.tiny_model import TinyModelSpec, write_tiny_model

    if (out_dir / "config.json").is_file():
        return out_dir
    print(f"writing a random checkpoint to {out_dir} ...", flush=True)
    return write_tiny_model(out_dir, TinyModelSpec(arch="qwen3", seed=0, **shape))


def run_path(path: str, model_dir: Path, device: str, args) -> dict:
    """One engine on one path; returns decode throughput over the pure-decode steps."""
    import torch

    from pdpool.engine.config import EngineConfig
    from pdpool.engine.engine_core import LLMEngine
    from pdpool.engine.sampling_params import SamplingParams

    if path == "torch":
        os.environ["PDPOOL_FORCE_TORCH"] = "1"
    else:
        os.environ.pop("PDPOOL_FORCE_TORCH", None)
    config = EngineConfig(
        model=str(model_dir),
        device=device,
        kv_cache_memory=int(args.kv_cache_gb * (1 << 30)),
        max_num_seqs=args.batch,
        max_num_batched_tokens=args.batched_tokens,
        enable_prefix_caching=False,
    )
    engine = LLMEngine(config)
    vocab = min(len(engine.tokenizer), engine.info.config["vocab_size"])
    rng = random.Random(0)
    greedy = SamplingParams(max_tokens=args.gen_len, temperature=0.0, ignore_eos=True)
    engine.generate(
        [[rng.randrange(vocab) for _ in range(32)] for _ in range(4)],
        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
    )  # warm-up
    for i in range(args.batch):
        engine.add_request(
            f"{path}-{i}", [rng.randrange(vocab) for _ in range(args.prompt_len)], greedy
        )
    started: set[str] = set()
    decode_tokens, decode_steps, t0 = 0, 0, None
    while engine.has_unfinished():
        outputs = engine.step()
        if t0 is not None:
            decode_steps += 1
            decode_tokens += sum(len(o.new_token_ids) for o in outputs)
        started.update(o.request_id for o in outputs if o.new_token_ids)
        if t0 is None and len(started) == args.batch:
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
    elapsed = time.perf_counter() - (t0 or time.perf_counter())
    result = {
        "path": path,
        "decode_tokens": decode_tokens,
        "decode_steps": decode_steps,
        "seconds": elapsed,
        "tokens_per_s": decode_tokens / elapsed if elapsed > 0 else None,
        "ms_per_step": 1e3 * elapsed / decode_steps if decode_steps else None,
    }
    del engine
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    os.environ.pop("PDPOOL_FORCE_TORCH", None)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="checkpoint folder (default: build one)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--batched-tokens", type=int, default=4096)
    ap.add_argument("--kv-cache-gb", type=float, default=8.0)
    ap.add_argument("--paths", default="triton,torch")
    ap.add_argument(
        "--smoke", action="store_true", help="no GPU: tiny model, small batch, torch path only"
    )
    args = ap.parse_args()
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        raise SystemExit("needs a CUDA GPU (run with --smoke for a CPU check of the script)")
    shape = QWEN3_0_6B
    if args.smoke:
        shape = TINY
        args.batch, args.prompt_len, args.gen_len, args.kv_cache_gb = 4, 24, 8, 0.05
    paths = args.paths.split(",")
    if not cuda:
        paths = [p for p in paths if p == "torch"]
    device = "cuda" if cuda else "cpu"
    with tempfile.TemporaryDirectory(prefix="pdpool-bench-") as tmp:
        model_dir = args.model or build_checkpoint(Path(tmp) / "model", shape)
        results = [run_path(p, model_dir, device, args) for p in paths]
    base = next((r for r in results if r["path"] == "torch"), None)
    rows = []
    for r in results:
        speedup = (
            r["tokens_per_s"] / base["tokens_per_s"]
            if base and base["tokens_per_s"] and r["tokens_per_s"]
            else None
        )
        r["speedup_vs_torch"] = speedup
        rows.append(
            [
                r["path"],
                args.batch,
                args.prompt_len,
                r["decode_tokens"],
                f"{r['tokens_per_s']:.0f}",
                f"{r['ms_per_step']:.2f}",
                "-" if speedup is None else f"{speedup:.2f}x",
            ]
        )
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(
        f"\nengine decode on {name}, {'tiny' if args.smoke else 'Qwen3-0.6B'}-shaped random "
        f"checkpoint, batch {args.batch}, prompt {args.prompt_len}, {args.gen_len} new tokens\n"
    )
    if not cuda:
        print("(no GPU here: the Triton path needs CUDA and was not run)\n")
    print_table(
        ["path", "batch", "prompt", "decode tokens", "tokens/s", "ms/step", "vs torch"], rows
    )
    write_json(
        "engine_decode_triton",
        {
            "device": name,
            "smoke": args.smoke,
            "shape": shape,
            "batch": args.batch,
            "prompt_len": args.prompt_len,
            "gen_len": args.gen_len,
            "results": results,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
