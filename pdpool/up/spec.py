"""`pdpool up`'s settings: the topology it starts (TopologySpec), how the command runs it
(RunSettings) and its planner (AutoscaleSettings). Each is a dataclass field declared with
`setting(...)`, so its default and help live once and the flags are generated from them
(pdpool/settings_flags.py), as for serve, sidecar, gateway and epp.

The defaults are the command line's, the ones a user sees: the gateway on port 8080, a
decode engine's restart ridden out for 30 s. Programs that start topologies side by side
(tests, benchmarks, devtools) pass their own values: `SIDE_BY_SIDE`.

A setting handed on to every sidecar takes its default, choices and help from the
sidecar's own field (`sidecar_setting`), so neither is written twice. No heavy imports:
`pdpool --help` builds these flags.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Optional

from pdpool.planner.policy import PlannerConfig
from pdpool.settings_flags import FLAG, Flag, field_default, option_name, setting
from pdpool.sidecar.proxy.settings import SidecarSettings

GATEWAY = "front door (docs/gateway-api.md)"


# What programs that start topologies side by side pass instead of the command line's
# values: any free gateway port, and the sidecar's own short decode retry (a test that
# restarts a decode engine waits seconds for its sidecar to give up, not half a minute).
def sidecar_field(name: str) -> dataclasses.Field[Any]:
    return next(f for f in dataclasses.fields(SidecarSettings) if f.name == name)


SIDE_BY_SIDE: dict[str, Any] = {
    "port": 0,
    "decode_retry_s": field_default(sidecar_field("decode_retry_s")),
}


def sidecar_setting(name: str, **overrides: Any) -> Any:
    """A topology setting passed to every sidecar as its `name` flag: the sidecar field's
    default, choices, switch and help, unless `overrides` (a different `default` included)
    says otherwise."""
    f = sidecar_field(name)
    flag: Flag = f.metadata[FLAG]
    default = overrides.pop("default", field_default(f))
    flags: dict[str, Any] = {"help": f"sidecars: {flag.help}", "choices": flag.choices}
    if flag.switch:
        flags["switch"] = True
    return setting(default, **{**flags, **overrides})


def sidecars_default(name: str) -> str:
    """A help suffix naming the sidecar field's default, read from the field."""
    return f"(not given: the sidecar's, {field_default(sidecar_field(name))})"


MAX_ENGINES = 256  # per role: a local topology is processes on one machine
MAX_SECONDS = 7 * 24 * 3600.0  # a wait beyond a week is a typo (and inf overflows timers)
MAX_OFFLOAD_GIB = float(1 << 20)


def check_range(
    settings: object, name: str, low: float, high: float, *, above: bool = False
) -> None:
    """ValueError naming the flag unless low <= the setting <= high (low < it with `above`);
    NaN fails every comparison, so it is refused too."""
    value = getattr(settings, name)
    if not ((value > low if above else value >= low) and value <= high):
        f = next(f for f in dataclasses.fields(settings) if f.name == name)  # type: ignore[arg-type]
        span = f"{'(' if above else '['}{_shown(low)}, {_shown(high)}]"
        raise ValueError(f"{option_name(f, f.metadata[FLAG])} must be in {span}, got {value}")


