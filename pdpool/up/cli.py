"""`pdpool up`: the whole P/D topology as local processes; prints the gateway URL.

Ctrl-C or SIGTERM stops every process it started."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from types import FrameType
from typing import TYPE_CHECKING, NoReturn, Optional

from pdpool.cli import add_switch

if TYPE_CHECKING:  # the topology module is imported when `up` runs, not for --help
    from pdpool.otlp_receiver import OtlpReceiver
    from pdpool.planner.policy import PlannerConfig
    from pdpool.planner.trace import TraceWriter

    from .autoscale import LocalAutoscaler
    from .topology import Topology, TopologySpec


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        help="checkpoint folder (default: a tiny random model, "
        "generated once per generator version into ~/.cache/pdpool)",
    )
    p.add_argument(
        "--arch",
        default="qwen3",
        choices=("qwen3", "qwen3_5"),
        help="architecture of the default tiny model",
    )
    p.add_argument("--prefill", type=int, default=1, help="prefill engines")
    p.add_argument("--decode", type=int, default=1, help="decode engines (one sidecar each)")
    p.add_argument("--port", type=int, default=8080, help="gateway port (0: any free port)")
    p.add_argument(
        "--mode", default="decode-first", choices=("decode-first", "prefill-first", "aggregated")
    )
    p.add_argument("--cache-hit-threshold", type=float, default=0.5)
    add_switch(p, "--pull-from-decode", True, "let prefill pull decode's cached prefix")
    p.add_argument("--kv-connector", default="auto", choices=("auto", "nixl", "none"))
    p.add_argument("--device", default="cpu", choices=("auto", "cpu", "cuda"))
    p.add_argument("--prefill-timeout", type=float, default=30.0)
    p.add_argument(
        "--decode-retry-s",
        type=float,
        default=30.0,
        help="how long a sidecar retries its restarting decode engine",
    )
    p.add_argument(
        "--engine-arg",
        dest="engine_args",
        action="append",
        default=[],
        help="extra argument for every `pdpool serve` (repeatable), "
        "e.g. --engine-arg=--num-kv-blocks=512",
    )
    p.add_argument(
        "--kv-offload",
        choices=("native", "disk", "shared"),
        default=None,
        help="a KV offload tier below every engine's pool: native (host memory), disk (a "
        "directory per engine) or shared (one directory all engines read, so one's prefix "
        "is a hit for all)",
    )
    p.add_argument(
        "--kv-offload-size",
        type=float,
        default=1.0,
        help="GiB of offload tier per engine (default 1)",
    )
    p.add_argument("--kv-offload-dir", help="the tier's directory (default: <log dir>/kv-offload)")
    p.add_argument(
        "--engine",
        default="pdpool",
        choices=("pdpool", "vllm"),
        help="engine of every prefill/decode process: pdpool serve, or stock "
        "`vllm serve` (CPU build from scripts/vllm/build-venv.sh, or "
        "$PDPOOL_VLLM_BIN; --engine-arg passes vLLM flags)",
    )
    p.add_argument(
        "--engine-rejects",
        choices=("auto", "yes", "no"),
        help="sidecar: does the engine honour cache_hit_threshold (default: yes "
        "for pdpool, no for vllm)",
    )
    p.add_argument(
        "--prefill-min-prompt-tokens",
        type=int,
        help="sidecar, engines that cannot reject: prompts of at least this many "
        "tokens go prefill-first in decode-first mode (default: the sidecar's, "
        "`pdpool sidecar --help`)",
    )
    p.add_argument(
        "--tls",
        action="store_true",
        help="every hop over HTTPS (gateway, sidecars, engines), with a CA and "
        "certificate made for this run in <log dir>/tls (clients: --cacert)",
    )
    p.add_argument(
        "--kv-events",
        action="store_true",
        help="decode engines publish KV cache events (--kv-events-config) and the "
        "gateway routes by them: cost = uncached prompt tokens + load, P/D "
        "decided up front (see docs/sidecar.md)",
    )
    p.add_argument(
        "--otlp-traces-endpoint",
        help="every process (engines, stock vLLM too, sidecars, gateway) exports "
        "OpenTelemetry traces to this OTLP URL (OTEL_* variables honoured)",
    )
    p.add_argument(
        "--otel",
        metavar="FILE",
        help="traces without a collector: a small OTLP receiver in this process writes "
        "every span to FILE (JSON lines; - for the console)",
    )
    p.add_argument(
        "--tenants-file",
        help="flow control at the gateway: YAML of tenants (API keys, weight, priority, "
        "limits; docs/flow-control.md); requests that cannot wait get 429 + Retry-After",
    )
    p.add_argument("--log-dir", help="where each process writes its log (default: a temp dir)")
    p.add_argument("--state-file", help="write ports, pids and URLs here as JSON once ready")
    add_autoscale_arguments(p)
    add_gateway_arguments(p)
    p.add_argument("--ready-timeout", type=float, default=300.0)


def add_gateway_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("front door (docs/gateway-api.md)")
    g.add_argument(
        "--gateway",
        default="ours",
        choices=("ours", "envoy"),
        help="ours: pdpool gateway; envoy: real Envoy (scripts/envoy/install.sh) asking "
        "pdpool epp, the Gateway API Inference Extension endpoint picker, on the same port",
    )
    g.add_argument("--envoy-bin", help="the envoy binary (default: PDPOOL_ENVOY_BIN, the cache)")
    g.add_argument(
        "--epp-failure-mode",
        default="close",
        choices=("open", "close"),
        help="when the picker is down: close answers 5xx, open serves round-robin",
    )
    g.add_argument(
        "--epp-arg",
        dest="epp_args",
        action="append",
        default=[],
        metavar="=--FLAG",
        help="an extra `pdpool epp` flag (repeatable; write --epp-arg=--flag)",
    )
    g.add_argument(
        "--sidecar-arg",
        dest="sidecar_args",
        action="append",
        default=[],
        metavar="=--FLAG",
        help="an extra `pdpool sidecar` flag for every sidecar (repeatable; write "
        "--sidecar-arg=--flag), e.g. --sidecar-arg=--lora-allowed-dir=/adapters",
    )


def add_autoscale_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "autoscaling",
        "--autoscale: the planner adds and removes engines from their metrics and the "
        "TTFT/ITL targets; --prefill and --decode are then the minimums",
    )
    g.add_argument("--autoscale", action="store_true", help="scale prefill and decode engines")
    g.add_argument("--prefill-max", type=int, help="most prefill engines (default: --prefill)")
    g.add_argument("--decode-max", type=int, help="most decode engines (default: --decode)")
    g.add_argument("--ttft-target-ms", type=float, default=1000.0, help="p90 TTFT target")
    g.add_argument("--itl-target-ms", type=float, default=50.0, help="p90 ITL target")
    g.add_argument("--autoscale-interval-s", type=float, default=2.0, help="one decision per")
    g.add_argument(
        "--scale-down-window-s",
        type=float,
        default=30.0,
        help="an engine is removed only after this long asking for fewer",
    )
    g.add_argument(
        "--autoscale-trace",
        metavar="FILE",
        help="record every scrape the planner reads and the replicas it counted "
        "(gzip JSON lines: pdpool/planner/trace.py), to replay its decisions",
    )


def planner_config_from_args(args: argparse.Namespace) -> PlannerConfig:
    """The planner's settings the autoscaling flags describe; CliError when they cannot."""
    from pdpool.errors import CliError
    from pdpool.planner.policy import PlannerConfig, PlannerConfigError, RoleBounds

    if args.kv_events:
        raise CliError("--autoscale with --kv-events is not supported (the event feeds are fixed)")
    if args.autoscale_interval_s <= 0 or args.scale_down_window_s < 0:
        raise CliError("--autoscale-interval-s must be > 0 and --scale-down-window-s >= 0")
    try:
        return PlannerConfig(
            prefill=RoleBounds(
                args.prefill, args.prefill if args.prefill_max is None else args.prefill_max
            ),
            decode=RoleBounds(
                args.decode, args.decode if args.decode_max is None else args.decode_max
            ),
            ttft_seconds=args.ttft_target_ms / 1000.0,
            itl_seconds=args.itl_target_ms / 1000.0,
            down_window_s=args.scale_down_window_s,
            up_cooldown_s=2 * args.autoscale_interval_s,
            down_cooldown_s=args.scale_down_window_s / 2,
        ).validate()
    except PlannerConfigError as exc:
        raise CliError(f"--autoscale: {exc} (--prefill/--decode are the minimums)") from None


