"""Routing as plugins: a profile runs filters, then weighted scorers, then a picker, over
the endpoints of one pool (as llm-d's scheduling framework: Filter, Scorer, Picker).

Scores are higher-is-better numbers on one scale per profile (the precise profile's are
minus costs in prompt tokens, so that weights keep their meaning: a load weight of 64 is
"one request in flight costs as much as 64 uncached tokens"); they are not normalised
to [0, 1] as llm-d's, which would change the decisions this pool has always made.

What a filter removes is not refused: it follows the picked endpoints in the order it
came in (better a try on a sick endpoint than no answer). The picker sees the candidates
in the order the profile got them (the prefix-affinity order) and keeps that order among
equal scores. Plugins are built per request with what they need of it; they do no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence


class Filter(Protocol):
    def filter(self, endpoints: Sequence[str]) -> list[str]:
        """The endpoints fit to serve, in their order."""
        ...


class Scorer(Protocol):
    def score(self, endpoints: Sequence[str]) -> Mapping[str, float]:
        """A score for each endpoint, higher better (missing: 0)."""
        ...


class Picker(Protocol):
    def pick(self, endpoints: Sequence[str], scores: Mapping[str, float]) -> list[str]:
        """The endpoints to try, best first."""
        ...


@dataclass(frozen=True)
class Weighted:
    scorer: Scorer
    weight: float = 1.0


class MaxScorePicker:
    """Highest total score first; equal scores keep the candidates' order."""

    def pick(self, endpoints: Sequence[str], scores: Mapping[str, float]) -> list[str]:
        pos = {e: i for i, e in enumerate(endpoints)}
        return sorted(endpoints, key=lambda e: (-scores.get(e, 0.0), pos[e]))


@dataclass(frozen=True)
class Profile:
    filters: Sequence[Filter] = ()
    scorers: Sequence[Weighted] = ()
    picker: Picker = field(default_factory=MaxScorePicker)

    def scores(self, endpoints: Sequence[str]) -> dict[str, float]:
        """The weighted sum of the scorers, added in their order."""
        total = dict.fromkeys(endpoints, 0.0)
        for weighted in self.scorers:
            scored = weighted.scorer.score(endpoints)
            for e in endpoints:
                total[e] += weighted.weight * scored.get(e, 0.0)
        return total

    def order(self, endpoints: Sequence[str]) -> list[str]:
        """Picked among what the filters keep, then what they removed (in `endpoints`' order)."""
        fit = list(endpoints)
        for f in self.filters:
            fit = f.filter(fit)
        kept = set(fit)
        return self.picker.pick(fit, self.scores(fit)) + [e for e in endpoints if e not in kept]
