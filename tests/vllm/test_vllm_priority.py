"""Priority scheduling side by side: the same mix of priorities (tests/support/priority_mix.py:
one busy stream holds the only batch slot, `--max-num-seqs 1`, while requests of three
priorities queue behind it on the two OpenAI routes; then the busy one is dropped) sent to
stock vLLM 0.32 and to `pdpool serve`, both with `--scheduling-policy priority`, finishes in
the same order, which is vLLM's rule: (priority, arrival), lower first. Reproducible on a
loaded machine: each request is sent only once the one before shows in
`vllm:num_requests_waiting`, and the busy stream cannot end before the queueing does: the
tiny checkpoint here has a 64k context, so the busy stream could run for minutes on either
engine; it runs until the mix is queued, then its client leaves (the engine aborts it). Each
queued request then runs 256 steps, so answers cannot overtake one another on their way
back.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from devtools.engine_procs import EngineProcess, wait_healthy
from pdpool.up.topology import VLLM_ENV, free_port, served_model_name
from tests.conftest import _tiny
from tests.support.priority_mix import QUEUED, expected_order, run_mix

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]

POLICY = ("--scheduling-policy", "priority", "--max-num-seqs", "1")
CONTEXT = 65536
# vLLM serves /inference/v1/generate only with its own flags: the OpenAI routes are compared.
OPENAI_QUEUED = [q for q in QUEUED if q[2].startswith("/v1/")]


@pytest.fixture(scope="module")
def long_context_qwen3(tmp_path_factory):
    """tiny_qwen3's weights with a 64k context."""
    return _tiny(
        tmp_path_factory, "tiny-qwen3-64k", arch="qwen3", seed=0, max_position_embeddings=CONTEXT
    )


def test_vllm_and_pdpool_serve_a_priority_mix_in_the_same_order(
    long_context_qwen3, vllm_bin, tmp_path
):
    model_dir = str(long_context_qwen3)
    port = free_port()
    argv = [vllm_bin, "serve", model_dir, "--port", str(port), *POLICY]
    argv += ["--dtype", "float32", "--enforce-eager", "--max-model-len", str(CONTEXT)]
    argv += ["--served-model-name", served_model_name(model_dir)]
    log = tmp_path / "vllm.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            argv,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env={**os.environ, **VLLM_ENV},
            start_new_session=True,
        )
    blocks = str(CONTEXT // 16 + 64)  # the busy stream's whole context, and the mix's
    ours = EngineProcess(long_context_qwen3, tmp_path, *POLICY, "--num-kv-blocks", blocks)
    try:
        vllm_url = f"http://127.0.0.1:{port}"
        wait_healthy(vllm_url, proc, 900, log)
        ours.wait(300)
        model = served_model_name(model_dir)
        busy, queued = CONTEXT - 64, OPENAI_QUEUED
        theirs = run_mix(vllm_url, model, queued_tokens=256, busy_tokens=busy, queued=queued)
        assert theirs == expected_order(queued), theirs
        ours_order = run_mix(ours.url, model, queued_tokens=256, busy_tokens=busy, queued=queued)
        assert ours_order == theirs
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        ours.stop()
