"""`spec.autoscaling`: read once into the planner's settings (pdpool/planner) and the way
they are applied: the operator's own planner (`mode: planner`), HorizontalPodAutoscalers
on the engines' vLLM metrics (`mode: hpa`) or KEDA ScaledObjects on the same metrics in
Prometheus (`mode: keda`); only one of them per pool.

    autoscaling:
      mode: planner                   # or hpa, keda
      prefill: {min: 1, max: 4}
      decode:  {min: 1, max: 4}
      targets: {ttftSeconds: 1.0, itlSeconds: 0.05, kvCacheUsage: 0.85, waitingPerEngine: 4}
      behavior: {intervalSeconds: 15, scaleUpStabilizationSeconds: 0,
                 scaleDownStabilizationSeconds: 120, maxStepUp: 2, maxStepDown: 1,
                 upCooldownSeconds: 30, downCooldownSeconds: 60}
      scaleToZero: false              # prefill only
      drainSeconds: 300               # grace of a leaving engine (preStop + streams)
      hpa: {prefillMetric: {name, averageValue}, decodeMetric: {name, averageValue}}
      keda: {prometheusAddress: URL, prefillQuery: PromQL, decodeQuery: PromQL}

hpa.*Metric is each role's metric for both hpa and keda (keda's default query sums it over
the role's pods; the threshold is its averageValue per pod).

Pure: no I/O."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from pdpool.planner.policy import PlannerConfig, PlannerConfigError, RoleBounds
from pdpool.settings_flags import default_of

from .spec import QUANTITY, RolloutSpec, SpecError

MODES = ("planner", "hpa", "keda")
WHERE = "spec.autoscaling"
# Per-pod metrics an HPA scales on, as a metrics adapter (Prometheus Adapter) exposes the
# engines' own series: a queue for prefill, KV usage for decode (latency histograms need
# adapter rules of their own; name them here if you have them).
DEFAULT_HPA_METRICS = {
    "prefill": ("vllm:num_requests_waiting", "4"),
    "decode": ("vllm:kv_cache_usage_perc", "850m"),
}


@dataclass(frozen=True)
class HpaMetric:
    name: str
    average_value: str


@dataclass(frozen=True)
class KedaSpec:
    prometheus_address: str
    prefill_query: str | None  # None: the role metric summed over the role's pods
    decode_query: str | None


@dataclass(frozen=True)
class AutoscalingSpec:
    mode: str
    planner: PlannerConfig
    interval_s: float
    drain_seconds: int
    prefill_metric: HpaMetric
    decode_metric: HpaMetric
    keda: KedaSpec | None = None

    def bounds(self, role: str) -> RoleBounds:
        return self.planner.bounds(role)

    def metric(self, role: str) -> HpaMetric:
        """The role's metric (hpa's Pods metric, keda's query and threshold)."""
        return self.prefill_metric if role == "prefill" else self.decode_metric


def planner_default(name: str) -> Any:
    """The planner's own default of a setting (pdpool/planner/policy.py, which `pdpool up
    --autoscale` runs with too): written there once."""
    return default_of(PlannerConfig, name)


