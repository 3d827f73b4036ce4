"""What each engine would compute of a prompt, from the engines' KV events: the KV index's
side of precise routing (routing/kv_cost.py turns it into an order and a P/D path).

    work(engine) = uncached prompt tokens (what it would have to prefill)
                   + tier_cost * tier tokens (loaded from an offload tier: cheaper than
                     computing them, dearer than a pool hit)
                   + pending prefill tokens (routed there, not yet reported stored)

(routing adds load_cost_tokens * load(engine) for the requests in flight or queued.)

`uncached = prompt_tokens - block_size * prefix_hit_blocks(engine)`, the hit read from the
KV index (index.py) fed by each engine's ZeroMQ events. The pending tokens are the
blocks of requests routed to the engine that its events have not confirmed stored yet: their
prefill is queued or running there. Those this request shares are left out (it waits for
them rather than computing them again elsewhere). A request count alone weighs a queued
1k-token prefill like a queued 20-token one; with pending work, a burst of new prompts
spreads over the engines instead of following the hash order onto a few. Engines the index
does not know (no events configured, or a gap not yet resynchronised) are scored as holding
nothing; when no engine is known the caller keeps today's hash-affinity order.

`hits` (cached + tier tokens per engine) is what the P/D decision reads (routing/pd.py):
tier tokens count as cached there, as the engine counts them. Once routed, `expect` records
the prompt's blocks as pending on the chosen engine.

Tokenization: completions with token-id prompts need none; string prompts use the model's
`tokenizer.json` through `tokenizers` (Rust, no torch), run off the event loop by callers.
Chat requests are not tokenized here (the chat template lives in the engine): the gateway
asks a decode engine's /tokenize for them (engine_tokenize.py), as for string prompts when it
has no tokenizer.json.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, TypeVar

from pdpool.kv_events import KVEventSubscriber
from pdpool.prompt_truncation import ids_the_engine_keeps

from .index import KVIndex, request_block_keys

log = logging.getLogger(__name__)
T = TypeVar("T")

# Up to these sizes a prompt is tokenized and hashed on the event loop: well under a
# millisecond, less than handing it to a thread and back.
INLINE_PROMPT_CHARS = 8192
INLINE_PROMPT_TOKENS = 4096


@dataclass(frozen=True)
class PromptCosts:
    """One prompt against the engines of `order`."""

    keys: list[Any]  # the prompt's block keys (request_block_keys)
    prompt_tokens: int
    hits: dict[str, int]  # tokens cached or on a tier, per engine
    work: dict[str, float]  # tokens to compute, tier loads and pending prefills, per engine
    known: bool  # False: the index knows none of these engines (no precise order)


@dataclass
class _Feed:
    """One engine's subscription: the thread reading it, and what stops that thread."""

    thread: threading.Thread
    stop: threading.Event


# What a token loaded from an offload tier costs, relative to computing it (reading a few
# KiB per token from disk against a forward pass): cheaper than compute, dearer than a hit.
TIER_COST = 0.2


