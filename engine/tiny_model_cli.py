"""`pdpool tiny-model OUT_DIR`: write a small random checkpoint."""

from __future__ import annotations

import argparse

from pdpool.cli import CliError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--arch", default="qwen3", choices=["qwen3", "qwen3_5"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=2, dest="num_layers")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--intermediate-size", type=int, default=128)
    p.add_argument("--heads", type=int, default=4, dest="num_heads")
    p.add_argument("--kv-heads", type=int, default=2, dest="num_kv_heads")
    p.add_argument(
        "--head-dim",
        type=int,
        default=32,
        help="attention head size (default 32: the smallest vLLM's CPU backend runs)",
    )
    p.add_argument(
        "--linear-head-dim",
        type=int,
        default=64,
        help="qwen3_5: Gated DeltaNet key and value head dim (default 64: the "
        "smallest vLLM's CPU kernel runs)",
    )
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument(
        "--sliding-window",
        type=int,
        default=None,
        help="qwen3: make every other layer sliding-window attention",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def main(args: argparse.Namespace) -> int:
    from pdpool.engine.tiny_model import TinyModelSpec, write_tiny_model

    spec = TinyModelSpec(
        arch=args.arch,
        seed=args.seed,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        vocab_size=args.vocab_size,
        linear_head_dim=args.linear_head_dim,
        sliding_window=args.sliding_window,
        dtype=args.dtype,
    )
    try:
        out = write_tiny_model(args.out_dir, spec)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    print(out)
    return 0
