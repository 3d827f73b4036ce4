"""`pdpool gateway`'s settings: the routing core's, and the gateway's own serving ones. Each
field with a `setting(...)` is a flag (pdpool/settings_flags.py); its default here is the
flag's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pdpool.body_budget import DEFAULT_MAX_BODY_BYTES_IN_FLIGHT, IN_FLIGHT_HELP, check_budget
from pdpool.protocol import DEFAULT_MAX_BODY_BYTES
from pdpool.settings_flags import setting, size

from ..routing.settings import RoutingSettings


@dataclass
class GatewaySettings(RoutingSettings):
    connect_timeout: float = 2.0
    # Migration of broken streams (see migration.py).
    migrate: bool = setting(True, switch=True, help="continue broken streams on another sidecar")
    max_migrations: int = 3
    # no byte for this long mid-stream: broken
    stall_timeout_s: float = setting(
        20.0, help="a stream silent this long mid-way is treated as broken"
    )
    # the engine's default when a request has none
    default_max_tokens: int = setting(
        16, help="the engines' default max_tokens (for continuing requests that set none)"
    )
    max_body_bytes: int = setting(
        DEFAULT_MAX_BODY_BYTES,
        parse=size,
        help="request bodies above this size (bytes, or e.g. 64MiB) get 413 (default %(default)s)",
    )
    max_body_bytes_in_flight: int = setting(
        DEFAULT_MAX_BODY_BYTES_IN_FLIGHT, parse=size, help=IN_FLIGHT_HELP
    )
    # A file of API keys (apikeys.py): requests without one get 401. None: no keys asked.
    api_keys_file: Optional[str] = setting(
        None,
        help="file of API keys, one per line (>= 16 characters): clients must "
        "send one (Authorization: Bearer KEY); re-read when it changes",
    )
    # Sidecars over TLS: reached at https:// and verified against this CA bundle.
    tls_ca_file: Optional[str] = setting(
        None, help="reach the sidecars over HTTPS, verified against this CA bundle"
    )
    # see SidecarSettings.tls_any_name
    tls_any_name: bool = setting(
        False,
        switch=True,
        help="with --tls-ca-file: accept any certificate that CA signed, whatever "
        "its name (a CA dedicated to the pool; sidecars are reached by pod IP)",
    )

    def validate(self) -> "GatewaySettings":
        self.validate_routing()
        if self.tenants_file and self.api_keys_file and not self.tenant_header:
            raise ValueError(
                "--tenants-file lists the API keys: give it or --api-keys-file, not both "
                "(or name the tenant by --tenant-header)"
            )
        if self.max_migrations < 0:
            raise ValueError("max migrations must be >= 0")
        check_budget(self.max_body_bytes_in_flight, self.max_body_bytes)
        return self
