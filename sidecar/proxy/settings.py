"""Sidecar settings: one validated object built from a config file and/or CLI flags."""

from __future__ import annotations

import dataclasses
import json
import os
import ssl
from dataclasses import dataclass
from typing import Any, Optional

from pdpool.pool_defaults import (
    CACHE_HIT_THRESHOLD,
    KV_BLOCK_SIZE,
    KV_PULL_THRESHOLD,
    PREFILL_TIMEOUT_S,
    ROUTER_MODE,
    ROUTER_MODES,
)
from pdpool.body_budget import DEFAULT_MAX_BODY_BYTES_IN_FLIGHT, IN_FLIGHT_HELP, check_budget
from pdpool.protocol import DEFAULT_MAX_BODY_BYTES, validate_threshold
from pdpool.settings_flags import setting, size

MODES = ROUTER_MODES


ENGINES, PATH, HEALTH, KV_EVENTS = (
    "engines",
    "the P/D path",
    "prefill engine health",
    "prefill legs by KV events",
)


@dataclass
class SidecarSettings:
    """Each field with a `setting(...)` is a `pdpool sidecar` flag (pdpool/settings_flags.py)
    that overrides the config file; the default here applies when neither sets it."""

    decode_url: str = setting(
        "http://127.0.0.1:8001", group=ENGINES, help="the local decode engine"
    )
    prefill_urls: list[str] = setting(
        default_factory=list,
        name="--prefill-url",
        repeat="append",
        group=ENGINES,
        help="a prefill engine (repeatable): HOST:PORT or http://HOST:PORT",
    )
    prefill_service: Optional[str] = setting(
        None,
        group=ENGINES,
        help="HOST:PORT of a headless Service whose DNS lists the prefill pods",
    )
    prefill_refresh_s: float = setting(5.0, group=ENGINES, help="DNS refresh period")
    mode: str = setting(
        ROUTER_MODE,
        choices=MODES,
        group=PATH,
        help="decode-first (prefill only when decode rejects), prefill-first, or aggregated",
    )
    cache_hit_threshold: float = setting(
        CACHE_HIT_THRESHOLD,
        group=PATH,
        help="pool threshold for decode-first (a request's own value wins)",
    )
    # Give the decode engine's cached prefix to the prefill leg so prefill pulls it.
    pull_from_decode: bool = setting(
        True, switch=True, group=PATH, help="let prefill pull decode's cached prefix"
    )
    # offer a pull only for >= this many tokens
    kv_pull_threshold: int = setting(
        KV_PULL_THRESHOLD,
        group=PATH,
        help="offer decode's cached prefix to prefill only when it holds at least this many tokens",
    )
    # per prefill attempt, seconds
    prefill_timeout: float = setting(
        PREFILL_TIMEOUT_S, group=PATH, help="seconds per prefill attempt"
    )
    # keep retrying an unreachable decode engine
    decode_retry_s: float = setting(
        5.0, group=PATH, help="how long to retry an unreachable decode engine"
    )
    connect_timeout: float = 2.0
    # Outlier detection of prefill engines (see outlier.py).
    probe_interval_s: float = setting(
        1.0, group=HEALTH, help="health probe period of each prefill engine (0: off)"
    )
    # (also the decode engine check of /ready)
    probe_timeout_s: float = setting(2.0, group=HEALTH, help="health probe timeout")
    outlier_failures: int = setting(
        3, group=HEALTH, help="consecutive failed prefill legs that eject an engine"
    )
    ejection_s: float = setting(
        2.0, group=HEALTH, help="base ejection time of a sick prefill engine (x recent ejections)"
    )
    # larger request bodies get 413
    max_body_bytes: int = setting(
        DEFAULT_MAX_BODY_BYTES,
        parse=size,
        group=PATH,
        help="request bodies above this size (bytes, or e.g. 64MiB) get 413",
    )
    max_body_bytes_in_flight: int = setting(
        DEFAULT_MAX_BODY_BYTES_IN_FLIGHT, parse=size, group=PATH, help=IN_FLIGHT_HELP
    )
    # Does the decode engine honour cache_hit_threshold? (capability.py) auto: probe it.
    engine_rejects: str = setting(
        "auto",
        choices=("auto", "yes", "no"),
        group=ENGINES,
        help="does the decode engine honour cache_hit_threshold (pdpool serve: "
        "yes; stock vLLM: no)? auto probes it once",
    )
    # Engines that cannot reject: decode-first sends prompts of at least this many
    # (estimated) tokens prefill-first, shorter ones to decode only.
    prefill_min_prompt_tokens: int = setting(
        128,
        group=PATH,
        help="decode-first with an engine that cannot reject: prompts of at least this many "
        "tokens (estimated: characters / 4) go prefill-first, shorter ones to decode only",
    )
    # Upstreams over TLS: prefill engines are reached at https:// and every upstream
    # certificate (decode_url too, when https://) is verified against this CA bundle.
    tls_ca_file: Optional[str] = setting(
        None,
        group=ENGINES,
        help="reach prefill engines over HTTPS and verify every upstream (the "
        "decode engine too, when --decode-url is https://) against this CA",
    )
    # Accept any certificate that CA signed, whatever name it carries: for a CA dedicated
    # to one pool, whose peers are reached at pod IPs no certificate can name in advance.
    tls_any_name: bool = setting(
        False,
        switch=True,
        group=ENGINES,
        help="with --tls-ca-file: accept any certificate that CA signed, whatever "
        "its name (a CA dedicated to the pool; peers are reached by pod IP)",
    )
    # Prefill engines' KV events ("HOST:PORT" -> "tcp://HOST:5557[|tcp://HOST:5558]"): the
    # one with the most of the prompt cached gets the leg (prefill_ranking.py).
    prefill_kv_events: dict[str, str] = setting(
        default_factory=dict,
        repeat="append",
        metavar="HOST:PORT=ENDPOINT[|REPLAY]",
        group=KV_EVENTS,
        help="a prefill engine and its KV events endpoint (vLLM "
        "--kv-events-config), e.g. 10.0.0.7:8000=tcp://10.0.0.7:5557 "
        "(repeatable): legs go to the engine with the most of the prompt "
        "cached",
    )
    # The same, following prefill_service: every prefill engine publishes on these ports.
    prefill_kv_events_port: Optional[int] = setting(
        None,
        type=int,
        group=KV_EVENTS,
        help="the same, following --prefill-service: every prefill engine "
        "publishes its KV events on this port (--kv-events-config tcp://*:PORT)",
    )
    prefill_kv_events_replay_port: Optional[int] = setting(
        None,
        type=int,
        group=KV_EVENTS,
        help="with --prefill-kv-events-port: the prefill engines' replay port",
    )
    kv_block_size: int = setting(KV_BLOCK_SIZE, group=KV_EVENTS, help="the engines' KV block size")
    # the model's tokenizer.json (string prompts)
    kv_tokenizer: Optional[str] = setting(
        None, group=KV_EVENTS, help="the model's tokenizer.json (string prompts)"
    )
    # The pool allows runtime LoRA updates: an adapter no prefill engine serves is loaded
    # on one (the decode engine's path, only under these folders); empty: decode-only.
    lora_allowed_dirs: list[str] = setting(
        default_factory=list,
        name="--lora-allowed-dir",
        repeat="append",
        metavar="DIR",
        group=PATH,
        help="the pool allows runtime LoRA updates: a prefill leg for an adapter no prefill "
        "engine serves loads the decode engine's adapter there, when its path is under one "
        "of these folders (repeatable); without any, such a request is served by decode alone",
    )
    # How long a prefill engine's /v1/models (its adapters) is trusted before it is read
    # again; a leg that finds the adapter gone reads it at once.
    adapter_models_ttl_s: float = setting(
        5.0, group=PATH, help="how long an engine's /v1/models answer (its adapters) is trusted"
    )

    @property
    def upstream_scheme(self) -> str:
        return "https" if self.tls_ca_file else "http"

    def ssl_context(self) -> Optional[ssl.SSLContext]:
        """The context upstream TLS is verified with (None: no CA given)."""
        if not self.tls_ca_file:
            return None
        from pdpool.tlsutil import client_context

        return client_context(self.tls_ca_file, self.tls_any_name)

    def validate(self) -> "SidecarSettings":
        """Checks every setting (ValueError names the first that makes no sense) and turns
        the ones a config file may give as text into their types."""
        self._check_routing()
        self._check_durations()
        self._check_prefill()
        self._check_kv_events()
        self._check_lora()
        return self

    def _check_lora(self) -> None:
        dirs = self.lora_allowed_dirs
        if isinstance(dirs, str):
            dirs = [dirs]
        if not isinstance(dirs, list) or not all(
            isinstance(d, str) and d.startswith("/") and d != "/" for d in dirs
        ):
            raise ValueError("lora_allowed_dirs must be absolute folders (not /)")
        self.lora_allowed_dirs = list(dirs)

    def _check_routing(self) -> None:
        if isinstance(self.max_body_bytes, str):  # "32MiB" from a config file
            from pdpool.units import parse_size

            self.max_body_bytes = parse_size(self.max_body_bytes)
        if int(self.max_body_bytes) < 1024:
            raise ValueError("max_body_bytes must be at least 1KiB")
        if isinstance(self.max_body_bytes_in_flight, str):
            from pdpool.units import parse_size

            self.max_body_bytes_in_flight = parse_size(self.max_body_bytes_in_flight)
        check_budget(int(self.max_body_bytes_in_flight), int(self.max_body_bytes))
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        threshold = validate_threshold(self.cache_hit_threshold)
        if threshold is None:  # null in a config file: every request would fail on it
            raise ValueError("cache_hit_threshold must be a number in [0, 1], got None")
        self.cache_hit_threshold = threshold
        if not self.decode_url.startswith(("http://", "https://")):
            raise ValueError(f"decode url must start with http:// or https://: {self.decode_url}")
        self.decode_url = self.decode_url.rstrip("/")
        if int(self.kv_pull_threshold) < 0:
            raise ValueError("kv_pull_threshold must be >= 0")
        self.kv_pull_threshold = int(self.kv_pull_threshold)

    def _check_durations(self) -> None:
        for name in (
            "prefill_timeout",
            "decode_retry_s",
            "connect_timeout",
            "prefill_refresh_s",
            "probe_interval_s",
            "probe_timeout_s",
            "ejection_s",
            "adapter_models_ttl_s",
        ):
            if float(getattr(self, name)) < 0:
                raise ValueError(f"{name} must be >= 0")

    def _check_prefill(self) -> None:
        from .capability import ENGINE_REJECTS

        if self.engine_rejects not in ENGINE_REJECTS:
            raise ValueError(f"engine_rejects must be one of {', '.join(ENGINE_REJECTS)}")
        if int(self.prefill_min_prompt_tokens) < 0:
            raise ValueError("prefill_min_prompt_tokens must be >= 0")
        self.prefill_min_prompt_tokens = int(self.prefill_min_prompt_tokens)
        if int(self.outlier_failures) < 1:
            raise ValueError("outlier_failures must be >= 1")

    def _check_kv_events(self) -> None:
        if int(self.kv_block_size) < 1:
            raise ValueError("kv_block_size must be >= 1")
        if isinstance(self.prefill_kv_events, list):  # TARGET=SPEC items from a file
            from ..kv.events_spec import parse_kv_events

            self.prefill_kv_events = parse_kv_events(self.prefill_kv_events, "prefill_kv_events")
        if not isinstance(self.prefill_kv_events, dict):
            raise ValueError("prefill_kv_events must map HOST:PORT to tcp://HOST:PORT")
        from ..kv.feeds import check_event_ports

        self.prefill_kv_events_port, self.prefill_kv_events_replay_port = check_event_ports(
            self.prefill_kv_events_port,
            self.prefill_kv_events_replay_port,
            ("prefill_kv_events_port", "prefill_kv_events_replay_port"),
        )


def load_config_file(path: str) -> dict[str, Any]:
    """A YAML or JSON mapping (an operator's ConfigMap); keys may use - or _."""
    if not os.path.exists(path):
        raise ValueError(f"config file not found: {path}")
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    if path.endswith(".json"):
        data = json.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping")
    known = {f.name for f in dataclasses.fields(SidecarSettings)}
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in known:
            raise ValueError(f"unknown setting {key!r} in {path}")
        out[name] = value
    return out


def build_settings(file_values: dict[str, Any], overrides: dict[str, Any]) -> SidecarSettings:
    """File values, then every override that is not None."""
    values = dict(file_values)
    values.update({k: v for k, v in overrides.items() if v is not None})
    if isinstance(values.get("prefill_urls"), str):
        values["prefill_urls"] = [values["prefill_urls"]]
    return SidecarSettings(**values).validate()
