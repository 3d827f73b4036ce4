"""The Envoy bootstrap `pdpool up --gateway envoy` runs: the Gateway API Inference
Extension's filter chain (as llm-d's dev/e2e envoy.yaml and the GIE gateways build it),
rendered by a pure function.

- `header_mutation` first: a client's own `x-gateway-destination-endpoint` is dropped, so
  only the endpoint picker chooses where a request goes;
- `ext_proc` to `pdpool epp` in FULL_DUPLEX_STREAMED mode for both bodies, the upstream
  address sent back with the response headers (the picker counts what was served), the
  subset hint forwarded, `failure_mode_allow` from --epp-failure-mode (open: a request goes
  on when the picker is down; close: it gets a 5xx);
- routes: with the picker's header, the ORIGINAL_DST cluster keyed on it; without it (the
  picker was down and failure mode is open) the pool's sidecars round-robin."""

from __future__ import annotations

from typing import Any

DESTINATION_HEADER = "x-gateway-destination-endpoint"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
FAILURE_MODES = ("open", "close")
_TYPES = "type.googleapis.com/envoy.extensions"


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _static_cluster(name: str, endpoints: list[tuple[str, int]], **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": _address(h, p)}} for h, p in endpoints]}
            ],
        },
        **extra,
    }


def _ext_proc_filter(failure_mode: str) -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": f"{_TYPES}.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "10s"},
            "failure_mode_allow": failure_mode == "open",
            "processing_mode": {
                "request_header_mode": "SEND",
                "response_header_mode": "SEND",
                "request_body_mode": "FULL_DUPLEX_STREAMED",
                "response_body_mode": "FULL_DUPLEX_STREAMED",
                "request_trailer_mode": "SEND",
                "response_trailer_mode": "SEND",
            },
            "message_timeout": "1000s",
            # where Envoy sent it, and whether the answer is the upstream's or Envoy's own
            "response_attributes": ["upstream.address", "response.code_details"],
            "metadata_options": {"forwarding_namespaces": {"untyped": [SUBSET_NAMESPACE]}},
        },
    }


def _drop_client_destination() -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.header_mutation",
        "typed_config": {
            "@type": f"{_TYPES}.filters.http.header_mutation.v3.HeaderMutation",
            "mutations": {"request_mutations": [{"remove": DESTINATION_HEADER}]},
        },
    }


def _routes() -> list[dict[str, Any]]:
    long_lived = {"timeout": "0s", "idle_timeout": "300s"}
    return [
        {
            "match": {
                "prefix": "/",
                "headers": [{"name": DESTINATION_HEADER, "present_match": True}],
            },
            "route": {"cluster": "original_destination_cluster", **long_lived},
        },
        {"match": {"prefix": "/"}, "route": {"cluster": "pool", **long_lived}},
    ]


def _picker_health_checks() -> dict[str, Any]:
    """The picker's gRPC health checked every half second, and no request sent to it while
    it fails (no panic routing). Failing open needs this: in FULL_DUPLEX_STREAMED mode
    Envoy streams the body to the picker without waiting, so a picker whose death is found
    only by a connection attempt gets body chunks Envoy cannot take back, and the request
    fails (500) even with failure_mode_allow. Known unhealthy, the picker gets no stream and
    the request goes on at once."""
    return {
        "health_checks": [
            {
                "timeout": "1s",
                "interval": "0.5s",
                "no_traffic_interval": "0.5s",
                "unhealthy_threshold": 1,
                "healthy_threshold": 1,
                "grpc_health_check": {"service_name": EXT_PROC_SERVICE},
            }
        ],
        "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
    }


def envoy_bootstrap(
    port: int,
    admin_port: int,
    epp_grpc_port: int,
    sidecars: list[tuple[str, int]],
    failure_mode: str = "close",
    host: str = "127.0.0.1",
) -> dict[str, Any]:
    """Envoy's whole static configuration: a listener on host:port in front of the pool's
    decode sidecars (host, port), with `pdpool epp` on epp_grpc_port picking for each
    request."""
    if failure_mode not in FAILURE_MODES:
        raise ValueError(f"failure mode must be one of {', '.join(FAILURE_MODES)}")
    manager = {
        "@type": f"{_TYPES}.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "inference",
        "route_config": {
            "name": "pool",
            "virtual_hosts": [{"name": "pool", "domains": ["*"], "routes": _routes()}],
        },
        "http_filters": [
            _drop_client_destination(),
            _ext_proc_filter(failure_mode),
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": f"{_TYPES}.filters.http.router.v3.Router",
                    "suppress_envoy_headers": True,
                },
            },
        ],
        "stream_idle_timeout": "300s",
    }
    http2 = {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": f"{_TYPES}.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}},
        }
    }
    return {
        "admin": {"address": _address(host, admin_port)},
        "static_resources": {
            "listeners": [
                {
                    "name": "inference",
                    "address": _address(host, port),
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": manager,
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [
                {
                    "name": "original_destination_cluster",
                    "type": "ORIGINAL_DST",
                    "connect_timeout": "2s",
                    "lb_policy": "CLUSTER_PROVIDED",
                    "original_dst_lb_config": {
                        "use_http_header": True,
                        "http_header_name": DESTINATION_HEADER,
                    },
                },
                _static_cluster("pool", sidecars),
                _static_cluster(
                    "epp",
                    [(host, epp_grpc_port)],
                    typed_extension_protocol_options=http2,
                    **_picker_health_checks(),
                ),
            ],
        },
    }
