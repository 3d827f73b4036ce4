"""The Triton / torch switch the engine relies on."""

import subprocess
import sys

import pytest
import torch

from pdpool.kernels import ops


def test_use_triton_on_cuda_only(monkeypatch):
    monkeypatch.delenv(ops.FORCE_TORCH_ENV, raising=False)
    assert ops.use_triton(torch.device("cuda", 0))
    assert ops.use_triton("cuda")
    assert not ops.use_triton(torch.device("cpu"))
    assert not ops.use_triton("meta")


@pytest.mark.parametrize("value,forced", [("1", True), ("true", True), ("0", False), ("", False)])
def test_force_torch_switch(monkeypatch, value, forced):
    monkeypatch.setenv(ops.FORCE_TORCH_ENV, value)
    assert ops.use_triton("cuda") is not forced


def test_cpu_path_never_touches_triton(monkeypatch):
    """On CPU every op runs its torch reference, even when a Triton kernel would be wrong."""
    import pdpool.kernels.paged_attention_kernel as pa

    def boom(*args, **kwargs):
        raise AssertionError("Triton path taken on CPU")

    monkeypatch.setattr(pa, "paged_attention_triton", boom)
    q = torch.randn(2, 2, 16)
    cache = torch.randn(2, 16, 2, 16)
    out = ops.paged_attention(
        q, cache, cache, torch.tensor([[0]]), torch.tensor([0, 2]), torch.tensor([5]), 0.25
    )
    assert out.shape == q.shape and torch.isfinite(out).all()


def test_importing_the_api_does_not_load_triton_kernels():
    """The engine imports pdpool.kernels on CPU hosts too; the Triton modules stay unloaded."""
    code = (
        "import sys, pdpool.kernels; "
        "print([m for m in sys.modules if m.startswith('pdpool.kernels.') "
        "and m.split('.')[-1] in ('paged_attention_kernel', 'kv_write', 'gated_delta')])"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
