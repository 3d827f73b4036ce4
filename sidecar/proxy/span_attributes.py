"""Span attributes of the sidecar's legs (pdpool.tracing): pure functions of a request and
its legs' bodies and answers."""

from __future__ import annotations

from typing import Any, Optional

from pdpool import tracing

from . import legs
from .exchange import Exchange, PrefillResult


def leg_attributes(ex: Exchange, leg: dict[str, Any]) -> dict[str, Any]:
    """A decode leg's span attributes: the request, and the KV it is to pull (blocks,
    tokens, the lease on them and whose they are) after a prefill leg."""
    out: dict[str, Any] = {
        tracing.GEN_AI_REQUEST_ID: ex.request_id,
        "pdpool.path": ex.path_taken,
        "pdpool.stream": ex.stream,
    }
    kv = leg.get(legs.KV_PARAMS)
    if isinstance(kv, dict):
        out.update(kv_attributes(kv))
    return out


def kv_attributes(kv: dict[str, Any]) -> dict[str, Any]:
    """kv_transfer_params as span attributes (what moves, from where, under which lease)."""
    blocks = kv.get("remote_block_ids") or []
    if blocks and isinstance(blocks[0], list):  # one list per KV group
        blocks = blocks[0]
    lease = kv.get("pdpool_lease")
    out = {
        "pdpool.kv.blocks": len(blocks),
        "pdpool.kv.tokens": kv.get("remote_num_tokens"),
        "pdpool.kv.remote_engine": kv.get("remote_engine_id"),
        "pdpool.kv.remote": f"{kv.get('remote_host')}:{kv.get('remote_port')}",
        "pdpool.kv.lease": lease.get("id") if isinstance(lease, dict) else None,
    }
    return {k: v for k, v in out.items() if v is not None}


def rejection_attributes(rejection: Optional[dict[str, Any]]) -> dict[str, Any]:
    if rejection is None:
        return {"pdpool.decision": "accepted"}
    return {
        "pdpool.decision": "rejected",
        "pdpool.decode.cached_tokens": rejection.get("remote_num_tokens") or 0,
    }


def prefill_result_attributes(result: PrefillResult) -> dict[str, Any]:
    """The prefill leg's outcome and, when it went on, the KV decode is to pull."""
    if result.client_error:
        return {"pdpool.outcome": "client_error"}
    if result.kv is None:
        return {"pdpool.outcome": "fallback"}
    return {"pdpool.outcome": "ok", **kv_attributes(result.kv)}
