"""The routing behaviours as plugins of framework.py's profiles.

    HealthFilter        endpoints that are healthy (not failing probes, not ejected)
    UnderLoadCap        endpoints under the bounded-load cap (affinity.py's bound)
    KVCostScorer        minus what an endpoint would compute of the prompt (the KV index)
    CostScorer          minus any other per-endpoint cost in tokens (a LoRA adapter's)
    LoadScorer          minus the requests in flight (weighted: tokens per request)
    AdapterScorer       how resident a LoRA adapter is on each endpoint
    MaxScorePicker      (framework.py) the best total first, ties in affinity order

Bounded-load prefix affinity (affinity.route_order) gives the candidates their order; the
profiles below reorder it. The P/D decision is pd.py's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from ..kv.costs import PromptCosts
from .framework import Profile, Weighted
from .lora_affinity import UNKNOWN, load_cap

Load = Callable[[str], float]
Healthy = Callable[[str], bool]


@dataclass(frozen=True)
class HealthFilter:
    healthy: Healthy

    def filter(self, endpoints: Sequence[str]) -> list[str]:
        return [e for e in endpoints if self.healthy(e)]


@dataclass(frozen=True)
class UnderLoadCap:
    """Those under ceil(balance * (total load + 1) / count) in flight, the cap computed over
    the endpoints it is given."""

    load: Load
    balance: float

    def filter(self, endpoints: Sequence[str]) -> list[str]:
        cap = load_cap(endpoints, self.load, self.balance)
        return [e for e in endpoints if self.load(e) < cap]


@dataclass(frozen=True)
class KVCostScorer:
    costs: PromptCosts

    def score(self, endpoints: Sequence[str]) -> dict[str, float]:
        return {e: -self.costs.work[e] for e in endpoints}


@dataclass(frozen=True)
class CostScorer:
    cost: Callable[[str], float]

    def score(self, endpoints: Sequence[str]) -> dict[str, float]:
        return {e: -self.cost(e) for e in endpoints}


@dataclass(frozen=True)
class LoadScorer:
    load: Load

    def score(self, endpoints: Sequence[str]) -> dict[str, float]:
        return {e: -self.load(e) for e in endpoints}


@dataclass(frozen=True)
class AdapterScorer:
    residency: Mapping[str, float]  # lora_affinity.adapter_score per endpoint

    def score(self, endpoints: Sequence[str]) -> dict[str, float]:
        return {e: self.residency.get(e, UNKNOWN) for e in endpoints}


def precise_profile(
    costs: PromptCosts,
    load: Load,
    load_cost_tokens: float,
    healthy: Healthy,
    extra_cost: Callable[[str], float] | None = None,
) -> Profile:
    """Cost order from the KV index: uncached + pending tokens (+ an adapter's cost) +
    load_cost_tokens per request in flight, among the healthy endpoints."""
    scorers = [Weighted(KVCostScorer(costs))]
    if extra_cost is not None:
        scorers.append(Weighted(CostScorer(extra_cost)))
    scorers.append(Weighted(LoadScorer(load), load_cost_tokens))
    return Profile([HealthFilter(healthy)], scorers)


def adapter_profile(
    residency: Mapping[str, float], load: Load, healthy: Healthy, balance: float
) -> Profile:
    """Without the KV index: where a LoRA adapter is resident, among the healthy endpoints
    under the load cap (load stays bounded); the others follow in affinity order."""
    return Profile(
        [HealthFilter(healthy), UnderLoadCap(load, balance)], [Weighted(AdapterScorer(residency))]
    )
