"""A request's state machine inside the engine.

WAITING -> RUNNING -> FINISHED_*; RUNNING -> WAITING (preempted: its KV is dropped and it
is recomputed, keeping its place in line: request_queue.py); WAITING_FOR_REMOTE_KVS while a
connector loads its KV from another engine.
"""

from __future__ import annotations

import enum
import time
from typing import Any, Optional, Union

from pdpool.engine.kv.hashing import BlockHasher
from pdpool.engine.outputs import RequestPhases, TokenLogprob
from pdpool.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_CACHE_THRESHOLD = "cache_threshold"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")


def block_extra_keys(lora: Any, cache_salt: Optional[str]) -> tuple[object, ...]:
    """What a prompt's first block hashes besides its tokens, in vLLM's order: the adapter
    (its name and content digest: KV computed under one adapter is never another's, nor
    the base model's), then the cache salt. Every later block chains through it."""
    keys: tuple[object, ...] = (lora.hash_key,) if lora is not None else ()
    return keys + ((cache_salt,) if cache_salt else ())


def published_extra_keys(request: "Request") -> Optional[tuple[object, ...]]:
    """The first block's extra keys as KV events publish them (vLLM: untagged, the
    adapter's name then the salt); None when there are none."""
    keys: tuple[object, ...] = (request.lora.name,) if request.lora is not None else ()
    keys += (request.cache_salt,) if request.cache_salt else ()
    return keys or None


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        cache_salt: Optional[str] = None,
        cache_hit_threshold: Optional[float] = None,
        kv_transfer_params: Optional[dict[str, Any]] = None,
        block_size: int = 16,
        arrival_time: Optional[float] = None,
        priority: int = 0,
        lora: Any = None,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.cache_salt = cache_salt
        self.cache_hit_threshold = cache_hit_threshold
        self.kv_transfer_params = kv_transfer_params
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        # vLLM's request priority: lower runs first under --scheduling-policy priority.
        self.priority = priority
        self.phases = RequestPhases(self.arrival_time)  # stamped by the scheduler
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Tokens found in the prefix cache (local, plus remote once a connector loads them)
        # at first admission: what usage.prompt_tokens_details.cached_tokens reports. None
        # until it is first admitted.
        self.num_cached_tokens: Optional[int] = None
        self.num_preemptions = 0
        self.error: Optional[str] = None
        self.error_status: Optional[int] = None  # the HTTP status its error maps to
        # What ended it, as vLLM's stop_reason: the stop string or stop token id (None for
        # the tokenizer's EOS, a length, or an ended grammar).
        self.stop_reason: Union[int, str, None] = None
        # Connector bookkeeping: its remote KV was pulled already (never twice), and the
        # kv_transfer_params the response carries.
        self.kv_consumed = False
        self.kv_lease: Any = None  # the peer's lease the params name, once checked
        # Prompt tokens that came from a peer's KV (loaded and verified): part of
        # num_cached_tokens, reported apart in usage.
        self.num_pulled_tokens = 0
        self.kv_params_out: Optional[dict[str, Any]] = None
        # Recurrent-state models: the state slot a prefill leg keeps for the decode engine.
        self.transfer_state_slot: Optional[int] = None
        # With prompt_logprobs: those of prompt tokens 1.. found so far (the runner's).
        self.prompt_logprobs: list[TokenLogprob] = []
        self.prompt_logprobs_sent = False
        # Guided decoding: the request's grammar matcher (structured/grammar.py), if any.
        self.grammar: Any = None
        # Its LoRA adapter (engine/lora/registry.LoRARef), None for the base model.
        self.lora = lora
        self.hasher = BlockHasher(block_size, extra_keys=block_extra_keys(lora, cache_salt))
        self.block_hashes: list[bytes] = []
        self.update_block_hashes()

    # --- tokens -------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building all_token_ids (called every step)."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    def append_output_token(self, token_id: int) -> None:
        if not self.output_token_ids:
            self.phases.first_token = time.monotonic()
        self.output_token_ids.append(token_id)
        self.update_block_hashes()

    def update_block_hashes(self) -> None:
        """Extends the chained hashes to every full block of the known tokens."""
        num_full = self.num_tokens // self.hasher.block_size
        if num_full > len(self.block_hashes):
            self.block_hashes.extend(
                self.hasher.hash_blocks(self.all_token_ids, self.block_hashes, num_full)
            )

    @property
    def computes_prompt_rows(self) -> bool:
        """Its prompt's logprobs are still to come: every prompt row must be computed here
        (no prefix hit, no KV from a peer or a tier, never rejected for a low hit)."""
        return (
            self.sampling_params.prompt_logprobs is not None
            and len(self.prompt_logprobs) < self.num_prompt_tokens - 1
        )

    # --- state --------------------------------------------------------------------------
    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def is_prefill_leg(self) -> bool:
        """A P/D prefill leg (the router asked us to hand the KV to a decode engine)."""
        return bool(self.kv_transfer_params and self.kv_transfer_params.get("do_remote_decode"))

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id}, {self.status.value}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
