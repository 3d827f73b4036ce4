"""An engine's LoRA residency read from its Prometheus text, as GIE's endpoint picker reads it.

vLLM exports `vllm:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}`:
a gauge whose value is the time of the reading and whose labels list (comma-joined) the
adapters of running and waiting requests. vLLM keeps every label set it ever set, so the
series with the largest value is the current one. The base model's name comes from the
`model_name` label of vLLM's request gauges.

The text is another process's answer: untrusted. Every size is bounded (line length, adapters
per label, name length, max_lora), a malformed line is skipped, never raised on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Optional

INFO = "vllm:lora_requests_info"
BASE_MODEL_GAUGES = ("vllm:num_requests_running{", "vllm:num_requests_waiting{")
MAX_LINE_CHARS = 64 * 1024  # a longer line of these series is skipped
MAX_ADAPTERS = 512  # a label listing more is not believed
MAX_NAME_CHARS = 256  # longer names are dropped (a request's model never matches them)
MAX_LORA = 4096  # a larger max_lora is not believed
MAX_LABELS = 16  # labels on one series


@dataclass(frozen=True)
class LoraInfo:
    """One engine's adapters now: those of running and of waiting requests, its --max-loras,
    and its base model's name (None: not exported)."""

    running: frozenset[str]
    waiting: frozenset[str]
    max_lora: int
    base_model: Optional[str] = None


def parse_labels(text: str) -> Optional[dict[str, str]]:
    """`a="x",b="y\\"z"` (the braces' inside) as a dict; None when malformed or too many."""
    labels: dict[str, str] = {}
    i, n = 0, len(text)
    while i < n:
        eq = text.find("=", i)
        if eq < 0:
            return None
        name = text[i:eq].strip()
        if not name.replace("_", "a").isalnum() or eq + 1 >= n or text[eq + 1] != '"':
            return None
        j, value = eq + 2, []
        while j < n and text[j] != '"':
            if text[j] == "\\" and j + 1 < n:
                nxt = text[j + 1]
                value.append("\n" if nxt == "n" else nxt)
                j += 2
            else:
                value.append(text[j])
                j += 1
        if j >= n:
            return None  # unterminated value
        labels[name] = "".join(value)
        if len(labels) > MAX_LABELS:
            return None
        i = j + 1
        while i < n and text[i] in ", ":
            i += 1
    return labels


def _series(line: str) -> Optional[tuple[dict[str, str], float]]:
    """A `name{labels} value [timestamp]` line's labels and value; None when malformed."""
    if len(line) > MAX_LINE_CHARS:
        return None
    open_, close = line.find("{"), line.rfind("}")
    if open_ < 0 or close < open_:
        return None
    labels = parse_labels(line[open_ + 1 : close])
    fields = line[close + 1 :].split()
    if labels is None or not fields:
        return None
    try:
        value = float(fields[0])
    except ValueError:
        return None
    return (labels, value) if math.isfinite(value) else None


def _adapters(label: str) -> Optional[frozenset[str]]:
    names = [n.strip() for n in label.split(",", MAX_ADAPTERS + 1) if n.strip()]
    if len(names) > MAX_ADAPTERS:
        return None
    return frozenset(n for n in names if len(n) <= MAX_NAME_CHARS)


def _info(labels: dict[str, str]) -> Optional[tuple[frozenset[str], frozenset[str], int]]:
    raw_max = labels.get("max_lora", "")
    if not raw_max.isdigit() or len(raw_max) > 6 or not 0 < int(raw_max) <= MAX_LORA:
        return None
    running = _adapters(labels.get("running_lora_adapters", ""))
    waiting = _adapters(labels.get("waiting_lora_adapters", ""))
    if running is None or waiting is None:
        return None
    return running, waiting, int(raw_max)


def parse_lora_info(text: str) -> Optional[LoraInfo]:
    """The engine's current LoRA series from its /metrics text; None when it exports none
    (LoRA off, or only malformed series)."""
    best: Optional[tuple[float, tuple[frozenset[str], frozenset[str], int]]] = None
    base: Optional[str] = None
    for line in _vllm_lines(text):
        if line.startswith(INFO + "{"):
            got = _series(line)
            info = _info(got[0]) if got is not None else None
            if got is not None and info is not None and (best is None or got[1] >= best[0]):
                best = (got[1], info)
        elif base is None and line.startswith(BASE_MODEL_GAUGES):
            got = _series(line)
            name = got[0].get("model_name") if got is not None else None
            if name and len(name) <= MAX_NAME_CHARS:
                base = name
    if best is None:
        return None
    running, waiting, max_lora = best[1]
    return LoraInfo(running, waiting, max_lora, base)


def _vllm_lines(text: str) -> Iterator[str]:
    """The lines starting with `vllm:` (no others are split out of a possibly large page);
    an overlong one comes out empty."""
    at = 0 if text.startswith("vllm:") else _next_vllm_line(text, 0)
    while at >= 0:
        end = text.find("\n", at)
        end = len(text) if end < 0 else end
        yield text[at:end] if end - at <= MAX_LINE_CHARS else ""
        at = _next_vllm_line(text, end)


def _next_vllm_line(text: str, pos: int) -> int:
    found = text.find("\nvllm:", pos)
    return found + 1 if found >= 0 else -1
