"""Gateway API keys: clients must send one of the keys listed in a file.

- the file holds one key per line (blank lines and `#` comments ignored); keys shorter
  than 16 characters are refused at load (a typo must not become a guessable key);
- a client sends `Authorization: Bearer <key>` (what OpenAI clients send) or `x-api-key`;
- keys are compared as SHA-256 digests with `hmac.compare_digest`, against every key, so
  neither the length nor the position of a match shows in the timing;
- the file is re-read when it changes (checked at most once a second, never half a file:
  reloading.py): a rotated Kubernetes Secret takes effect without a restart. A file that
  became unreadable or empty keeps the last good keys (and logs), rather than opening or
  closing the door.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any, Optional

from .reloading import ReloadingFile

MIN_KEY_CHARS = 16
# Paths that stay open: the kubelet's probes and the metrics scraper (counters only: no
# prompts, no keys; whoever reaches the gateway can read them).
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})


class ApiKeyError(ValueError):
    pass


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def parse_keys(text: str) -> list[bytes]:
    keys = []
    for n, line in enumerate(text.splitlines(), 1):
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        if len(key) < MIN_KEY_CHARS:
            raise ApiKeyError(f"API key on line {n} is shorter than {MIN_KEY_CHARS} characters")
        keys.append(_digest(key))
    if not keys:
        raise ApiKeyError("no API key in the file")
    return keys


def presented_key(headers: dict[str, str]) -> Optional[str]:
    """The key a request carries (header names lower-case), or None."""
    auth = headers.get("authorization", "")
    scheme, _, value = auth.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return headers.get("x-api-key") or None


class ApiKeys:
    def __init__(self, path: str, recheck_s: float = 1.0, **reload: Any):
        self.path = path
        # raises at startup: a bad file is a configuration error
        self._file = ReloadingFile(path, parse_keys, "API keys file", recheck_s, **reload)

    def allows(self, key: Optional[str]) -> bool:
        keys = self._file.current()
        if not key:
            return False
        digest = _digest(key)
        ok = False
        for known in keys:  # no early exit: every key is compared
            ok |= hmac.compare_digest(digest, known)
        return ok
