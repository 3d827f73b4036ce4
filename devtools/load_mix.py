"""A production-like request mix for pdpool servers and gateways, and what it records.

Shared by benchmarks/load.py (full size) and tests/load (scaled down):

- Shot / Conversation: one request (or a multi-turn chat) and the statuses that count as a
  correct answer; `build_units` draws a mix of them (bursts of short and long prompts, up to
  max_model_len, streamed or not, chats and completions, n>1 and logprobs, clients that
  leave mid-stream, shared-prefix conversations, bodies near and over the size limit,
  over-long prompts).
- LoadClient / run_units / load_during: sends them in concurrent bursts (load_during: while
  faults are injected) and records an Outcome for each (status, stream events, TTFT and
  inter-token gaps, tokens, how a stream ended).
- HealthWatch: polls /health from a process of its own while the load runs.
- summarize / by_kind: the report; *_problems: the checks the tests assert (answers as
  expected unless an outage excuses them, no stream cut without an error event, /health
  within its budget, KV blocks back to idle, memory bounded).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import multiprocessing
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable, Iterable, Optional, TypeVar, Union

import httpx

from pdpool.planner.metrics import has, parse_text, total

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
OK = frozenset({200})
TOO_LONG = frozenset({400})
TOO_BIG = frozenset({413})
# A prompt far beyond the model's length may be refused by its size or by its length.
REFUSED = frozenset({400, 413})

WORDS = (
    "river stone cloud lantern harbor meadow copper violet orchard signal ember compass "
    "willow summit thunder canyon the a of to and in is it that for on with as was at by "
    "cache block prefill decode token engine request batch kernel model layer state window "
    "hello world question answer story mountain city music light water green blue red quick "
    "brown fox jumps lazy dog small large early late north south east west"
).split()
T = TypeVar("T")
SYSTEM_PROMPT = "You are a careful assistant who answers in plain words. " * 6


# --- what is sent ---------------------------------------------------------------------
@dataclass(frozen=True)
class Shot:
    """One request: its route and body, and the statuses that count as a correct answer."""

    kind: str
    route: str
    body: dict
    expect: frozenset = OK
    # Content events read before the client leaves on purpose (None: read to the end).
    leave_after: Optional[int] = None
    # Builds the raw body instead of json.dumps(body) (huge or padded bodies, made when sent
    # so that a mix never holds many of them at once).
    raw: Optional[Callable[[], bytes]] = field(default=None, compare=False)

    @property
    def streamed(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def migratable(self) -> bool:
        """Whether the gateway can move this stream to another engine (sidecar/gateway/migration.py:
        one choice, no logprobs)."""
        return self.streamed and self.body.get("n", 1) == 1 and not self.body.get("logprobs")

    def payload(self) -> bytes:
        return self.raw() if self.raw is not None else json.dumps(self.body).encode()


@dataclass(frozen=True)
class Conversation:
    """A multi-turn chat: each turn sends the whole history (a prefix the engine has cached)
    plus one new user message; every conversation shares SYSTEM_PROMPT."""

    opening: str
    follow_ups: tuple
    max_tokens: int = 12
    stream: bool = True


Unit = Union[Shot, Conversation]


# --- what came back -------------------------------------------------------------------
@dataclass
class Outcome:
    kind: str
    expect: frozenset
    streamed: bool
    migratable: bool
    start: float
    end: float = 0.0
    status: Optional[int] = None  # None: no HTTP answer (a transport error)
    message: str = ""  # error text: the answer's, an error event's or the transport's
    events: int = 0  # SSE data events
    done: bool = False  # `data: [DONE]` arrived
    error_event: bool = False
    left: bool = False  # the client disconnected on purpose
    choices: int = 1
    finished: set = field(default_factory=set)  # choice indexes with a finish_reason
    ttft: Optional[float] = None
    gaps: list = field(default_factory=list)  # seconds between content events
    tokens: int = 0
    text: dict = field(default_factory=dict)  # choice index -> text

    @property
    def complete(self) -> bool:
        """A stream that ended as streams should: every choice finished, then [DONE]."""
        return self.done and len(self.finished) >= self.choices

    @property
    def klass(self) -> str:
        """2xx, 400, 413, 429, 4xx, 5xx, transport, stream_error, left or cut."""
        if self.status is None:
            return "transport"
        if self.status >= 300:
            return str(self.status) if self.status in (400, 413, 429) else _hundreds(self.status)
        if self.streamed and self.error_event:
            return "stream_error"
        if self.left:
            return "left"
        if self.streamed and not self.complete:
            return "cut"
        return "2xx"

    @property
    def as_expected(self) -> bool:
        if self.status is None or self.status not in self.expect:
            return False
        if self.status >= 400:
            return bool(self.message)  # a refusal says why
        if self.streamed:
            return not self.error_event and (self.left or self.complete)
        return True

    def overlaps(self, start: float, end: float) -> bool:
        return self.start <= end and self.end >= start


def _hundreds(status: int) -> str:
    return "5xx" if status >= 500 else "4xx"


# --- prompts --------------------------------------------------------------------------
class PromptMaker:
    """Prompts of a given size in tokens of the model's own tokenizer (tokenizer.json: the
    `tokenizers` package, no torch), so lengths near max_model_len are exact."""

    def __init__(self, model_dir: Union[str, Path], seed: int = 0):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        config = json.loads((Path(model_dir) / "config.json").read_text())
        self.vocab_size = int(config["vocab_size"])
        self.rng = random.Random(seed)
        specials = set(self.tokenizer.get_added_tokens_decoder())
        self._plain_ids = [i for i in range(self.vocab_size) if i not in specials]

    def words(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def ids(self, n: int) -> list[int]:
        """n token ids (no special tokens): an exact prompt length for /v1/completions."""
        return [self.rng.choice(self._plain_ids) for _ in range(n)]

    def text(self, n: int) -> str:
        """Text of about n tokens (cut at n tokens, decoded back)."""
        words = self.words(n)  # never fewer tokens than words
        ids = self.tokenizer.encode(words).ids[:n]
        return self.tokenizer.decode(ids)

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text).ids)


def huge_text(nbytes: int, seed: int = 0) -> str:
    """About nbytes of plain words, made fast (a 1 KiB random block repeated)."""
    rng = random.Random(seed)
    block = " ".join(rng.choice(WORDS) for _ in range(200)) + " "
    return (block * (nbytes // len(block) + 1))[:nbytes]


def padded_body(body: dict, size: int) -> bytes:
    """`body` as JSON padded with trailing whitespace (valid JSON) to exactly `size` bytes:
    a body near the size limit that costs the server nothing to understand."""
    raw = json.dumps(body).encode()
    return raw + b" " * max(size - len(raw), 0)


@dataclass
class MixSpec:
    """What the mix needs to know about the server: its model and its limits."""

    model_dir: str
    model: str  # the served model name
    max_model_len: int = 4096
    max_body_bytes: int = 32 * 1024 * 1024
    huge_prompt_bytes: int = 10 * 1000 * 1000
    seed: int = 0


# --- the mix --------------------------------------------------------------------------
def _base(spec: MixSpec, max_tokens: int, stream: bool) -> dict:
    body: dict = {"model": spec.model, "max_tokens": max_tokens, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _completion(kind: str, spec: MixSpec, prompt, max_tokens: int, stream: bool, **extra) -> Shot:
    body = {**_base(spec, max_tokens, stream), "prompt": prompt, **extra}
    return Shot(kind, COMPLETIONS, body)


def _chat(kind: str, spec: MixSpec, text: str, max_tokens: int, stream: bool, **extra) -> Shot:
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": text}]
    return Shot(kind, CHAT, {**_base(spec, max_tokens, stream), "messages": messages, **extra})


def short_completion(spec: MixSpec, mk: PromptMaker, rng: random.Random) -> Shot:
    return _completion("short", spec, mk.text(rng.randint(16, 256)), rng.randint(4, 24), False)


def streamed_completion(spec: MixSpec, mk: PromptMaker, rng: random.Random) -> Shot:
    prompt = mk.text(rng.randint(16, 1024))
    return _completion("stream", spec, prompt, rng.randint(8, 48), True, ignore_eos=True)


def chat(spec: MixSpec, mk: PromptMaker, rng: random.Random) -> Shot:
    stream = rng.random() < 0.5
    return _chat("chat", spec, mk.text(rng.randint(16, 512)), rng.randint(4, 32), stream)


def long_prompt(spec: MixSpec, mk: PromptMaker, rng: random.Random) -> Shot:
    max_tokens = 4
    n = rng.randint(spec.max_model_len // 4, spec.max_model_len - max_tokens)
    return _completion("long", spec, mk.ids(n), max_tokens, rng.random() < 0.5)


def at_the_limit(spec: MixSpec, mk: PromptMaker, rng: random.Random) -> Shot:
    """Prompt + max_tokens exactly max_model_len: the longest request the model takes."""
    max_tokens = rng.randint(1, 8)
    prompt = mk.ids(spec.max_model_len - max_tokens)
    return _completion("limit", spec, prompt, max_tokens, rng.random() < 0.5, ignore_eos=True)


def n_and_logprobs(spec: MixSpec, mk: PromptMaker, rng: random.Random) -> Shot:
    stream = rng.random() < 0.5
    if rng.random() < 0.5:
        prompt = mk.text(rng.randint(16, 256))
        return _completion("n_logprobs", spec, prompt, 8, stream, n=2, logprobs=2)
    text = mk.text(rng.randint(16, 256))
    return _chat("n_logprobs", spec, text, 8, stream, n=2, logprobs=True, top_logprobs=2)


def disconnecting(spec: MixSpec, mk: PromptMaker, rng: random.Random) -> Shot:
    """A client that reads a few tokens of a long answer, then leaves."""
    shot = _completion("leave", spec, mk.text(rng.randint(16, 512)), 400, True, ignore_eos=True)
    return Shot(shot.kind, shot.route, shot.body, leave_after=rng.randint(1, 4))


def over_long(spec: MixSpec, mk: PromptMaker, rng: random.Random) -> Shot:
    prompt = mk.ids(spec.max_model_len + rng.randint(1, 512))
    shot = _completion("overlong", spec, prompt, 4, rng.random() < 0.5)
    return Shot(shot.kind, shot.route, shot.body, expect=TOO_LONG)


def near_size_limit(spec: MixSpec, mk: PromptMaker, rng: random.Random) -> Shot:
    """A valid request padded to 64 KiB under the body limit: read whole, then served."""
    shot = short_completion(spec, mk, rng)
    size = spec.max_body_bytes - 64 * 1024
    return Shot("near_limit_body", shot.route, shot.body, raw=lambda: padded_body(shot.body, size))


def over_size_limit(spec: MixSpec, mk: PromptMaker, rng: random.Random) -> Shot:
    shot = short_completion(spec, mk, rng)
    size = spec.max_body_bytes + 1024
    raw = lambda: padded_body(shot.body, size)  # noqa: E731
    return Shot("oversize_body", shot.route, shot.body, expect=TOO_BIG, raw=raw)


def huge_prompt(spec: MixSpec, mk: PromptMaker, rng: random.Random) -> Shot:
    """A prompt of ~10 MB of text (under the body limit, far over max_model_len)."""
    body = _base(spec, 4, False)
    nbytes, seed = spec.huge_prompt_bytes, rng.randint(0, 1 << 30)

    def raw() -> bytes:
        return json.dumps({**body, "prompt": huge_text(nbytes, seed)}).encode()

    return Shot("huge_prompt", COMPLETIONS, body, expect=REFUSED, raw=raw)


def conversation(spec: MixSpec, mk: PromptMaker, rng: random.Random) -> Conversation:
    follow_ups = tuple(mk.text(rng.randint(8, 64)) for _ in range(rng.randint(2, 4)))
    return Conversation(mk.text(rng.randint(64, 512)), follow_ups, stream=rng.random() < 0.7)


Builder = Callable[[MixSpec, PromptMaker, random.Random], Unit]


@dataclass(frozen=True)
class Kind:
    build: Builder
    weight: int
    cap: Optional[int] = None  # at most this many per mix (heavy bodies)


KINDS: dict[str, Kind] = {
    "short": Kind(short_completion, 20),
    "stream": Kind(streamed_completion, 20),
    "chat": Kind(chat, 14),
    "long": Kind(long_prompt, 6),
    "limit": Kind(at_the_limit, 4),
    "n_logprobs": Kind(n_and_logprobs, 8),
    "leave": Kind(disconnecting, 8),
    "conversation": Kind(conversation, 8),
    "overlong": Kind(over_long, 4),
    "near_limit_body": Kind(near_size_limit, 1, cap=2),
    "oversize_body": Kind(over_size_limit, 1, cap=2),
    "huge_prompt": Kind(huge_prompt, 1, cap=1),
}


def build_units(
    spec: MixSpec, count: int, kinds: Optional[Iterable[str]] = None, seed: Optional[int] = None
) -> list[Unit]:
    """`count` requests (a conversation counts as one) drawn by weight from `kinds` (default
    all), every kind at least once when count allows; heavy bodies are capped."""
    names = list(kinds or KINDS)
    rng = random.Random(spec.seed if seed is None else seed)
    mk = PromptMaker(spec.model_dir, seed=rng.randint(0, 1 << 30))
    picked = names[:count] + rng.choices(
        names, weights=[KINDS[n].weight for n in names], k=max(count - len(names), 0)
    )
    taken: dict[str, int] = {}
    units = []
    for name in picked:
        cap = KINDS[name].cap
        if cap is not None and taken.get(name, 0) >= cap:
            name = "short"
        taken[name] = taken.get(name, 0) + 1
        units.append(KINDS[name].build(spec, mk, rng))
    rng.shuffle(units)
    return units


# --- the client -----------------------------------------------------------------------
class LoadClient:
    """Sends shots and records what happened to each (never raises for a failed request)."""

    def __init__(self, base_url: str, timeout_s: float = 300.0, connections: int = 512):
        self.http = httpx.AsyncClient(
            base_url=base_url,
            timeout=httpx.Timeout(timeout_s, connect=30.0),
            # One connection per request, as from many clients: a kept-alive connection that
            # the server closes as it is reused fails on the client's side, not the server's.
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=0),
        )
        # Set at the first token of any stream: a fault injected then hits live streams.
        self.streaming = asyncio.Event()

    async def close(self) -> None:
        await self.http.aclose()

    async def send(self, shot: Shot) -> Outcome:
        out = Outcome(
            shot.kind,
            shot.expect,
            shot.streamed,
            shot.migratable,
            time.monotonic(),
            choices=int(shot.body.get("n", 1)),
        )
        # Big bodies are built off the event loop: streams in flight keep being read.
        payload = await asyncio.to_thread(shot.payload) if shot.raw else shot.payload()
        headers = {"content-type": "application/json"}
        try:
            async with self.http.stream("POST", shot.route, content=payload, headers=headers) as r:
                out.status = r.status_code
                if r.status_code != 200:
                    out.message = _error_message(await r.aread())
                elif shot.streamed:
                    await _read_stream(r, out, shot.leave_after, self.streaming)
                else:
                    _read_whole(json.loads(await r.aread()), out)
        except httpx.TransportError as exc:
            out.message = f"{type(exc).__name__}: {exc}"
        except ValueError as exc:  # a 200 whose body is not JSON
            out.message = f"bad answer: {exc}"
        out.end = time.monotonic()
        return out

    async def converse(self, conv: Conversation, spec: MixSpec) -> list[Outcome]:
        """The turns one after another, each carrying the history and the last answer."""
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": conv.opening},
        ]
        outcomes = []
        for follow_up in (*conv.follow_ups, None):
            body = {**_base(spec, conv.max_tokens, conv.stream), "messages": list(messages)}
            out = await self.send(Shot("turn", CHAT, body))
            outcomes.append(out)
            if follow_up is None or not out.as_expected:
                break
            messages.append({"role": "assistant", "content": out.text.get(0, "")})
            messages.append({"role": "user", "content": follow_up})
        return outcomes

    async def run(self, unit: Unit, spec: MixSpec) -> list[Outcome]:
        if isinstance(unit, Conversation):
            return await self.converse(unit, spec)
        return [await self.send(unit)]


def _error_message(raw: bytes) -> str:
    try:
        err = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        return raw[:200].decode("utf-8", "replace")
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err or raw[:200])


def _piece(choice: dict) -> str:
    if "text" in choice:
        return choice.get("text") or ""
    return (choice.get("delta") or {}).get("content") or ""


async def _read_stream(
    r: httpx.Response, out: Outcome, leave_after: Optional[int], streaming: asyncio.Event
) -> None:
    last = out.start
    async for line in r.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            out.done = True
            continue
        out.events += 1
        event = json.loads(line[6:])
        if "error" in event:
            out.error_event, out.message = True, str(event["error"].get("message", event))
            continue
        now = time.monotonic()
        if _take_choices(event, out):
            if out.ttft is None:
                out.ttft = now - out.start
                streaming.set()
            else:
                out.gaps.append(now - last)
            last = now
            if leave_after is not None and len(out.gaps) + 1 >= leave_after:
                out.left = True
                return  # closing the response drops the connection
        if event.get("usage"):
            out.tokens = int(event["usage"].get("completion_tokens", out.tokens))


def _take_choices(event: dict, out: Outcome) -> bool:
    """Adds an event's text to its choices; whether it carried any."""
    content = False
    for choice in event.get("choices") or []:
        index = int(choice.get("index", 0))
        piece = _piece(choice)
        if piece:
            out.text[index] = out.text.get(index, "") + piece
            content = True
        if choice.get("finish_reason"):
            out.finished.add(index)
    return content


