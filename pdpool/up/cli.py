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
        "tokens go prefill-first in decode-first mode (default 128)",
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
    p.add_argument("--log-dir", help="where each process writes its log (default: a temp dir)")
    p.add_argument("--state-file", help="write ports, pids and URLs here as JSON once ready")
    p.add_argument("--ready-timeout", type=float, default=300.0)


def spec_from_args(args: argparse.Namespace) -> TopologySpec:
    """The topology the flags describe; CliError for flags that cannot describe one."""
    from pdpool.errors import CliError

    from .topology import TopologySpec, ensure_tiny_model

    if args.prefill < 0 or args.decode < 1:
        raise CliError("need --decode >= 1 and --prefill >= 0")
    if not 0.0 <= args.cache_hit_threshold <= 1.0:
        raise CliError("--cache-hit-threshold must be in [0, 1]")
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
        engine=args.engine,
        engine_rejects=args.engine_rejects,
        prefill_min_prompt_tokens=args.prefill_min_prompt_tokens,
        tls=args.tls,
        kv_events=args.kv_events,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
    )


def supervise(topology: Topology, state_file: Optional[str]) -> NoReturn:
    """Restarts children that exit, until interrupted."""
    from .topology import write_state

    while True:
        time.sleep(0.5)
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
        supervise(topology, args.state_file)
    except KeyboardInterrupt:
        print("pdpool up: stopping", flush=True)
        return 0
    finally:
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
