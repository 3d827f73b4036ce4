"""Metric traces for the planner's tests: engines that expose vLLM's metrics (rendered by
prometheus_client, so the text is the real exposition format) under a load that follows a
script, with latencies that grow with the load per engine. Closed loop: the planner's
decisions add and remove engines, and the next tick's latencies follow.

Load model (per 10 s tick): prefill utilization = prompt tokens/s over the prefill engines'
capacity, decode utilization = concurrent sequences over the decode engines' capacity;
latency = base / (1 - utilization) (a queue's), capped; a queue forms above 95 %."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdpool.planner.metrics import EndpointMetrics, Snapshot, parse_text
from pdpool.planner.policy import PlannerConfig
from pdpool.planner.stabilize import Decision, PlannerState, initial_state, plan

BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


class FakeEngine:
    """One engine's metrics (the text a real engine serves at /metrics)."""

    def __init__(self, role: str, index: int) -> None:
        self.role, self.endpoint = role, f"{role}-{index}"
        r = self.registry = CollectorRegistry()
        self.running = Gauge("vllm:num_requests_running", "", registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "", registry=r)
        self.kv = Gauge("vllm:kv_cache_usage_perc", "", registry=r)
        self.prompt = Counter("vllm:prompt_tokens", "", registry=r)
        self.generation = Counter("vllm:generation_tokens", "", registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "", buckets=BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "", buckets=BUCKETS, registry=r)

    def scrape(self) -> EndpointMetrics:
        text = generate_latest(self.registry).decode()
        return EndpointMetrics(self.role, self.endpoint, parse_text(text))


@dataclass
class Load:
    """One tick's offered load on the pool."""

    users: int
    prompt_tokens: int = 256  # per request
    output_tokens: int = 64


@dataclass
class Capacity:
    prefill_tokens_per_s: float = 2000.0  # one prefill engine
    decode_sequences: float = 8.0  # one decode engine at its ITL knee
    base_ttft_s: float = 0.2
    base_itl_s: float = 0.02
    request_s: float = 4.0  # a user's think + generation time per request


def _latency(base: float, utilization: float) -> float:
    return min(base / max(1.0 - utilization, 0.05), 20 * base)


@dataclass
class Pool:
    cfg: PlannerConfig
    prefill: int
    decode: int
    cap: Capacity = field(default_factory=Capacity)
    tick_s: float = 10.0
    now: float = 0.0

    def __post_init__(self) -> None:
        self.engines = {
            "prefill": [FakeEngine("prefill", i) for i in range(self.prefill)],
            "decode": [FakeEngine("decode", i) for i in range(self.decode)],
        }
        self.next_index = {"prefill": self.prefill, "decode": self.decode}
        self.state: PlannerState = initial_state(self.prefill, self.decode)
        self.decisions: list[Decision] = []

    def _resize(self, role: str, want: int) -> None:
        engines = self.engines[role]
        while len(engines) < want:
            engines.append(FakeEngine(role, self.next_index[role]))
            self.next_index[role] += 1
        del engines[want:]

    def _serve(self, load: Load) -> None:
        cap, dt = self.cap, self.tick_s
        requests = load.users * dt / cap.request_s
        prefills, decodes = self.engines["prefill"], self.engines["decode"]
        p_util = (
            requests * load.prompt_tokens / dt / (max(len(prefills), 1) * cap.prefill_tokens_per_s)
        )
        sequences = load.users * load.output_tokens / 128  # 64 tokens: half a sequence
        d_util = sequences / (len(decodes) * cap.decode_sequences)
        ttft, itl = _latency(cap.base_ttft_s, p_util), _latency(cap.base_itl_s, d_util)
        self._observe(prefills, requests, p_util, ttft=ttft, prompt=load.prompt_tokens)
        self._observe(decodes, requests, d_util, itl=itl, output=load.output_tokens)
        for e in decodes:
            e.kv.set(min(d_util * 0.7, 1.0))

    @staticmethod
    def _observe(engines, requests, util, ttft=None, itl=None, prompt=0, output=0) -> None:
        share = round(requests / max(len(engines), 1))
        for e in engines:
            e.running.set(share and min(share, 8))
            e.waiting.set(share * max(util - 0.95, 0) * 10)
            for _ in range(share):
                if ttft is not None:
                    e.ttft.observe(ttft)
                    e.prompt.inc(prompt)
                if itl is not None:
                    e.ttft.observe(0.05)
                    for _ in range(4):  # a sample of the request's token gaps
                        e.itl.observe(itl)
                    e.generation.inc(output)

    def tick(self, load: Load) -> Decision:
        self._serve(load)
        self.now += self.tick_s
        snap = Snapshot(self.now, tuple(e.scrape() for role in self.engines.values() for e in role))
        self.state, decision = plan(self.cfg, self.state, snap)
        self._resize("prefill", decision.prefill.desired)
        self._resize("decode", decision.decode.desired)
        self.decisions.append(decision)
        return decision

    def run(self, loads: list[Load]) -> list[Decision]:
        return [self.tick(load) for load in loads]

    def replicas(self, role: str) -> list[int]:
        return [d.role(role).desired for d in self.decisions]