def _read_whole(answer: dict, out: Outcome) -> None:
    for choice in answer.get("choices") or []:
        index = int(choice.get("index", 0))
        message = choice.get("message") or {}
        out.text[index] = choice.get("text") or message.get("content") or ""
        if choice.get("finish_reason"):
            out.finished.add(index)
    out.tokens = int((answer.get("usage") or {}).get("completion_tokens", 0))
    out.ttft = time.monotonic() - out.start  # the whole answer is its first token


async def run_units(
    url: str, units: list[Unit], spec: MixSpec, burst: int, timeout_s: float = 300.0
) -> list[Outcome]:
    """Sends the units in bursts of `burst` at once, each burst after the last one ended."""
    client = LoadClient(url, timeout_s, connections=max(burst * 2, 64))
    outcomes: list[Outcome] = []
    try:
        for i in range(0, len(units), burst):
            batch = units[i : i + burst]
            for result in await asyncio.gather(*(client.run(u, spec) for u in batch)):
                outcomes += result
    finally:
        await client.close()
    return outcomes


async def load_during(
    url: str,
    spec: MixSpec,
    burst: int,
    work: Callable[[], Awaitable[T]],
    seed: int = 11,
    timeout_s: float = 300.0,
) -> tuple[list[Outcome], T]:
    """Bursts of a fresh mix one after another while `work` runs; `work` starts once the
    first stream flows (a fault then hits live streams). The burst in flight when it ends is
    finished. Returns (outcomes, what work returned)."""
    client = LoadClient(url, timeout_s, connections=max(burst * 2, 64))
    finished = asyncio.Event()

    async def keep_loading() -> list[Outcome]:
        outcomes: list[Outcome] = []
        for n in itertools.count(seed):
            if finished.is_set():
                break
            units = await asyncio.to_thread(build_units, spec, burst, None, n)
            for result in await asyncio.gather(*(client.run(u, spec) for u in units)):
                outcomes += result
        return outcomes

    try:
        load = asyncio.create_task(keep_loading())
        await asyncio.wait_for(client.streaming.wait(), timeout_s)
        try:
            result = await work()
        finally:
            finished.set()
        return await load, result
    finally:
        await client.close()


