"""Comparing logprobs from two separate computations (vLLM's check_logprobs_close does the
same): never exactly.

Two requests of the same prompt on the same engine need not compute the same floats: the
second may hit the prefix cache and prefill fewer tokens, in other shapes; the batch around a
request, the thread count and the CPU's instruction set change the summation order too. Token
ids, which greedy decoding makes equal, are compared exactly by the tests themselves.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# float32 tiny models: two computations differ by summation order only (seen: ~1e-6). Far
# below the gap between distinct tokens' logprobs, and far below any real bug (a wrong
# position, a missing temperature or a wrong softmax moves a logprob by 1e-2 or more).
LOGPROB_ATOL = 1e-4


def assert_logprobs_close(
    actual: Sequence[float], expected: Sequence[float], abs_tol: float = LOGPROB_ATOL
) -> None:
    """Equal length, and each logprob within `abs_tol` of its counterpart."""
    assert len(actual) == len(expected), f"{len(actual)} logprobs vs {len(expected)}"
    far = [
        (i, a, e)
        for i, (a, e) in enumerate(zip(actual, expected, strict=True))
        if not math.isclose(a, e, rel_tol=0.0, abs_tol=abs_tol)
    ]
    assert not far, f"logprobs differ by more than {abs_tol} at (index, actual, expected): {far}"
