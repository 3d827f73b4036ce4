"""The tenants file: who may call the pool, with what weight, priority and limits.

```yaml
tenants:
  - name: team-a
    keys: ["a-key-of-at-least-16-chars"]   # API keys (Authorization: Bearer / x-api-key)
    weight: 2                # share of the pool within its priority band (> 0; default 1)
    priority: 0              # its requests' band (higher is served first; default 0)
    maxPriority: 5           # the highest a request may ask for (default: priority)
    maxConcurrency: 8        # requests admitted at once (absent or 0: no limit)
    maxQueued: 100           # requests waiting at once (0: none wait; default 100)
    queueTimeoutSeconds: 30  # longest wait in the queue before 429 (default 30)
    tokensPerMinute: 60000   # prompt + max_tokens estimate per minute (absent or 0: no limit)
objectives:                  # GIE InferenceObjective names -> priority (optional)
  - {name: critical, priority: 10}
pool:                        # when the pool counts as saturated (saturation.py), optional
  maxInFlightPerBackend: 0   # admitted requests per healthy backend (0: learned, from ITL)
  queueDepthThreshold: 5     # an engine with this many waiting (vllm:num_requests_waiting)
  kvCacheUsageThreshold: 0.8 #   or this KV usage (vllm:kv_cache_usage_perc) is saturated
  maxQueued: 1000            # all queues together; beyond it the lowest band is shed first
```

A tenant is found by its API key, or, for pools behind another gateway that authenticates,
by the value of a header the operator names (matched against `name`). Keys are kept as
SHA-256 digests only. The file is re-read when it changes (at most once a second, never
half a file: net/reloading.py); a bad new file keeps the last good configuration and logs
why, as the API keys file does.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import math
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Optional

import yaml

from ..net.apikeys import MIN_KEY_CHARS
from ..net.reloading import ReloadingFile

log = logging.getLogger("pdpool.flow")

PRIORITY_HEADER = "x-pdpool-priority"
# GIE's header naming the request's InferenceObjective (its priority comes from the objective).
OBJECTIVE_HEADER = "x-gateway-inference-objective"
# A priority header is a plain ASCII integer of a few digits; anything else (longer, "1e3",
# "1_0", other scripts' digits) is malformed and the request keeps its tenant's band.
PRIORITY_VALUE = re.compile(r"[+-]?[0-9]{1,10}")

TENANT_FIELDS = {
    "name": "name",
    "keys": "keys",
    "weight": "weight",
    "priority": "priority",
    "maxPriority": "max_priority",
    "maxConcurrency": "max_concurrency",
    "maxQueued": "max_queued",
    "queueTimeoutSeconds": "queue_timeout_s",
    "tokensPerMinute": "tokens_per_minute",
}
POOL_FIELDS = {
    "maxInFlightPerBackend": "max_in_flight_per_backend",
    "queueDepthThreshold": "queue_depth_threshold",
    "kvCacheUsageThreshold": "kv_cache_usage_threshold",
    "maxQueued": "max_queued",
}


class TenantsError(ValueError):
    """The tenants file cannot be used; the message names the field."""


@dataclass(frozen=True)
class Tenant:
    name: str
    key_digests: tuple[bytes, ...] = ()
    weight: float = 1.0
    priority: int = 0
    max_priority: int = 0
    max_concurrency: int = 0  # 0: no limit
    max_queued: int = 100
    queue_timeout_s: float = 30.0
    tokens_per_minute: int = 0  # 0: no limit


@dataclass(frozen=True)
class PoolLimits:
    max_in_flight_per_backend: int = 0
    queue_depth_threshold: int = 5  # GIE's saturation detector defaults
    kv_cache_usage_threshold: float = 0.8
    max_queued: int = 1000


@dataclass(frozen=True)
class TenantsConfig:
    tenants: dict[str, Tenant]
    objectives: dict[str, int] = field(default_factory=dict)
    pool: PoolLimits = PoolLimits()
    by_key: dict[bytes, Tenant] = field(default_factory=dict)

    def tenant_for_key(self, key: Optional[str]) -> Optional[Tenant]:
        # A dict lookup by SHA-256 digest: a client cannot steer the digest's bits, so the
        # lookup's timing tells it nothing about the keys.
        return self.by_key.get(digest(key)) if key else None

    @cached_property
    def bands(self) -> tuple[int, ...]:
        """The priority bands the file names (tenants' priority and maxPriority, objectives'
        priority): the only ones a request can be in, so queues and metric series stay as
        few as the file makes them whatever clients send."""
        named = {p for t in self.tenants.values() for p in (t.priority, t.max_priority)}
        return tuple(sorted(named | set(self.objectives.values())))

    def band(self, priority: int) -> int:
        """The highest band at or below `priority` (the lowest band when none is)."""
        bands = self.bands
        if not bands:
            return priority
        return bands[max(bisect.bisect_right(bands, priority) - 1, 0)]

    def priority_of(self, tenant: Tenant, headers: dict[str, str]) -> int:
        """The request's band: its InferenceObjective's priority, else its own header, else
        the tenant's; never above the tenant's maxPriority, and always one the file names."""
        wanted = tenant.priority
        objective = headers.get(OBJECTIVE_HEADER)
        asked = headers.get(PRIORITY_HEADER, "").strip()
        if objective is not None and objective in self.objectives:
            wanted = self.objectives[objective]
        elif PRIORITY_VALUE.fullmatch(asked):
            wanted = int(asked)
        return self.band(min(wanted, tenant.max_priority))


def engine_priority(band: int) -> int:
    """The engines' `priority` field for a request in `band`: the one mapping, used by every
    front-end. Bands (this file's, GIE's InferenceObjective priority) are higher-first; an
    engine's priority (vLLM's, under --scheduling-policy priority) is lower-first. So the
    engine priority is -band: band 10 runs before band 0, band 0 before band -1."""
    return -band


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


# ---------------------------------------------------------------------- validation
def _number(where: str, value: Any, *, integer: bool, low: float, strict: bool = False) -> Any:
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or (not integer and not math.isfinite(value)):
        raise TenantsError(f"{where}: must be {'an integer' if integer else 'a number'}")
    if value < low or (strict and value == low):
        raise TenantsError(f"{where}: must be {'>' if strict else '>='} {low}, got {value}")
    return value


def _fields(where: str, raw: Any, known: dict[str, str]) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise TenantsError(f"{where}: must be a mapping")
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise TenantsError(f"{where}: unknown field(s) {', '.join(map(str, unknown))}")
    return {known[k]: v for k, v in raw.items()}


def _keys(where: str, raw: Any) -> tuple[bytes, ...]:
    if not isinstance(raw, list) or not all(isinstance(k, str) for k in raw):
        raise TenantsError(f"{where}.keys: must be a list of strings")
    for n, key in enumerate(raw):
        if len(key.strip()) < MIN_KEY_CHARS:
            raise TenantsError(f"{where}.keys[{n}]: shorter than {MIN_KEY_CHARS} characters")
    return tuple(digest(k.strip()) for k in raw)


def _tenant(where: str, raw: Any) -> Tenant:
    f = _fields(where, raw, TENANT_FIELDS)
    name = f.get("name")
    if not isinstance(name, str) or not name.strip():
        raise TenantsError(f"{where}.name: a non-empty string is required")
    priority = _number(f"{where}.priority", f.get("priority", 0), integer=True, low=-(2**31))
    return Tenant(
        name=name.strip(),
        key_digests=_keys(where, f.get("keys", [])),
        weight=float(
            _number(f"{where}.weight", f.get("weight", 1), integer=False, low=0, strict=True)
        ),
        priority=priority,
        max_priority=_number(
            f"{where}.maxPriority", f.get("max_priority", priority), integer=True, low=priority
        ),
        max_concurrency=_number(
            f"{where}.maxConcurrency", f.get("max_concurrency", 0), integer=True, low=0
        ),
        max_queued=_number(f"{where}.maxQueued", f.get("max_queued", 100), integer=True, low=0),
        queue_timeout_s=float(
            _number(
                f"{where}.queueTimeoutSeconds",
                f.get("queue_timeout_s", 30),
                integer=False,
                low=0,
                strict=True,
            )
        ),
        tokens_per_minute=_number(
            f"{where}.tokensPerMinute", f.get("tokens_per_minute", 0), integer=True, low=0
        ),
    )


def _pool(raw: Any) -> PoolLimits:
    f = _fields("pool", raw, POOL_FIELDS)
    kv = _number(
        "pool.kvCacheUsageThreshold", f.get("kv_cache_usage_threshold", 0.8), integer=False, low=0
    )
    if kv > 1:
        raise TenantsError(f"pool.kvCacheUsageThreshold: must be <= 1, got {kv}")
    return PoolLimits(
        max_in_flight_per_backend=_number(
            "pool.maxInFlightPerBackend",
            f.get("max_in_flight_per_backend", 0),
            integer=True,
            low=0,
        ),
        queue_depth_threshold=_number(
            "pool.queueDepthThreshold", f.get("queue_depth_threshold", 5), integer=True, low=1
        ),
        kv_cache_usage_threshold=float(kv),
        max_queued=_number("pool.maxQueued", f.get("max_queued", 1000), integer=True, low=0),
    )


def _objectives(raw: Any) -> dict[str, int]:
    if not isinstance(raw, list):
        raise TenantsError("objectives: must be a list of {name, priority}")
    out: dict[str, int] = {}
    for n, item in enumerate(raw):
        f = _fields(f"objectives[{n}]", item, {"name": "name", "priority": "priority"})
        name = f.get("name")
        if not isinstance(name, str) or not name:
            raise TenantsError(f"objectives[{n}].name: a non-empty string is required")
        out[name] = _number(
            f"objectives[{n}].priority", f.get("priority", 0), integer=True, low=-(2**31)
        )
    return out


def parse_tenants(text: str) -> TenantsConfig:
    """The tenants file's text -> its configuration; TenantsError naming the bad field."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise TenantsError(f"not valid YAML: {exc}") from None
    top = _fields(
        "the file", raw, {"tenants": "tenants", "objectives": "objectives", "pool": "pool"}
    )
    items = top.get("tenants")
    if not isinstance(items, list) or not items:
        raise TenantsError("tenants: a non-empty list is required")
    tenants: dict[str, Tenant] = {}
    by_key: dict[bytes, Tenant] = {}
    for n, item in enumerate(items):
        tenant = _tenant(f"tenants[{n}]", item)
        if tenant.name in tenants:
            raise TenantsError(f"tenants[{n}].name: {tenant.name!r} appears twice")
        for d in tenant.key_digests:
            if d in by_key:
                raise TenantsError(f"tenants[{n}].keys: a key also belongs to {by_key[d].name!r}")
            by_key[d] = tenant
        tenants[tenant.name] = tenant
    return TenantsConfig(
        tenants=tenants,
        objectives=_objectives(top.get("objectives", [])),
        pool=_pool(top.get("pool", {})),
        by_key=by_key,
    )


class TenantsFile:
    """The configuration from a file, re-read when it changes (net/reloading.py: never half a
    file; a bad new one keeps the last good configuration)."""

    def __init__(self, path: str, recheck_s: float = 1.0, **reload: Any) -> None:
        self.path = path
        try:
            self._file = ReloadingFile(path, parse_tenants, "tenants file", recheck_s, **reload)
        except (OSError, ValueError) as exc:  # a bad file at startup is a configuration error
            raise TenantsError(f"tenants file {path}: {exc}") from None

    def current(self) -> TenantsConfig:
        return self._file.current()