# --- /health while the load runs -------------------------------------------------------
@dataclass
class HealthSample:
    t: float
    status: Optional[int]  # None: no answer within the budget
    latency: float


class HealthWatch:
    """Polls GET /health every `every_s`, giving each answer `budget_s`, from a process of
    its own: the load's client holds its GIL for long stretches (JSON of big bodies, SSE
    parsing), which must not pass for a slow server."""

    def __init__(self, url: str, every_s: float = 0.25, budget_s: float = 1.0):
        self.url, self.every_s, self.budget_s = url, every_s, budget_s
        self.samples: list[HealthSample] = []
        ctx = multiprocessing.get_context("spawn")
        self._stop, self._polling = ctx.Event(), ctx.Event()
        self._samples, child_end = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=poll_health,
            args=(url, every_s, budget_s, self._polling, self._stop, child_end),
            name="health-watch",
            daemon=True,
        )

    def __enter__(self) -> "HealthWatch":
        self._proc.start()
        self._polling.wait(60)  # the watch covers all that follows
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        # Spawning takes a while: the samples come once the poller has stopped.
        if self._samples.poll(30):
            self.samples = [HealthSample(*s) for s in self._samples.recv()]
        self._proc.join(10)

    def late(self) -> list[HealthSample]:
        """Polls not answered within the budget."""
        return [s for s in self.samples if s.status is None or s.latency > self.budget_s]

    def not_ok(self) -> list[HealthSample]:
        return [s for s in self.samples if s.status != 200]

    def worst_latency(self) -> float:
        return max((s.latency for s in self.samples), default=0.0)