class KVCosts:
    def __init__(
        self,
        block_size: int,
        tokenizer_file: Optional[str] = None,
        max_blocks_per_engine: int = 1_000_000,
        expect_s: float = 5.0,
        tier_cost: float = TIER_COST,
    ):
        self.block_size = block_size
        if not 0.0 <= tier_cost <= 1.0:
            raise ValueError(f"tier_cost must be in [0, 1], got {tier_cost}")
        self.tier_cost = tier_cost
        self.index = KVIndex(max_blocks_per_engine, expect_s)
        self._tokenizer = None
        if tokenizer_file:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(tokenizer_file)
        self._feeds: dict[str, _Feed] = {}
        self._stop = threading.Event()
        # Decisions off the loop run one at a time: each sees the expectations (pending
        # work) of the one before, so a burst of simultaneous new prompts spreads.
        self._deciding = asyncio.Lock()

    # --- feeding the index ---------------------------------------------------------------
    def subscribe(self, backend: str, endpoint: str, replay_endpoint: Optional[str] = None) -> None:
        """A thread that feeds `backend`'s events (its engine's PUB socket) to the index;
        it replaces an earlier subscription of `backend`."""
        self.unsubscribe(backend)
        sub = KVEventSubscriber(endpoint, replay_endpoint)
        # Known from now: a pool that just started publishes nothing until its first request
        # computes a block, and the requests before that should leave expectations too.
        self.index.watch(backend)
        stop = threading.Event()

        def stopped() -> bool:
            return stop.is_set() or self._stop.is_set()

        def run() -> None:
            try:
                while not stopped():
                    try:
                        got = sub.recv(timeout_s=0.2)
                        if got is not None:
                            self.index.on_message(backend, got[0], got[1], replay=sub.replay)
                    except Exception:  # a bad message must not stop the feed
                        if stopped():
                            return
                        log.exception("kv events from %s", backend)
            finally:
                sub.close()  # here: a ZeroMQ socket belongs to the thread that uses it

        t = threading.Thread(target=run, name=f"kv-events-{backend}", daemon=True)
        self._feeds[backend] = _Feed(t, stop)
        t.start()

    def unsubscribe(self, backend: str) -> None:
        """Stops `backend`'s feed and forgets its blocks (its engine is gone)."""
        feed = self._feeds.pop(backend, None)
        if feed is None:
            return
        feed.stop.set()
        feed.thread.join(timeout=2)
        self.index.forget(backend)

    def close(self) -> None:
        self._stop.set()
        feeds = list(self._feeds.values())
        for feed in feeds:
            feed.thread.join(timeout=2)

    # --- deciding ------------------------------------------------------------------------
    async def prompt_token_ids_async(self, body: Any) -> Optional[list[int]]:
        """`prompt_token_ids` off the event loop when the prompt is a long string (a short
        one tokenizes faster than a thread hop)."""
        prompt = body.get("prompt") if isinstance(body, dict) else None
        if isinstance(prompt, str) and len(prompt) > INLINE_PROMPT_CHARS:
            return await asyncio.to_thread(self.prompt_token_ids, body)
        return self.prompt_token_ids(body)

    async def off_loop_if_long(self, n_tokens: int, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, off the event loop for a long prompt (it hashes every block); those
        run one at a time, each seeing the expectations of the one before."""
        if n_tokens > INLINE_PROMPT_TOKENS:
            async with self._deciding:
                return await asyncio.to_thread(fn, *args)
        return fn(*args)

    def prompt_token_ids(self, body: Any) -> Optional[list[int]]:
        """A completion's prompt as token ids, as the engine keeps them (a positive
        `truncate_prompt_tokens` applied); None when this router cannot tell."""
        if not isinstance(body, dict) or "messages" in body:
            return None
        prompt = body.get("prompt")
        ids: Optional[list[int]] = None
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = prompt
        elif isinstance(prompt, str) and self._tokenizer is not None:
            ids = list(self._tokenizer.encode(prompt, add_special_tokens=False).ids)
        return None if ids is None else ids_the_engine_keeps(ids, body)

    def costs(
        self,
        order: Sequence[str],
        token_ids: Sequence[int],
        cache_salt: Optional[str] = None,
        model: Optional[str] = None,
    ) -> PromptCosts:
        """The prompt's cost on each engine of `order`. `model`: the request's; when engines
        published blocks under a LoRA adapter of that name, the prompt's keys are that
        adapter's (another adapter's blocks never count)."""
        n = len(token_ids)
        lora = model if model is not None and model in self.index.lora_names else None
        keys = request_block_keys(token_ids, self.block_size, cache_salt, lora)
        found = {b: self.index.prefix_hit_blocks(b, keys) for b in order}
        if all(h is None for h in found.values()):
            return PromptCosts(keys, n, dict.fromkeys(order, 0), {}, False)
        # As the engine: whole blocks, at least one token left to compute.
        limit = max(n - 1, 0) // self.block_size
        cached = {b: min(h or 0, limit) * self.block_size for b, h in found.items()}
        tier = {
            b: min(
                self.index.tier_hit_blocks(b, keys, cached[b] // self.block_size) * self.block_size,
                limit * self.block_size - cached[b],
            )
            for b in order
        }
        pending = {b: self.block_size * self.index.pending_blocks(b, keys) for b in order}
        work = {b: n - cached[b] - tier[b] + self.tier_cost * tier[b] + pending[b] for b in order}
        return PromptCosts(keys, n, {b: cached[b] + tier[b] for b in order}, work, True)

    def expect(self, engine: str, costs: PromptCosts) -> None:
        """The prompt was routed to `engine`: its blocks are pending there until stored."""
        self.index.expect(engine, costs.keys)
