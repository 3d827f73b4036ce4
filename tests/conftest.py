"""Fixtures shared by every test folder: tiny checkpoints and engine processes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

try:  # Tiny CPU models: one thread avoids oversubscribing 2 cores shared with engine processes.
    import torch

    torch.set_num_threads(1)
except ImportError:
    pass


def _tiny(tmp_path_factory, name: str, **spec):
    pytest.importorskip("torch", reason="the engine extra (torch) is not installed")
    from pdpool.engine.tiny_model import TinyModelSpec, write_tiny_model

    cache = Path(os.environ.get("PDPOOL_TEST_MODELS", str(tmp_path_factory.getbasetemp())))
    out = cache / name
    if not (out / "model.safetensors").is_file():
        write_tiny_model(out, TinyModelSpec(**spec))
    return out


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    """2 layers, hidden 64, 4 heads / 2 KV heads, vocab 512, float32."""
    return _tiny(tmp_path_factory, "tiny-qwen3", arch="qwen3", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3_sliding(tmp_path_factory) -> Path:
    """Like tiny_qwen3 with 4 layers, every other one a 32-token sliding window."""
    return _tiny(
        tmp_path_factory,
        "tiny-qwen3-sliding",
        arch="qwen3",
        seed=1,
        num_layers=4,
        sliding_window=32,
    )


@pytest.fixture(scope="session")
def tiny_qwen3_5(tmp_path_factory) -> Path:
    """Hybrid Qwen3.5: Gated DeltaNet and gated full-attention layers."""
    return _tiny(tmp_path_factory, "tiny-qwen3_5", arch="qwen3_5", seed=2, num_layers=4)