def poll_health(url: str, every_s: float, budget_s: float, polling, stop, out) -> None:
    """The HealthWatch process: sets `polling` after its first poll, polls until `stop` is
    set, then sends its samples as (t, status, latency) tuples (time.monotonic() is the same
    clock in every process)."""
    samples = []
    with httpx.Client(timeout=budget_s) as http:
        while not stop.is_set():
            t = time.monotonic()
            try:
                status: Optional[int] = http.get(url + "/health").status_code
            except httpx.HTTPError:
                status = None
            samples.append((t, status, time.monotonic() - t))
            polling.set()
            stop.wait(max(every_s - (time.monotonic() - t), 0.0))
    out.send(samples)


# --- Prometheus -----------------------------------------------------------------------
_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$")


def scrape(url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """Every sample of /metrics summed over its label sets, by name ({} when unreachable)."""
    try:
        text = httpx.get(url + "/metrics", timeout=timeout_s).text
    except httpx.HTTPError:
        return {}
    totals: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            totals[m.group(1)] = totals.get(m.group(1), 0.0) + float(m.group(3))
    return totals


def kv_blocks(url: str) -> dict[str, float]:
    """The engine's KV blocks in use and its usage fraction (vLLM's gauge)."""
    m = scrape(url)
    return {
        "blocks_used": m.get("pdpool_kv_blocks_used", float("nan")),
        "blocks_total": m.get("pdpool_kv_blocks_total", float("nan")),
        "usage_perc": m.get("vllm:kv_cache_usage_perc", float("nan")),
    }


# --- the report -----------------------------------------------------------------------
CLASSES = ("2xx", "400", "413", "429", "4xx", "5xx", "transport", "stream_error", "left", "cut")


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(int(q * len(values)), len(values) - 1)] if values else float("nan")


