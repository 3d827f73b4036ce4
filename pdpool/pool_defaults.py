"""Defaults of the settings that more than one part of a pool holds, each written once.

The settings dataclasses of the processes (the engine's EngineConfig, the sidecar's
SidecarSettings, the gateway's and the endpoint picker's RoutingSettings) take their field
defaults from here, and so does the operator's pool spec (operator/spec.py), which may not
import the engine or the sidecar (tests/test_repository_layout.py): a pool the operator
starts and one `pdpool up` starts get the same values. The CRD's `default:`s repeat them for
`kubectl explain` and the API server; tests/operator/test_crd_defaults.py holds them equal.
No imports: every program reads this.
"""

from __future__ import annotations

# How a sidecar serves a request (spec.router.mode, the sidecar's --mode).
ROUTER_MODES = ("decode-first", "prefill-first", "aggregated")
ROUTER_MODE = "decode-first"
# decode-first: the decode engine takes a request whose cached prefix covers at least this
# share of the prompt (spec.router.cacheHitThreshold, the sidecar's --cache-hit-threshold).
CACHE_HIT_THRESHOLD = 0.5
# decode's cached prefix is offered to prefill from this many tokens (0: always).
KV_PULL_THRESHOLD = 0
# seconds per prefill attempt (spec.router.prefillTimeoutSeconds, --prefill-timeout)
PREFILL_TIMEOUT_S = 30.0
# tokens per KV block: the engines' --block-size, which the KV-event indexes must match
KV_BLOCK_SIZE = 16
# the port clients reach the pool's front door on (spec.gateway.port, `pdpool up --port`)
GATEWAY_PORT = 8080
# what one in-flight request on a backend costs in KV-aware routing, in prompt tokens
KV_LOAD_COST_TOKENS = 64.0