def local_autoscaler(
    topology: Topology,
    planner: Optional[PlannerConfig],
    args: argparse.Namespace,
    trace: Optional[TraceWriter],
) -> Optional[LocalAutoscaler]:
    """The planner on the local engines, when --autoscale asked for it."""
    if planner is None:
        return None
    from .autoscale import LocalAutoscaler

    autoscaler = LocalAutoscaler(topology, planner, args.autoscale_interval_s, args.state_file)
    autoscaler.trace = trace
    autoscaler.write_state()
    return autoscaler


def open_trace(args: argparse.Namespace) -> Optional[TraceWriter]:
    """`--autoscale-trace FILE` opened before anything starts (a bad path is one line)."""
    from pdpool.errors import CliError
    from pdpool.planner.trace import TraceWriter

    if not args.autoscale_trace:
        return None
    if not args.autoscale:
        raise CliError("--autoscale-trace records the planner's inputs: it needs --autoscale")
    try:
        return TraceWriter(args.autoscale_trace)
    except OSError as exc:
        raise CliError(f"--autoscale-trace {args.autoscale_trace}: {exc.strerror}") from None


def spec_from_args(args: argparse.Namespace) -> TopologySpec:
    """The topology the flags describe; CliError for flags that cannot describe one."""
    from pdpool.errors import CliError

    from .topology import TopologySpec, ensure_tiny_model

    if args.prefill < 0 or args.decode < 1:
        raise CliError("need --decode >= 1 and --prefill >= 0")
    if not 0.0 <= args.cache_hit_threshold <= 1.0:
        raise CliError("--cache-hit-threshold must be in [0, 1]")
    if not 0 < args.kv_offload_size <= 1 << 20:
        raise CliError("--kv-offload-size must be > 0 GiB")
    if args.kv_offload and args.engine == "vllm":
        raise CliError(
            "--kv-offload runs pdpool's tiers; for stock vLLM pass its own flags "
            "(--engine-arg=--kv-offloading-size=GIB)"
        )
    try:
        model = args.model or ensure_tiny_model(args.arch)
    except RuntimeError as exc:
        raise CliError(str(exc)) from None
    return TopologySpec(
        model=model,
        prefill=args.prefill,
        decode=args.decode,
        port=args.port,
        mode=args.mode,
        cache_hit_threshold=args.cache_hit_threshold,
        pull_from_decode=args.pull_from_decode,
        kv_connector=args.kv_connector,
        device=args.device,
        prefill_timeout=args.prefill_timeout,
        decode_retry_s=args.decode_retry_s,
        engine_args=args.engine_args,
        log_dir=args.log_dir,
        kv_offload=args.kv_offload,
        kv_offload_size_gib=args.kv_offload_size,
        kv_offload_dir=os.path.abspath(args.kv_offload_dir) if args.kv_offload_dir else None,
        engine=args.engine,
        engine_rejects=args.engine_rejects,
        prefill_min_prompt_tokens=args.prefill_min_prompt_tokens,
        tls=args.tls,
        kv_events=args.kv_events,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        discovery_files=args.autoscale,
        tenants_file=os.path.abspath(args.tenants_file) if args.tenants_file else None,
        gateway=args.gateway,
        envoy_bin=args.envoy_bin,
        epp_failure_mode=args.epp_failure_mode,
        epp_args=args.epp_args,
        sidecar_args=args.sidecar_args,
    )