def summarize(outcomes: list[Outcome], wall_s: float) -> dict:
    """Counts by class, latencies of the streamed answers, output tokens per second."""
    counts = {c: 0 for c in CLASSES}
    for o in outcomes:
        counts[o.klass] += 1
    ttft = [o.ttft for o in outcomes if o.streamed and o.ttft is not None]
    gaps = [g for o in outcomes if o.streamed for g in o.gaps]
    tokens = sum(o.tokens for o in outcomes if o.status == 200)
    return {
        "sent": len(outcomes),
        "as_expected": sum(o.as_expected for o in outcomes),
        **counts,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
        "itl_p50_s": percentile(gaps, 0.5),
        "itl_p99_s": percentile(gaps, 0.99),
        "output_tokens": tokens,
        "tok_per_s": tokens / wall_s if wall_s > 0 else float("nan"),
        "wall_s": wall_s,
    }


def by_kind(outcomes: list[Outcome]) -> list[dict]:
    """One row per request kind: how many, and how many answered as expected."""
    rows: dict[str, dict] = {}
    for o in outcomes:
        row = rows.setdefault(
            o.kind, {"kind": o.kind, "sent": 0, "as_expected": 0, **{c: 0 for c in CLASSES}}
        )
        row["sent"] += 1
        row["as_expected"] += o.as_expected
        row[o.klass] += 1
    return sorted(rows.values(), key=lambda r: r["kind"])