def _shown(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else format(bound, "g")


def absolute(path: Optional[str]) -> Optional[str]:
    """A path flag made absolute where it is read: children run in other folders."""
    return os.path.abspath(path) if path else None


@dataclass
class TopologySpec:
    """The processes of one local P/D topology; topology.py turns it into command lines
    (through pdpool/command_lines.py) and runs them."""

    model: str  # a checkpoint folder (RunSettings.model, or the tiny model, fills it in)
    prefill: int = setting(1, help="prefill engines")
    decode: int = setting(1, help="decode engines (one sidecar each)")
    port: int = setting(8080, help="gateway port (0: any free port)")
    mode: str = sidecar_setting("mode")
    cache_hit_threshold: float = sidecar_setting("cache_hit_threshold")
    pull_from_decode: bool = sidecar_setting("pull_from_decode")
    # auto: nixl when the engine supports it, else none
    kv_connector: str = setting(
        "auto",
        choices=("auto", "nixl", "none"),
        help="how prefill hands KV to decode (auto: NIXL where the engine has it)",
    )
    device: str = setting("cpu", choices=("auto", "cpu", "cuda"), help="every engine's device")
    prefill_timeout: float = sidecar_setting("prefill_timeout")
    # Longer than the sidecar's own: a user's decode engine restarting (a crash, a new
    # build) is ridden out rather than answered with errors.
    decode_retry_s: float = sidecar_setting(
        "decode_retry_s",
        default=30.0,
        help="how long a sidecar retries its restarting decode engine",
    )
    engine_args: list[str] = setting(
        default_factory=list,
        name="--engine-arg",
        repeat="append",
        help="extra argument for every `pdpool serve` (repeatable), "
        "e.g. --engine-arg=--num-kv-blocks=512",
    )
    log_dir: Optional[str] = setting(
        None, help="where each process writes its log (default: a temp dir)"
    )
    # KV offload tier below every engine's pool (engine/kv/offload/): None (off), native
    # (host memory), disk (a directory per engine, as an emptyDir per pod) or shared (one
    # directory for every engine, as a PVC shared by the pool).
    kv_offload: Optional[str] = setting(
        None,
        choices=("native", "disk", "shared"),
        help="a KV offload tier below every engine's pool: native (host memory), disk (a "
        "directory per engine) or shared (one directory all engines read, so one's prefix "
        "is a hit for all)",
    )
    kv_offload_size_gib: float = setting(
        1.0, name="--kv-offload-size", metavar="GIB", help="GiB of offload tier per engine"
    )
    kv_offload_dir: Optional[str] = setting(
        None, parse=absolute, help="the tier's directory (default: <log dir>/kv-offload)"
    )
    # pdpool (`pdpool serve`) or vllm (stock `vllm serve`, CPU build: see vllm_command())
    engine: str = setting(
        "pdpool",
        choices=("pdpool", "vllm"),
        help="engine of every prefill/decode process: pdpool serve, or stock "
        "`vllm serve` (CPU build from scripts/vllm/build-venv.sh, or "
        "$PDPOOL_VLLM_BIN; --engine-arg passes vLLM flags)",
    )
    vllm_bin: Optional[str] = None  # the `vllm` executable (default: vllm_command())
    # None: by engine (topology.py: yes for pdpool serve, no for stock vLLM)
    engine_rejects: Optional[str] = sidecar_setting(
        "engine_rejects",
        default=None,
        help="sidecars: does the engine honour cache_hit_threshold (not given: yes for "
        "pdpool, no for vllm)",
    )
    prefill_min_prompt_tokens: Optional[int] = sidecar_setting(
        "prefill_min_prompt_tokens",
        default=None,
        type=int,
        help="sidecars, engines that cannot reject: prompts of at least this many tokens go "
        "prefill-first in decode-first mode " + sidecars_default("prefill_min_prompt_tokens"),
    )
    # Every hop over HTTPS (client -> gateway -> sidecar -> engines), with a CA and one
    # certificate (127.0.0.1, localhost) made for this topology in <log dir>/tls.
    tls: bool = setting(
        False,
        help="every hop over HTTPS (gateway, sidecars, engines), with a CA and "
        "certificate made for this run in <log dir>/tls (clients: --cacert)",
    )
    # Precise KV-aware routing: decode engines publish KV events (--kv-events-config), the
    # gateway indexes them and routes by cost (sidecar/routing/kv_cost.py).
    kv_events: bool = setting(
        False,
        help="decode engines publish KV cache events (--kv-events-config) and the "
        "gateway routes by them: cost = uncached prompt tokens + load, P/D "
        "decided up front (see docs/sidecar.md)",
    )
    kv_load_cost: Optional[float] = None  # gateway --kv-load-cost (None: its default)
    # Flow control: the gateway's --tenants-file (tenants' fair queues, 429 when shed).
    tenants_file: Optional[str] = setting(
        None,
        parse=absolute,
        help="flow control at the gateway: YAML of tenants (API keys, weight, priority, "
        "limits; docs/flow-control.md); requests that cannot wait get 429 + Retry-After",
    )
    # Tracing: every child (engines, stock vLLM too, sidecars, gateway) exports its spans
    # here (--otlp-traces-endpoint), with these variables added to its environment
    # (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, OTEL_BSP_SCHEDULE_DELAY, ...).
    otlp_traces_endpoint: Optional[str] = setting(
        None,
        help="every process (engines, stock vLLM too, sidecars, gateway) exports "
        "OpenTelemetry traces to this OTLP URL (OTEL_* variables honoured)",
    )
    # The gateway and the sidecars find their upstreams in files (file: discovery), so that
    # engines can be added and removed while serving (`pdpool up --autoscale` sets it).
    discovery_files: bool = False
    tracing_env: dict[str, str] = dataclasses.field(default_factory=dict)
    # The front door: ours (pdpool gateway) or envoy (real Envoy asking `pdpool epp`, the
    # Gateway API Inference Extension endpoint picker: envoy_gateway.py).
    gateway: str = setting(
        "ours",
        choices=("ours", "envoy"),
        group=GATEWAY,
        help="ours: pdpool gateway; envoy: real Envoy (scripts/envoy/install.sh) asking "
        "pdpool epp, the Gateway API Inference Extension endpoint picker, on the same port",
    )
    envoy_bin: Optional[str] = setting(
        None, group=GATEWAY, help="the envoy binary (default: PDPOOL_ENVOY_BIN, the cache)"
    )
    # Envoy's ext_proc failure_mode_allow
    epp_failure_mode: str = setting(
        "close",
        choices=("open", "close"),
        group=GATEWAY,
        help="when the picker is down: close answers 5xx, open serves round-robin",
    )
    epp_args: list[str] = setting(
        default_factory=list,
        name="--epp-arg",
        repeat="append",
        metavar="=--FLAG",
        group=GATEWAY,
        help="an extra `pdpool epp` flag (repeatable; write --epp-arg=--flag)",
    )
    gateway_args: list[str] = dataclasses.field(default_factory=list)  # more gateway flags
    # The sidecars may load a decode engine's LoRA adapter on a prefill engine from these
    # folders (sidecar --lora-allowed-dir; the engines need runtime LoRA updates on).
    lora_allowed_dirs: list[str] = dataclasses.field(default_factory=list)
    sidecar_args: list[str] = setting(
        default_factory=list,
        name="--sidecar-arg",
        repeat="append",
        metavar="=--FLAG",
        group=GATEWAY,
        help="an extra `pdpool sidecar` flag for every sidecar (repeatable; write "
        "--sidecar-arg=--flag), e.g. --sidecar-arg=--lora-allowed-dir=/adapters",
    )

    def validate(self) -> TopologySpec:
        """ValueError naming the flag of a value no topology can have."""
        check_range(self, "prefill", 0, MAX_ENGINES)
        check_range(self, "decode", 1, MAX_ENGINES)
        check_range(self, "port", 0, 65535)
        check_range(self, "cache_hit_threshold", 0, 1)
        check_range(self, "prefill_timeout", 0, MAX_SECONDS, above=True)
        check_range(self, "decode_retry_s", 0, MAX_SECONDS)
        check_range(self, "kv_offload_size_gib", 0, MAX_OFFLOAD_GIB, above=True)
        if self.kv_offload and self.engine == "vllm":
            raise ValueError(
                "--kv-offload runs pdpool's tiers; for stock vLLM pass its own flags "
                "(--engine-arg=--kv-offloading-size=GIB)"
            )
        if self.prefill_min_prompt_tokens is not None:
            check_range(self, "prefill_min_prompt_tokens", 0, 1 << 30)
        return self


@dataclass
class RunSettings:
    """How `pdpool up` runs its topology: which checkpoint, how long it waits for it, where
    its state and spans go."""

    model: Optional[str] = setting(
        None,
        help="checkpoint folder (default: a tiny random model, "
        "generated once per generator version into ~/.cache/pdpool)",
    )
    arch: str = setting(
        "qwen3", choices=("qwen3", "qwen3_5"), help="architecture of the default tiny model"
    )
    otel: Optional[str] = setting(
        None,
        metavar="FILE",
        help="traces without a collector: a small OTLP receiver in this process writes "
        "every span to FILE (JSON lines; - for the console)",
    )
    state_file: Optional[str] = setting(
        None, help="write ports, pids and URLs here as JSON once ready"
    )
    ready_timeout: float = setting(300.0, help="seconds for every process to answer")

    def validate(self) -> RunSettings:
        check_range(self, "ready_timeout", 0, MAX_SECONDS, above=True)
        return self


@dataclass
class AutoscaleSettings:
    """`pdpool up --autoscale`: the planner (pdpool/planner) on the local engines."""

    autoscale: bool = setting(False, help="scale prefill and decode engines")
    prefill_max: Optional[int] = setting(
        None, type=int, help="most prefill engines (default: --prefill)"
    )
    decode_max: Optional[int] = setting(
        None, type=int, help="most decode engines (default: --decode)"
    )
    # the planner's own targets, in milliseconds
    ttft_target_ms: float = setting(PlannerConfig.ttft_seconds * 1000.0, help="p90 TTFT target")
    itl_target_ms: float = setting(PlannerConfig.itl_seconds * 1000.0, help="p90 ITL target")
    autoscale_interval_s: float = setting(2.0, help="one decision per")
    # Shorter than a cluster's planner (PlannerConfig.down_window_s): a local run is short.
    scale_down_window_s: float = setting(
        30.0, help="an engine is removed only after this long asking for fewer"
    )
    autoscale_trace: Optional[str] = setting(
        None,
        metavar="FILE",
        help="record every scrape the planner reads and the replicas it counted "
        "(gzip JSON lines: pdpool/planner/trace.py), to replay its decisions",
    )

    def validate(self) -> AutoscaleSettings:
        """ValueError naming the flag; the bounds against --prefill/--decode are the
        planner's (PlannerConfig.validate)."""
        for name in ("prefill_max", "decode_max"):
            if getattr(self, name) is not None:
                check_range(self, name, 0, MAX_ENGINES)
        check_range(self, "ttft_target_ms", 0, MAX_SECONDS * 1000, above=True)
        check_range(self, "itl_target_ms", 0, MAX_SECONDS * 1000, above=True)
        check_range(self, "autoscale_interval_s", 0, MAX_SECONDS, above=True)
        check_range(self, "scale_down_window_s", 0, MAX_SECONDS)
        return self
