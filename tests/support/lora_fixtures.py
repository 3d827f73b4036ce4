"""Tiny PEFT adapters on the tiny checkpoints (made with peft, random nonzero A and B);
tests/conftest.py makes these fixtures available everywhere."""

from pathlib import Path

import pytest

from devtools.lora_maker import make_adapter


@pytest.fixture(scope="session")
def qwen3_adapters(tiny_qwen3, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-qwen3")
    return {
        "alpha": make_adapter(tiny_qwen3, root / "alpha", seed=1, rank=8),
        "beta": make_adapter(
            tiny_qwen3, root / "beta", seed=2, rank=4, targets=("q_proj", "v_proj", "down_proj")
        ),
        "gamma": make_adapter(tiny_qwen3, root / "gamma", seed=3, rank=16, alpha=8.0),
    }


@pytest.fixture(scope="session")
def qwen3_5_adapters(tiny_qwen3_5, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-qwen3_5")
    return {
        "alpha": make_adapter(tiny_qwen3_5, root / "alpha", seed=4, rank=8),
        "beta": make_adapter(tiny_qwen3_5, root / "beta", seed=5, rank=4, targets=("o_proj",)),
    }