@dataclass
class Outage:
    """A fault's window: from the kill until its victim served again (end None: never)."""

    what: str
    start: float
    end: Optional[float]
    no_path: bool  # nothing else could serve meanwhile (a lone `pdpool serve`)


def excused(o: Outcome, outages: list[Outage]) -> bool:
    """A failure no server could have avoided: while no path could serve, or a request
    in flight on the killed process that cannot move (not a stream the gateway migrates).
    A stream cut without an error event is never excused."""
    if o.klass in ("cut", "2xx", "left"):
        return False
    for w in outages:
        end = w.end if w.end is not None else float("inf")
        if w.no_path and o.overlaps(w.start, end):
            return True
        if not o.migratable and o.start <= w.start <= o.end:
            return True
    return False


def unexpected(outcomes: list[Outcome], outages: Iterable[Outage] = ()) -> list[Outcome]:
    windows = list(outages)
    return [o for o in outcomes if not o.as_expected and not excused(o, windows)]


def cut_streams(outcomes: list[Outcome]) -> list[Outcome]:
    """Streams that ended without [DONE]/finish_reason and without an error event."""
    return [o for o in outcomes if o.klass == "cut"]


def describe(outcomes: list[Outcome], limit: int = 12) -> str:
    """The failures grouped by kind, class and message, one group a line, most frequent
    first: an assertion message that shows every distinct failure."""
    groups: dict[tuple, list[Outcome]] = {}
    for o in outcomes:
        groups.setdefault((o.kind, o.klass, o.status, o.message[:160]), []).append(o)
    ranked = sorted(groups.items(), key=lambda item: -len(item[1]))
    lines = [
        f"{len(group)} x {kind}: {klass} status={status} "
        f"(after {min(o.end - o.start for o in group):.1f}-"
        f"{max(o.end - o.start for o in group):.1f}s): {message}"
        for (kind, klass, status, message), group in ranked[:limit]
    ]
    more = len(ranked) - limit
    return "\n".join(lines + ([f"... and {more} more groups"] if more > 0 else []))


