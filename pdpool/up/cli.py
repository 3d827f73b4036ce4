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

from pdpool.settings_flags import add_flags, values_from_args

from .spec import AutoscaleSettings, RunSettings, TopologySpec

if TYPE_CHECKING:  # the topology module is imported when `up` runs, not for --help
    from pdpool.otlp_receiver import OtlpReceiver
    from pdpool.planner.policy import PlannerConfig
    from pdpool.planner.trace import TraceWriter

    from .autoscale import LocalAutoscaler
    from .topology import Topology


def add_arguments(p: argparse.ArgumentParser) -> None:
    """A flag per setting of spec.py: how the command runs, the topology it starts, its
    front door, then its planner."""
    add_flags(p, RunSettings)
    add_flags(p, TopologySpec)
    add_flags(
        p.add_argument_group(
            "autoscaling",
            "--autoscale: the planner adds and removes engines from their metrics and the "
            "TTFT/ITL targets; --prefill and --decode are then the minimums",
        ),
        AutoscaleSettings,
    )


def planner_config_from_args(args: argparse.Namespace) -> PlannerConfig:
    """The planner's settings the autoscaling flags describe; CliError when they cannot."""
    from pdpool.errors import CliError
    from pdpool.planner.policy import PlannerConfig, PlannerConfigError, RoleBounds

    if args.kv_events:
        raise CliError("--autoscale with --kv-events is not supported (the event feeds are fixed)")
    try:
        scale = AutoscaleSettings(**values_from_args(AutoscaleSettings, args)).validate()
    except ValueError as exc:
        raise CliError(str(exc)) from None
    prefill_max = args.prefill if scale.prefill_max is None else scale.prefill_max
    decode_max = args.decode if scale.decode_max is None else scale.decode_max
    try:
        return PlannerConfig(
            prefill=RoleBounds(args.prefill, prefill_max),
            decode=RoleBounds(args.decode, decode_max),
            ttft_seconds=scale.ttft_target_ms / 1000.0,
            itl_seconds=scale.itl_target_ms / 1000.0,
            down_window_s=scale.scale_down_window_s,
            up_cooldown_s=2 * scale.autoscale_interval_s,
            down_cooldown_s=scale.scale_down_window_s / 2,
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

    from .topology import ensure_tiny_model

    try:
        run = RunSettings(**values_from_args(RunSettings, args)).validate()
        # the model comes last: a tiny one is generated only for flags that make sense
        spec = TopologySpec(
            model="", discovery_files=args.autoscale, **values_from_args(TopologySpec, args)
        ).validate()
    except ValueError as exc:
        raise CliError(str(exc)) from None
    try:
        spec.model = run.model or ensure_tiny_model(run.arch)
    except RuntimeError as exc:
        raise CliError(str(exc)) from None
    return spec


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


def stop_on_signals(topology: "Topology") -> None:
    """SIGINT, SIGTERM and SIGHUP stop `up`: the first raises KeyboardInterrupt, which stops
    the children in order; another one kills them at once."""
    signalled = False

    def stop_on_signal(signum: int, frame: Optional[FrameType]) -> None:
        # The first signal stops everything in order; another one (an impatient second
        # Ctrl-C) must not interrupt that stop halfway and leave children running: it
        # kills them at once instead.
        nonlocal signalled
        if signalled:
            topology.kill()
            os.write(2, b"pdpool up: stopping now\n")  # print() is not reentrant
            return
        signalled = True
        raise KeyboardInterrupt

    # SIGINT too: a shell starts background jobs with it ignored, which Python keeps, and
    # Ctrl-C (or a supervisor's SIGINT) must still stop everything. SIGHUP (the terminal
    # closed) unless it was ignored on purpose (nohup).
    signal.signal(signal.SIGTERM, stop_on_signal)
    signal.signal(signal.SIGINT, stop_on_signal)
    if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:
        signal.signal(signal.SIGHUP, stop_on_signal)


def main(args: argparse.Namespace) -> int:
    from pdpool.errors import CliError
    from pdpool.ports import listen_error

    from .topology import Topology, write_state

    spec = spec_from_args(args)
    taken = listen_error("127.0.0.1", spec.port)
    if taken is not None:  # found now, not once every engine has loaded its model
        raise CliError(f"{taken} (give --port another port, or 0 for any free one)")
    planner = planner_config_from_args(args) if args.autoscale else None
    trace = open_trace(args)
    if args.otel and args.otlp_traces_endpoint:
        raise CliError("--otel and --otlp-traces-endpoint: choose one")
    receiver = start_span_receiver(args.otel, spec) if args.otel else None
    try:
        topology = Topology(spec)
    except RuntimeError as exc:  # openssl missing or failing (--tls)
        raise CliError(str(exc)) from None

    topology.children_die_with_parent = True
    stop_on_signals(topology)
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
