"""Wire types shared by the engine and the sidecar.

No heavy imports here: the sidecar and gateway images do not carry torch.
Field names follow vLLM's NixlConnector so that vLLM-based routers work against our engine
and our sidecar works against vLLM.
"""
from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict

# finish_reason of a request rejected because too little of its prompt was cached.
FINISH_CACHE_THRESHOLD = "cache_threshold"


class KVTransferParams(BaseModel):
    """`kv_transfer_params` of a request or response (NixlConnector fields)."""

    model_config = ConfigDict(extra="allow")

    do_remote_prefill: bool = False
    do_remote_decode: bool = False
    remote_engine_id: Optional[str] = None
    remote_request_id: Optional[str] = None
    # One list of block ids, or one list per KV cache group for hybrid models.
    remote_block_ids: Optional[Union[list[int], list[list[int]]]] = None
    remote_host: Optional[str] = None
    remote_port: Optional[int] = None
    tp_size: int = 1
    # Pulls in the other direction (prefill reads a decode engine's cached prefix).
    remote_num_tokens: Optional[int] = None

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


def validate_threshold(value: Any, name: str = "cache_hit_threshold") -> Optional[float]:
    """Returns a threshold in [0, 1] or None; raises ValueError with a readable message."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number in [0, 1], got {type(value).__name__}")
    if not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")
    return float(value)
