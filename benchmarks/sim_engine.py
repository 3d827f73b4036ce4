"""Stands in for `vllm serve` under `pdpool up --engine vllm`: runs llm-d's inference
simulator (llm-d-inference-sim, built by scripts/llm-d-sim/build-sim.sh) on the port and
model name `pdpool up` asks for, with the latencies and capacity in PDPOOL_SIM_ARGS. A
simulator engine spends no CPU on the model, so on this 2-core machine its replicas add
capacity the way GPUs would (each has its own max-num-seqs and latencies).

    PDPOOL_VLLM_BIN=<a script exec'ing: python benchmarks/sim_engine.py "$@">
    PDPOOL_SIM_BIN=~/.cache/pdpool/sim-bin/llm-d-inference-sim
    PDPOOL_SIM_ARGS="--max-num-seqs 4 --time-to-first-token 200ms ..."
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("command")  # serve
    p.add_argument("model")
    p.add_argument("--port", required=True)
    p.add_argument("--served-model-name")
    known, _ = p.parse_known_args(argv)  # vLLM's other flags mean nothing to the simulator
    name = known.served_model_name or os.path.basename(known.model.rstrip("/"))
    binary = os.environ.get("PDPOOL_SIM_BIN") or os.path.expanduser(
        "~/.cache/pdpool/sim-bin/llm-d-inference-sim"
    )
    args = [binary, "--port", known.port, "--model", name, "--served-model-name", name]
    args += ["--mode", "random", "--force-dummy-tokenizer"]
    args += shlex.split(os.environ.get("PDPOOL_SIM_ARGS", ""))
    os.execv(binary, args)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
