"""Kernel tests run the Triton kernels under the interpreter when no GPU is present.

Triton decides interpreter vs compiler when a kernel is DECORATED (module import), and
reads the variable again while interpreting, so: the kernel modules are imported here with
TRITON_INTERPRET=1, the variable is restored right after, and an autouse fixture sets it
again only for the duration of each test in this folder. Other test folders (and the
servers they spawn) never see it.
"""

import importlib
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
KERNEL_MODULES = (
    "pdpool.kernels.kv_write",
    "pdpool.kernels.paged_attention_kernel",
    "pdpool.kernels.gated_delta",
    "pdpool.kernels.lora_kernel",
)


def _import_kernels_interpreted() -> None:
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        for name in KERNEL_MODULES:
            importlib.import_module(name)
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


if not HAS_CUDA:
    _import_kernels_interpreted()
    from pdpool.kernels import paged_attention_kernel as _pa

    if not _pa._interpreting():
        raise RuntimeError(
            "pdpool.kernels was imported before tests/kernel_ops/conftest.py set "
            "TRITON_INTERPRET=1; run the kernel tests in their own process"
        )


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch):
    if not HAS_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


@pytest.fixture
def device() -> torch.device:
    """Where the small-shape kernel tests run: the GPU if there is one, else the interpreter."""
    return torch.device("cuda" if HAS_CUDA else "cpu")