# --- the checks -----------------------------------------------------------------------
def outcome_problems(outcomes: list[Outcome], outages: Iterable[Outage] = ()) -> list[str]:
    """Answers that were not as expected (and not excused by an outage), and streams cut
    without an error event."""
    problems = []
    wrong = unexpected(outcomes, outages)
    if wrong:
        problems.append(f"{len(wrong)} of {len(outcomes)} not as expected:\n{describe(wrong)}")
    cut = [o for o in cut_streams(outcomes) if o not in wrong]
    if cut:
        problems.append(f"{len(cut)} streams cut without an error event:\n{describe(cut)}")
    return problems


def health_problems(watch: HealthWatch, outages: Iterable[Outage] = ()) -> list[str]:
    """/health must answer within its budget always, and 200 outside the outages."""
    problems = []
    windows = [(w.start, w.end if w.end is not None else float("inf")) for w in outages]
    t0 = watch.samples[0].t if watch.samples else 0.0

    def when(samples: list[HealthSample]) -> str:
        """Seconds into the watch of a few samples, * marking those inside an outage."""
        marks = [
            f"+{s.t - t0:.1f}s" + ("*" if any(a <= s.t <= b for a, b in windows) else "")
            for s in samples[:6]
        ]
        return ", ".join(marks) + (" ..." if len(samples) > 6 else "")

    late = watch.late()
    if late:
        worst = max(s.latency for s in late)
        problems.append(
            f"/health missed its {watch.budget_s}s budget {len(late)} times (worst "
            f"{worst:.2f}s, of {len(watch.samples)} polls) at {when(late)}; outages: "
            + (", ".join(f"+{a - t0:.1f}s..+{b - t0:.1f}s" for a, b in windows) or "none")
        )
    bad = [
        s
        for s in watch.not_ok()
        if s.status is not None and not any(a <= s.t <= b for a, b in windows)
    ]
    if bad:
        problems.append(
            f"/health answered {sorted({s.status for s in bad})} {len(bad)} times outside "
            f"any outage, at {when(bad)}"
        )
    return problems