def supervise(
    topology: Topology, state_file: Optional[str], autoscaler: Optional[LocalAutoscaler] = None
) -> NoReturn:
    """Restarts children that exit (and applies the planner's decisions), until interrupted."""
    from .topology import write_state

    while True:
        time.sleep(0.5)
        if autoscaler is not None:
            autoscaler.tick()
        for child in topology.supervise_once():
            print(
                f"pdpool up: {child.name} exited; restarted it (restart #{child.restarts})",
                file=sys.stderr,
                flush=True,
            )
            if state_file:
                write_state(state_file, topology)


def main(args: argparse.Namespace) -> int:
    from pdpool.errors import CliError

    from .topology import Topology, write_state

    spec = spec_from_args(args)
    planner = planner_config_from_args(args) if args.autoscale else None
    trace = open_trace(args)
    if args.otel and args.otlp_traces_endpoint:
        raise CliError("--otel and --otlp-traces-endpoint: choose one")
    receiver = start_span_receiver(args.otel, spec) if args.otel else None
    try:
        topology = Topology(spec)
    except RuntimeError as exc:  # openssl missing or failing (--tls)
        raise CliError(str(exc)) from None

    def stop_on_signal(signum: int, frame: Optional[FrameType]) -> NoReturn:
        raise KeyboardInterrupt

    # SIGINT too: a shell starts background jobs with it ignored, which Python keeps, and
    # Ctrl-C (or a supervisor's SIGINT) must still stop everything.
    signal.signal(signal.SIGTERM, stop_on_signal)
    signal.signal(signal.SIGINT, stop_on_signal)
    print(
        f"pdpool up: starting {args.prefill} prefill + {args.decode} decode engines "
        f"(engine {args.engine}, model {spec.model}, kv connector {topology.kv_connector}, "
        f"mode {args.mode}); "
        f"logs in {topology.log_dir}",
        flush=True,
    )
    try:
        try:
            topology.start(args.ready_timeout)
        except (RuntimeError, TimeoutError) as exc:
            raise CliError(str(exc)) from None
        if args.state_file:
            write_state(args.state_file, topology)
        print(f"pdpool up: ready. OpenAI base URL: {topology.gateway.url}/v1", flush=True)
        if topology.ca_file:
            print(
                f"pdpool up: TLS on every hop; trust {topology.ca_file} "
                f"(curl --cacert, SSL_CERT_FILE)",
                flush=True,
            )
        supervise(topology, args.state_file, local_autoscaler(topology, planner, args, trace))
    except KeyboardInterrupt:
        print("pdpool up: stopping", flush=True)
        return 0
    finally:
        if trace is not None:
            trace.close()
        topology.stop()
        if receiver is not None:
            receiver.stop()


def start_span_receiver(path: str, spec: TopologySpec) -> OtlpReceiver:
    """`--otel FILE`: an OTLP/HTTP receiver here, every child exporting to it (batches
    sent every half second, so a trace shows up soon after its request)."""
    from pdpool.errors import CliError
    from pdpool.otlp_receiver import OtlpReceiver

    try:
        receiver = OtlpReceiver(None if path == "-" else path, echo=path == "-", keep=False).start()
    except OSError as exc:
        raise CliError(f"--otel {path}: {exc}") from None
    spec.otlp_traces_endpoint = receiver.endpoint
    spec.tracing_env = {
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": os.environ.get("OTEL_BSP_SCHEDULE_DELAY", "500"),
    }
    print(f"pdpool up: spans to {path} (OTLP receiver {receiver.endpoint})", flush=True)
    return receiver
