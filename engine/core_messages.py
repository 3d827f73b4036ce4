"""The messages between the engine server and its engine core, one type per message (as
vLLM's EngineCoreRequest / EngineCoreOutputs). Nothing here needs torch: the server process
imports it.

    server -> core   AddRequest, AbortRequest, ReleaseLease, StopCore
    core -> server   CoreReady or CoreFailedToStart (once, at start-up), StepOutputs (after
                     a step with outputs, or at least every HEARTBEAT_S while it steps),
                     Heartbeat (while idle, every HEARTBEAT_S), RequestsFailed,
                     RequestRefused, LeaseReleased
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

from pdpool.engine.engine_state import EngineState
from pdpool.engine.lora.registry import LoRARef
from pdpool.engine.outputs import (
    EngineBusy,
    KVTransferRefused,
    RequestOutput,
    RequestRejected,
)
from pdpool.engine.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class EngineFacts:
    """What the server must know of its engine before it serves, and to refuse what the
    engine could never run without asking it."""

    model_name: str
    max_model_len: int
    kv_capacity_tokens: int
    # What must match for another engine's KV to mean the same here (model revision,
    # dtype, block size, layout): routers keep P/D pairs within one fingerprint.
    kv_fingerprint: str = ""


# --- server -> core -----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: Optional[str] = None
    cache_hit_threshold: Optional[float] = None
    kv_transfer_params: Optional[dict[str, Any]] = None
    priority: int = 0
    lora: Optional[LoRARef] = None


@dataclasses.dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclasses.dataclass(frozen=True)
class ReleaseLease:
    call_id: int
    params: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class StopCore:
    pass


# --- core -> server -----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CoreReady:
    facts: EngineFacts
    state: EngineState


@dataclasses.dataclass(frozen=True)
class CoreFailedToStart:
    why: str


@dataclasses.dataclass(frozen=True)
class StepOutputs:
    outputs: list[RequestOutput]
    state: EngineState


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    state: EngineState


@dataclasses.dataclass(frozen=True)
class RequestsFailed:
    request_ids: list[str]
    message: str
    state: EngineState


# How a refusal's exception crosses the process boundary: by kind, never pickled.
_REFUSAL_KINDS: dict[str, type[Exception]] = {
    "rejected": RequestRejected,
    "kv_refused": KVTransferRefused,
    "invalid": ValueError,
    "busy": EngineBusy,
    "error": RuntimeError,
}


@dataclasses.dataclass(frozen=True)
class RequestRefused:
    request_id: str
    kind: str  # a key of _REFUSAL_KINDS
    message: str

    @classmethod
    def of(cls, request_id: str, exc: Exception) -> "RequestRefused":
        kind = "error"
        for name, exc_type in _REFUSAL_KINDS.items():
            if isinstance(exc, exc_type):
                kind = name
                break
        return cls(request_id, kind, str(exc) or type(exc).__name__)

    def exception(self) -> Exception:
        return _REFUSAL_KINDS.get(self.kind, RuntimeError)(self.message)


@dataclasses.dataclass(frozen=True)
class LeaseReleased:
    call_id: int
    released: bool


ToCore = Union[AddRequest, AbortRequest, ReleaseLease, StopCore]
FromCore = Union[
    CoreReady,
    CoreFailedToStart,
    StepOutputs,
    Heartbeat,
    RequestsFailed,
    RequestRefused,
    LeaseReleased,
]