def block_problems(
    idle: dict[str, float], after: dict[str, float], holders: Optional[dict] = None
) -> list[str]:
    """KV blocks in use once the load is over must be back to the idle count; `holders`
    (by engine, what could hold blocks) is named for the engines that leaked."""
    leaked = {k: (idle.get(k), v) for k, v in after.items() if v != idle.get(k)}
    if not leaked:
        return []
    held_by = {k: (holders or {}).get(k) for k in leaked}
    return [f"KV blocks in use (idle, after): {leaked}; held by {held_by}"]


# What can hold an engine's KV blocks once its requests are done.
HOLDER_STATS = ("leases_active", "loads_in_flight", "loads_failed", "leases_expired")


def kv_holders(url: str) -> dict[str, float]:
    """An engine's requests running and waiting and its connector's leases and loads."""
    try:
        samples = parse_text(httpx.get(url + "/metrics", timeout=5.0).text)
    except (httpx.HTTPError, ValueError):
        return {}
    out = {
        kind: total(samples, f"pdpool_num_requests_{kind}")
        for kind in ("running", "waiting")
        if has(samples, f"pdpool_num_requests_{kind}")
    }
    for stat in HOLDER_STATS:
        if any(("stat", stat) in labels for labels in samples.get("pdpool_kv_connector", {})):
            out[stat] = total(samples, "pdpool_kv_connector", stat=stat)
    return out


def memory_problems(
    before: dict[str, Optional[int]], after: dict[str, Optional[int]], limit_bytes: int
) -> list[str]:
    """Each process may grow by at most limit_bytes over a run."""
    grown = {
        name: f"{(b or 0) >> 20} -> {(after[name] or 0) >> 20} MiB"
        for name, b in before.items()
        if b is not None and after.get(name) is not None and after[name] - b > limit_bytes
    }
    return [f"memory grew more than {limit_bytes >> 20} MiB: {grown}"] if grown else []
