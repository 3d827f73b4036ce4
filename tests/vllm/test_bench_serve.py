"""vLLM's own load generator, `vllm bench serve` (from the stock vLLM venv), against the
gateway of `pdpool up`: its random and prefix-repetition datasets, completions and chat.
Every request must succeed with exactly the asked-for output length (`--ignore-eos`, vLLM's
sampling extension, which pdpool honours: the length is not cut short by an EOS)."""

from __future__ import annotations

import json
import subprocess

import pytest

from devtools.load_targets import UpTarget, served_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

PROMPTS = 24
CONCURRENCY = 12
OUTPUT_LEN = 24
DATASETS = {
    "random": [
        "--dataset-name",
        "random",
        "--random-input-len",
        "256",
        "--random-output-len",
        str(OUTPUT_LEN),
        "--random-range-ratio",
        "0",
    ],
    "prefix_repetition": [
        "--dataset-name",
        "prefix_repetition",
        "--prefix-repetition-prefix-len",
        "192",
        "--prefix-repetition-suffix-len",
        "64",
        "--prefix-repetition-num-prefixes",
        "4",
        "--prefix-repetition-output-len",
        str(OUTPUT_LEN),
    ],
}
ENDPOINTS = {
    "completions": ["--backend", "openai", "--endpoint", "/v1/completions"],
    "chat": ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions"],
}


@pytest.fixture(scope="module")
def up(tiny_qwen3, tmp_path_factory):
    target = UpTarget(
        tmp_path_factory.mktemp("up-bench"),
        prefill=1,
        decode=1,
        model=str(tiny_qwen3),
        engine_args=("--num-kv-blocks=2048",),
    )
    try:
        yield target.start(timeout_s=300)
    finally:
        target.stop()


def bench_serve(vllm_bin: str, up: UpTarget, dataset: str, endpoint: str, out_dir) -> dict:
    """Runs `vllm bench serve` once and returns its saved result (with per-request detail)."""
    name = f"{dataset}-{endpoint}.json"
    cmd = [
        vllm_bin,
        "bench",
        "serve",
        *ENDPOINTS[endpoint],
        "--base-url",
        up.url,
        "--model",
        up.model,
        "--served-model-name",
        served_model(up.url),
        "--tokenizer",
        up.model,
        "--num-prompts",
        str(PROMPTS),
        "--max-concurrency",
        str(CONCURRENCY),
        "--ignore-eos",
        "--seed",
        "0",
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(out_dir),
        "--result-filename",
        name,
        *DATASETS[dataset],
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out_dir / name).read_text())


@pytest.mark.parametrize(
    "dataset, endpoint",
    [("random", "completions"), ("prefix_repetition", "completions"), ("random", "chat")],
)
def test_every_request_succeeds_with_its_output_length(vllm_bin, up, dataset, endpoint, tmp_path):
    result = bench_serve(vllm_bin, up, dataset, endpoint, tmp_path)
    errors = [e for e in result["errors"] if e]
    print(
        f"\n{dataset}/{endpoint}: {result['completed']} ok, {result['failed']} failed, "
        f"{result['output_throughput']:.0f} tok/s, TTFT p99 {result['p99_ttft_ms']:.0f} ms"
    )
    assert result["failed"] == 0 and not errors, errors[:3]
    assert result["completed"] == PROMPTS
    assert result["output_lens"] == [OUTPUT_LEN] * PROMPTS