def _obj(d: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    value = d.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SpecError(f"{where}.{key} must be an object")
    return value


def _number(d: dict[str, Any], key: str, default: float, where: str, minimum: float = 0.0) -> float:
    value = d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
        raise SpecError(f"{where}.{key} must be a number >= {minimum:g}, got {value!r}")
    return float(value)


def _count(d: dict[str, Any], key: str, default: int, where: str, minimum: int = 0) -> int:
    value = d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecError(f"{where}.{key} must be an integer >= {minimum}, got {value!r}")
    return value


# PlannerConfig field -> (section of spec.autoscaling, key there, reader, minimum); absent
# keys take the planner's own default.
PLANNER_FIELDS: dict[str, tuple[str, str, Callable[..., Any], float]] = {
    "ttft_seconds": ("targets", "ttftSeconds", _number, 0.001),
    "itl_seconds": ("targets", "itlSeconds", _number, 0.0001),
    "kv_usage_target": ("targets", "kvCacheUsage", _number, 0.01),
    "waiting_per_engine": ("targets", "waitingPerEngine", _number, 0.1),
    "up_window_s": ("behavior", "scaleUpStabilizationSeconds", _number, 0.0),
    "down_window_s": ("behavior", "scaleDownStabilizationSeconds", _number, 0.0),
    "max_step_up": ("behavior", "maxStepUp", _count, 1),
    "max_step_down": ("behavior", "maxStepDown", _count, 1),
    "up_cooldown_s": ("behavior", "upCooldownSeconds", _number, 0.0),
    "down_cooldown_s": ("behavior", "downCooldownSeconds", _number, 0.0),
}


def _bounds(a: dict[str, Any], role: str) -> RoleBounds:
    where = f"{WHERE}.{role}"
    r = _obj(a, role, WHERE)
    if "max" not in r:
        raise SpecError(f"{where}.max is required")
    return RoleBounds(_count(r, "min", 1, where), _count(r, "max", 0, where))


def _metric(h: dict[str, Any], role: str) -> HpaMetric:
    where = f"{WHERE}.hpa.{role}Metric"
    m = _obj(h, f"{role}Metric", f"{WHERE}.hpa")
    name, value = DEFAULT_HPA_METRICS[role]
    name = m.get("name", name)
    value = str(m.get("averageValue", value))
    if not isinstance(name, str) or not name or "/" in name or "%" in name:
        raise SpecError(f"{where}.name must be a metric name without '/' or '%', got {name!r}")
    if not QUANTITY.match(value):
        raise SpecError(f"{where}.averageValue: {value!r} is not a quantity")
    return HpaMetric(name, value)


def _keda(a: dict[str, Any], mode: str) -> KedaSpec | None:
    where = f"{WHERE}.keda"
    k = _obj(a, "keda", WHERE)
    if mode != "keda":
        return None
    address = k.get("prometheusAddress")
    if not isinstance(address, str) or not address.startswith(("http://", "https://")):
        raise SpecError(
            f"{where}.prometheusAddress is required with mode keda: the http(s) URL of the "
            f"Prometheus KEDA queries, got {address!r}"
        )
    queries = []
    for role in ("prefill", "decode"):
        q = k.get(f"{role}Query")
        if q is not None and (not isinstance(q, str) or not q.strip()):
            raise SpecError(f"{where}.{role}Query must be a non-empty PromQL string")
        queries.append(q)
    return KedaSpec(address, *queries)


def parse_autoscaling(spec: dict[str, Any]) -> AutoscalingSpec | None:
    """`spec.autoscaling` -> settings; None when absent or `enabled: false`."""
    a = _obj(spec, "autoscaling", "spec")
    if not a or a.get("enabled", True) is False:
        return None
    mode = a.get("mode", "planner")
    if mode not in MODES:
        raise SpecError(f"{WHERE}.mode must be one of {', '.join(MODES)}, got {mode!r}")
    targets = _obj(a, "targets", WHERE)
    behavior = _obj(a, "behavior", WHERE)
    scale_to_zero = a.get("scaleToZero", planner_default("scale_to_zero"))
    if not isinstance(scale_to_zero, bool):
        raise SpecError(f"{WHERE}.scaleToZero must be a boolean")
    sections = {"targets": targets, "behavior": behavior}
    tuned: dict[str, Any] = {}
    for field, (section, key, read, minimum) in PLANNER_FIELDS.items():
        where = f"{WHERE}.{section}"
        tuned[field] = read(sections[section], key, planner_default(field), where, minimum)
    try:
        planner = PlannerConfig(
            prefill=_bounds(a, "prefill"),
            decode=_bounds(a, "decode"),
            scale_to_zero=scale_to_zero,
            **tuned,
        ).validate()
    except PlannerConfigError as exc:
        raise SpecError(f"{WHERE}: {exc}") from None
    hpa = _obj(a, "hpa", WHERE)
    return AutoscalingSpec(
        mode=mode,
        planner=planner,
        # Slower than `pdpool up --autoscale`'s 2 s: a cluster's signals are scraped every
        # 15 s or so (Prometheus), deciding faster reads the same samples again.
        interval_s=_number(behavior, "intervalSeconds", 15.0, f"{WHERE}.behavior", minimum=1.0),
        # a leaving engine drains as long as one a rollout replaces
        drain_seconds=_count(
            a, "drainSeconds", default_of(RolloutSpec, "drain_seconds"), WHERE, minimum=10
        ),
        prefill_metric=_metric(hpa, "prefill"),
        decode_metric=_metric(hpa, "decode"),
        keda=_keda(a, mode),
    )
