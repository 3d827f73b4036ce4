"""Run only by tests/test_skip_policy.py (explicitly, in a child pytest): one skip of each
kind, to show which the suite lets through and which it reports as failures."""

import pytest


def test_needs_a_binary_nobody_built():
    pytest.skip("no frobnicator binary: run scripts/frobnicator/build.sh")


@pytest.mark.skipif(True, reason="needs a CUDA device")
def test_needs_cuda():
    pass


@pytest.mark.gpu
def test_marked_gpu():
    pytest.skip("the GPU machine is busy")


@pytest.mark.xfail(reason="a known defect", strict=True)
def test_expected_failure():
    raise AssertionError
