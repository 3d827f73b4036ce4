"""Priority scheduling side by side: the same mix of priorities (tests/support/priority_mix.py:
a busy stream, then requests of three priorities queued behind it on the two OpenAI routes)
sent to stock vLLM and to `pdpool serve`, both with `--scheduling-policy priority
--max-num-seqs 1`, finishes in the same order."""

from __future__ import annotations

import os
import subprocess

import pytest

from devtools.engine_procs import EngineProcess, wait_healthy
from pdpool.up.topology import VLLM_ARGS, VLLM_ENV, free_port, served_model_name
from tests.support.priority_mix import OPENAI_QUEUED, expected_order, run_mix

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

FLAGS = ("--scheduling-policy", "priority", "--max-num-seqs", "1", "--max-model-len", "4096")


def test_vllm_and_pdpool_serve_a_priority_mix_in_the_same_order(tiny_qwen3, vllm_bin, tmp_path):
    port = free_port()
    argv = [vllm_bin, "serve", str(tiny_qwen3), "--port", str(port), *VLLM_ARGS, *FLAGS]
    argv += ["--served-model-name", served_model_name(str(tiny_qwen3))]
    log = tmp_path / "vllm.log"
    with open(log, "wb") as fh:
        env = {**os.environ, **VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND": "0"}
        proc = subprocess.Popen(
            argv, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    ours = EngineProcess(tiny_qwen3, tmp_path, *FLAGS)
    try:
        vllm_url = f"http://127.0.0.1:{port}"
        wait_healthy(vllm_url, proc, 900, log)
        ours.wait(300)
        model = served_model_name(str(tiny_qwen3))
        theirs = run_mix(vllm_url, model, busy_tokens=4000, queued=OPENAI_QUEUED)
        assert theirs == expected_order(OPENAI_QUEUED), theirs
        assert run_mix(ours.url, model, busy_tokens=4000, queued=OPENAI_QUEUED) == theirs
    finally:
        proc.terminate()
        proc.wait(30)
        ours.stop()
