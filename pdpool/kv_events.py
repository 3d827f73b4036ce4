"""KV cache events in vLLM's wire format: config, encoding, a publisher and a decoder.

No torch and no engine imports: the engine publishes with it, the gateway decodes with it.

Wire format (vLLM's `vllm/distributed/kv_events.py`):
- a ZeroMQ PUB socket sends multipart messages `(topic, seq, payload)`: `seq` is an 8-byte
  big-endian counter starting at 0, `payload` a msgpack `KVEventBatch` =
  `[ts, events, data_parallel_rank]`;
- each event is a map tagged by `"type"`: `BlockStored{block_hashes, parent_block_hash,
  token_ids, block_size, lora_id, medium, group_idx, kv_cache_spec_kind}`,
  `BlockRemoved{block_hashes, medium, group_idx}`, `AllBlocksCleared{}` (older vLLM encoded
  events as arrays `["BlockStored", hashes, parent, ...]`; `decode_batch` reads both);
- a ROUTER socket answers a replay request (one frame: the 8-byte start seq) with every
  buffered message from that seq on, `(topic, seq, payload)` each, then the end marker
  `(b"", seq=-1, b"")`.

Where it listens: vLLM binds the PUB socket only on a wildcard endpoint (`tcp://*:5557`, which
is every interface of the machine) and connects to any other; the replay socket always binds.
pdpool engines also take `"bind": true` to bind one address (the pod IP, 127.0.0.1), and
`"token_ids": false` to publish BlockStored without the prompt's tokens (KVEventsConfig).

Block hashes: pdpool publishes its chained sha256 digests as 32 raw bytes. vLLM publishes
bytes too, or, with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, the low 64 bits as an int.
`hash_key` folds both into the same int (the digest's last 8 bytes, big-endian), so an index
keyed by it treats pdpool and vLLM engines alike.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional, Union

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"

BlockHash = Union[bytes, int]


def hash_key(h: BlockHash) -> int:
    """The 64-bit key an index uses for a block hash, whichever way it was published."""
    if isinstance(h, int):
        return h & 0xFFFFFFFFFFFFFFFF
    return int.from_bytes(bytes(h)[-8:], "big")


# --- events -------------------------------------------------------------------------------
@dataclass
class BlockStored:
    block_hashes: list
    parent_block_hash: Optional[BlockHash]
    token_ids: list
    block_size: int
    lora_id: Optional[int] = None
    medium: Optional[str] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    # Per block: what else went into its hash (a cache_salt on a prompt's first block), or
    # None; None for the whole event when nothing did.
    extra_keys: Optional[list] = None
    # vLLM's: LOCAL or REMOTE relative to the publisher (an offload tier's disk, or a
    # directory shared by the pool); None: unspecified (the GPU/host pool itself).
    locality: Optional[str] = None
    # The LoRA adapter the block was computed under (vLLM 0.32: lora_name is the one to
    # key on; lora_id is kept for older readers).
    lora_name: Optional[str] = None


@dataclass
class BlockRemoved:
    block_hashes: list
    medium: Optional[str] = None
    group_idx: Optional[int] = None
    locality: Optional[str] = None


@dataclass
class AllBlocksCleared:
    pass


KVCacheEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass
class KVEventBatch:
    ts: float
    events: list
    data_parallel_rank: Optional[int] = None


def _event_to_wire(ev: KVCacheEvent, token_ids: bool = True) -> dict:
    if isinstance(ev, BlockStored):
        d: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": ev.block_hashes,
            "parent_block_hash": ev.parent_block_hash,
            # Empty, not absent, when withheld: vLLM's decoders expect the field.
            "token_ids": ev.token_ids if token_ids else [],
            "block_size": ev.block_size,
            "lora_id": ev.lora_id,
            "medium": ev.medium,
            "lora_name": ev.lora_name,
        }
        if ev.group_idx is not None:
            d["group_idx"] = ev.group_idx
        if ev.kv_cache_spec_kind is not None:
            d["kv_cache_spec_kind"] = ev.kv_cache_spec_kind
        if ev.extra_keys is not None:
            d["extra_keys"] = ev.extra_keys
        if ev.locality is not None:
            d["locality"] = ev.locality
        return d
    if isinstance(ev, BlockRemoved):
        d = {"type": "BlockRemoved", "block_hashes": ev.block_hashes, "medium": ev.medium}
        if ev.group_idx is not None:
            d["group_idx"] = ev.group_idx
        if ev.locality is not None:
            d["locality"] = ev.locality
        return d
    return {"type": "AllBlocksCleared"}


def encode_batch(batch: KVEventBatch, token_ids: bool = True) -> bytes:
    """`token_ids=False`: BlockStored events carry an empty token list (hashes only)."""
    import msgpack

    return msgpack.packb(
        [
            batch.ts,
            [_event_to_wire(e, token_ids) for e in batch.events],
            batch.data_parallel_rank,
        ],
        use_bin_type=True,
    )


_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
)


def _event_from_wire(raw: Any) -> Optional[KVCacheEvent]:
    if isinstance(raw, dict):
        kind, get = raw.get("type"), raw.get
    elif isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):
        # Array-encoded (older vLLM: tag first, then the fields in declaration order).
        kind = raw[0]
        names = {"BlockStored": _STORED_FIELDS, "BlockRemoved": ("block_hashes", "medium")}.get(
            kind, ()
        )
        # Not strict: a release may add trailing fields that this reader does not know.
        as_map = dict(zip(names, raw[1:], strict=False))
        get = as_map.get
    else:
        return None
    if kind == "BlockStored":
        return BlockStored(
            list(get("block_hashes") or []),
            get("parent_block_hash"),
            list(get("token_ids") or []),
            int(get("block_size") or 0),
            get("lora_id"),
            get("medium"),
            get("group_idx"),
            get("kv_cache_spec_kind"),
            _extra_keys(get("extra_keys")),
            get("locality"),
            lora_name=get("lora_name") if isinstance(get("lora_name"), str) else None,
        )
    if kind == "BlockRemoved":
        return BlockRemoved(
            list(get("block_hashes") or []), get("medium"), get("group_idx"), get("locality")
        )
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None  # an event kind this reader does not know: skipped


def _extra_keys(raw: Any) -> Optional[list]:
    if not isinstance(raw, (list, tuple)):
        return None
    return [tuple(k) if isinstance(k, (list, tuple)) else None for k in raw]


def decode_batch(payload: bytes) -> KVEventBatch:
    import msgpack

    raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if isinstance(raw, dict):  # a map-encoded batch, to be lenient
        raw = [raw.get("ts", 0.0), raw.get("events", []), raw.get("data_parallel_rank")]
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) > 2 else None
    out = [e for e in (_event_from_wire(r) for r in events) if e is not None]
    return KVEventBatch(float(ts), out, rank)


# --- config -------------------------------------------------------------------------------
@dataclass
class KVEventsConfig:
    """vLLM's --kv-events-config (the fields pdpool reads)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: Optional[str] = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    # pdpool's own keys (stock vLLM has neither; the operator and `pdpool up` give them to
    # pdpool engines only):
    # - bind: the PUB socket binds `endpoint` even when it names one address (the pod IP,
    #   127.0.0.1); vLLM binds only wildcards and connects to anything else;
    # - token_ids: false publishes BlockStored with an empty token list. The events then
    #   no longer spell out prompts; an index that keys blocks by the engine's own chained
    #   hashes (ours, for pdpool engines) needs nothing more. vLLM always sends them.
    bind: bool = False
    token_ids: bool = True
    extra: dict = field(default_factory=dict)

    @classmethod
    def parse(cls, value: Union[str, dict, None]) -> Optional["KVEventsConfig"]:
        if value is None or value == "":
            return None
        data = json.loads(value) if isinstance(value, str) else dict(value)
        if not isinstance(data, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {
            k: data.pop(k) for k in list(data) if k in cls.__dataclass_fields__ and k != "extra"
        }
        cfg = cls(**known, extra=data)
        if cfg.publisher not in ("zmq", "null"):
            raise ValueError(
                f"--kv-events-config publisher must be zmq or null, got {cfg.publisher!r}"
            )
        if not isinstance(cfg.bind, bool) or not isinstance(cfg.token_ids, bool):
            raise ValueError("--kv-events-config bind and token_ids must be true or false")
        if cfg.buffer_steps < 1 or cfg.hwm < 0:
            raise ValueError("--kv-events-config buffer_steps must be >= 1, hwm >= 0")
        return cfg

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard hosts and ipc/inproc endpoints, connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _bind(sock, endpoint: str) -> None:
    """Binds; an IPv6 address (an IPv6 pod IP, ::1) needs the socket's IPv6 option first."""
    import zmq

    host = endpoint.partition("://")[2].rpartition(":")[0]
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)
    sock.bind(endpoint)


# --- publisher ----------------------------------------------------------------------------
class KVEventPublisher:
    """Collects events from the engine thread and publishes them from a background thread.

    `record()` is a deque append (the engine step pays nothing else); the thread takes
    everything recorded so far as one batch every `flush_interval_s` (or at `flush()`),
    encodes, sends on PUB, keeps the last `buffer_steps` messages for replay, and answers
    replay requests on the ROUTER socket."""

    def __init__(
        self, config: KVEventsConfig, data_parallel_rank: int = 0, flush_interval_s: float = 0.005
    ):
        import zmq

        self.config = config
        self.rank = data_parallel_rank
        self.flush_interval_s = flush_interval_s
        self._pending: deque = deque()
        self._wake = threading.Event()
        self._running = True
        self._topic = config.topic.encode()
        self._buffer: deque = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self.published_events = 0
        # The process-wide context: a context of our own could be garbage-collected while
        # a socket of it is still in use, and its term() would then block that thread.
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        if config.bind or is_bind_endpoint(config.endpoint):
            _bind(self._pub, config.endpoint)
        else:
            self._pub.connect(config.endpoint)
        self._replay = None
        if config.replay_endpoint:
            # Always bound, as vLLM does: subscribers come to ask.
            self._replay = self._ctx.socket(zmq.ROUTER)
            _bind(self._replay, config.replay_endpoint)
        self._thread = threading.Thread(target=self._loop, name="kv-events", daemon=True)
        self._thread.start()

    def record(self, event: KVCacheEvent) -> None:
        self._pending.append(event)

    def flush(self) -> None:
        self._wake.set()

    def _take_batch(self) -> Optional[KVEventBatch]:
        events = []
        while self._pending and len(events) < self.config.max_queue_size:
            events.append(self._pending.popleft())
        return KVEventBatch(time.time(), events, self.rank) if events else None

    def _loop(self) -> None:
        import zmq

        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while self._running or self._pending:
            try:
                if self._replay is not None and poller.poll(0):
                    self._serve_replay()
                batch = self._take_batch()
                if batch is not None:
                    payload = encode_batch(batch, self.config.token_ids)
                    seq = self._seq.to_bytes(8, "big")
                    # kept for replay before it leaves: a subscriber that saw it can ask again
                    self._buffer.append((self._seq, payload))
                    self._pub.send_multipart((self._topic, seq, payload))
                    self._seq += 1
                    self.published_events += len(batch.events)
                    continue
            except Exception:  # publishing must never take the engine down
                log.exception("kv events: publishing failed")
                time.sleep(0.1)
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("kv events: bad replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart(
                    (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                )
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        self._running = False
        self._wake.set()
        self._thread.join(timeout=2)
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)


# --- subscriber ---------------------------------------------------------------------------
class KVEventSubscriber:
    """A blocking SUB (+ replay DEALER) client: `recv()` gives `(seq, KVEventBatch)`.

    Used by tests and by the gateway's index thread. `replay(start)` asks the engine's replay
    socket for everything from `start` on and returns the messages it got before the end
    marker (empty when the engine no longer buffers that far back or does not answer)."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: Optional[str] = None,
        topic: str = "",
        bind: bool = False,
    ):
        """Connects to a publisher that binds (the usual `tcp://*:5557`: pass the engine's
        address); `bind=True` for publishers configured to connect to the subscriber."""
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context.instance()  # see KVEventPublisher
        self.sub = self._ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        if bind:
            self.sub.bind(endpoint)
        else:
            self.sub.connect(endpoint.replace("*", "127.0.0.1"))
        self.replay_endpoint = replay_endpoint

    def recv(self, timeout_s: float = 1.0) -> Optional[tuple[int, KVEventBatch]]:
        if not self.sub.poll(int(timeout_s * 1000)):
            return None
        frames = self.sub.recv_multipart()
        _, seq, payload = frames[-3:]
        return int.from_bytes(seq, "big"), decode_batch(payload)

    def replay(self, start_seq: int, timeout_s: float = 2.0) -> list[tuple[int, KVEventBatch]]:
        if not self.replay_endpoint:
            return []
        zmq = self._zmq
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.connect(self.replay_endpoint.replace("*", "127.0.0.1"))
            sock.send_multipart((b"", start_seq.to_bytes(8, "big")))
            out = []
            deadline = time.monotonic() + timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(int(left * 1000)):
                    return out
                frames = sock.recv_multipart()
                seq, payload = frames[-2], frames[-1]
                if seq == END_SEQ:
                    return out
                out.append((int.from_bytes(seq, "big"), decode_batch(payload)))
        finally:
            sock.close(linger=0)

    def close(self) -> None:
        self.sub.close(linger=0)
