"""`pdpool epp`'s settings: the routing core's, and the endpoint picker's own serving ones.
Each field with a `setting(...)` is a flag (pdpool/settings_flags.py); its default here is the
flag's (--host and --port are grpc_host and grpc_port)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pdpool.body_budget import DEFAULT_MAX_BODY_BYTES_IN_FLIGHT, IN_FLIGHT_HELP, check_budget
from pdpool.protocol import DEFAULT_MAX_BODY_BYTES
from pdpool.settings_flags import setting, size

from ..routing.settings import RoutingSettings


@dataclass
class EppSettings(RoutingSettings):
    grpc_host: str = "0.0.0.0"  # GIE's ports: ext_proc on 9002, gRPC health on 9003
    grpc_port: int = 9002
    # the gRPC health service here too (GIE's layout)
    health_port: Optional[int] = setting(9003, help="gRPC health service port")
    connect_timeout: float = 2.0  # health probes and /tokenize to the sidecars
    max_body_bytes: int = setting(
        DEFAULT_MAX_BODY_BYTES,
        parse=size,
        help="request bodies above this size (bytes, or e.g. 64MiB) get 413",
    )
    max_body_bytes_in_flight: int = setting(
        DEFAULT_MAX_BODY_BYTES_IN_FLIGHT, parse=size, help=IN_FLIGHT_HELP
    )
    # sidecars over HTTPS, verified against this CA
    tls_ca_file: Optional[str] = setting(
        None, help="reach the sidecars over HTTPS, verified against this CA bundle"
    )
    tls_any_name: bool = setting(False, switch=True, help="accept any certificate the CA signed")
    # GIE's conformance header (protocol.TEST_SELECTION_HEADER) restricts the choice: for
    # tests only, a client must not steer routing in production.
    test_endpoint_selection: bool = setting(
        False,
        switch=True,
        help="honour GIE's conformance header test-epp-endpoint-selection (tests only: it lets "
        "a client choose the endpoint)",
    )

    def validate(self) -> "EppSettings":
        self.validate_routing()
        check_budget(self.max_body_bytes_in_flight, self.max_body_bytes)
        return self
