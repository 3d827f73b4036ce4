"""Sidecar settings: one validated object built from a config file and/or CLI flags."""

from __future__ import annotations

import dataclasses
import json
import os
import ssl
from dataclasses import dataclass, field
from typing import Any, Optional

from pdpool.protocol import DEFAULT_MAX_BODY_BYTES, validate_threshold

MODES = ("decode-first", "prefill-first", "aggregated")


@dataclass
class SidecarSettings:
    decode_url: str = "http://127.0.0.1:8001"
    prefill_urls: list[str] = field(default_factory=list)
    prefill_service: Optional[str] = None  # HOST:PORT of a headless Service
    prefill_refresh_s: float = 5.0
    mode: str = "decode-first"
    cache_hit_threshold: float = 0.5
    # Give the decode engine's cached prefix to the prefill leg so prefill pulls it.
    pull_from_decode: bool = True
    kv_pull_threshold: int = 0  # offer a pull only for >= this many tokens
    prefill_timeout: float = 30.0  # per prefill attempt, seconds
    decode_retry_s: float = 5.0  # keep retrying an unreachable decode engine
    connect_timeout: float = 2.0
    # Outlier detection of prefill engines (see outlier.py).
    probe_interval_s: float = 1.0  # health probe of every prefill engine
    probe_timeout_s: float = 2.0  # (also the decode engine check of /ready)
    outlier_failures: int = 3  # consecutive failed legs that eject
    ejection_s: float = 2.0  # base ejection time (x recent ejections)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies get 413
    # Does the decode engine honour cache_hit_threshold? (capability.py) auto: probe it.
    engine_rejects: str = "auto"
    # Engines that cannot reject: decode-first sends prompts of at least this many
    # (estimated) tokens prefill-first, shorter ones to decode only.
    prefill_min_prompt_tokens: int = 128
    # Upstreams over TLS: prefill engines are reached at https:// and every upstream
    # certificate (decode_url too, when https://) is verified against this CA bundle.
    tls_ca_file: Optional[str] = None
    # Accept any certificate that CA signed, whatever name it carries: for a CA dedicated
    # to one pool, whose peers are reached at pod IPs no certificate can name in advance.
    tls_any_name: bool = False
    # Prefill engines' KV events ("HOST:PORT" -> "tcp://HOST:5557[|tcp://HOST:5558]"): the
    # one with the most of the prompt cached gets the leg (prefill_ranking.py).
    prefill_kv_events: dict[str, str] = field(default_factory=dict)
    # The same, following prefill_service: every prefill engine publishes on these ports.
    prefill_kv_events_port: Optional[int] = None
    prefill_kv_events_replay_port: Optional[int] = None
    kv_block_size: int = 16
    kv_tokenizer: Optional[str] = None  # the model's tokenizer.json (string prompts)
    # The pool allows runtime LoRA updates: an adapter no prefill engine serves is loaded
    # on one (the decode engine's path, only under these folders); empty: decode-only.
    lora_allowed_dirs: list[str] = field(default_factory=list)
    # How long a prefill engine's /v1/models (its adapters) is trusted before it is read
    # again; a leg that finds the adapter gone reads it at once.
    adapter_models_ttl_s: float = 5.0

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
