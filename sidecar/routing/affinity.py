"""Prefix affinity for the gateway: which sidecar should own a conversation.

The key is the first N characters of the prompt (or of the rendered messages), so every
turn of a conversation, whose history only grows at the end, maps to the same key and
lands where its KV cache lives. A consistent-hash ring keeps most keys in place when
sidecars come and go; a load bound (consistent hashing with bounded loads) spills a key to
the next sidecar on the ring when its owner is much busier than the average.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from typing import Any, Callable, Iterable

DEFAULT_PREFIX_CHARS = 256


def affinity_key(body: Any, prefix_chars: int = DEFAULT_PREFIX_CHARS) -> str:
    if not isinstance(body, dict):
        return ""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts, size = [], 0
        for m in messages:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if not isinstance(content, str):
                content = repr(content)
            text = f"{m.get('role')}:{content}\n"
            parts.append(text)
            size += len(text)
            if size >= prefix_chars:
                break
        return "".join(parts)[:prefix_chars]
    prompt = body.get("prompt", body.get("token_ids"))  # the token route's prompt: its ids
    if isinstance(prompt, str):
        return prompt[:prefix_chars]
    if isinstance(prompt, list):  # token ids: about 4 characters per token
        return repr(prompt[: max(prefix_chars // 4, 1)])
    return ""


def _point(text: str) -> int:
    # surrogatepass: any str hashes (a lone surrogate is refused earlier, not crashed on).
    data = text.encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    def __init__(self, backends: Iterable[str], replicas: int = 64) -> None:
        self.backends = sorted(set(backends))
        ring = sorted((_point(f"{b}#{i}"), b) for b in self.backends for i in range(replicas))
        self._points = [p for p, _ in ring]
        self._owners = [b for _, b in ring]

    def walk(self, key: str) -> list[str]:
        """Distinct backends in ring order starting at the key's owner."""
        if not self._points:
            return []
        start = bisect.bisect(self._points, _point(key)) % len(self._points)
        seen: list[str] = []
        for i in range(len(self._points)):
            owner = self._owners[(start + i) % len(self._points)]
            if owner not in seen:
                seen.append(owner)
                if len(seen) == len(self.backends):
                    break
        return seen


def route_order(
    ring: HashRing,
    key: str,
    load: Callable[[str], int],
    healthy: Callable[[str], bool],
    balance: float = 1.25,
) -> tuple[list[str], bool]:
    """Backends to try in order, and whether the first is the key's preferred owner.

    The first is the first healthy backend on the key's walk whose load is under
    ceil(balance * (total load + 1) / healthy count); the rest follow in walk order
    (healthy ones first, unhealthy ones last: better a try than a refusal)."""
    walk = ring.walk(key)
    alive = [b for b in walk if healthy(b)]
    dead = [b for b in walk if not healthy(b)]
    if not alive:
        return dead, False
    cap = math.ceil(balance * (sum(load(b) for b in alive) + 1) / len(alive))
    chosen = next((b for b in alive if load(b) < cap), alive[0])
    rest = [b for b in alive if b != chosen]
    return [chosen, *rest, *dead], chosen == alive[0]
