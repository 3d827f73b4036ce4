"""Every engine knob, validated once, in one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pdpool.body_budget import DEFAULT_MAX_BODY_BYTES_IN_FLIGHT, IN_FLIGHT_HELP, check_budget
from pdpool.engine.structured.limits import StructuredLimits
from pdpool.pool_defaults import KV_BLOCK_SIZE
from pdpool.protocol import DEFAULT_MAX_BODY_BYTES, validate_threshold
from pdpool.settings_flags import comma_list, optional_size, setting, size
from pdpool.units import parse_size  # noqa: F401 (re-exported: callers read sizes here)


# The offload tiers (--kv-offloading-backend): native (host memory, vLLM's default), a
# directory of this engine's (disk), or one shared by the pool (shared). vLLM's lmcache
# is not one of ours.
OFFLOAD_BACKENDS = ("native", "disk", "shared")


@dataclass
class EngineConfig:
    """Each field with a `setting(...)` is a `pdpool serve` flag of the same name
    (pdpool/settings_flags.py): its default here is the flag's."""

    model: str = setting(
        positional=True, metavar="MODEL_DIR", help="a Hugging Face checkpoint folder"
    )
    served_model_name: Optional[str] = setting(None)
    device: str = setting("auto", choices=("auto", "cpu", "cuda"))
    dtype: Optional[str] = setting(None, choices=("auto", "float32", "float16", "bfloat16"))
    block_size: int = setting(KV_BLOCK_SIZE)
    num_kv_blocks: Optional[int] = setting(None, type=int)
    kv_cache_memory: Optional[int] = setting(None, help="e.g. 512MiB, 4GiB", parse=optional_size)
    max_model_len: Optional[int] = setting(None, type=int)
    max_num_batched_tokens: int = setting(2048)
    max_num_seqs: int = setting(64)
    # vLLM's --scheduling-policy (engine/request_queue.py)
    scheduling_policy: str = setting(
        "fcfs",
        choices=("fcfs", "priority"),
        help="vLLM's: fcfs (arrival order; a request's priority is ignored) or priority "
        "(waiting requests by their `priority`, lower first, then arrival; when blocks run "
        "out the lowest-priority running request is preempted)",
    )
    enable_chunked_prefill: bool = setting(
        True, switch=True, help="split long prompts over steps (default)"
    )
    enable_prefix_caching: bool = setting(
        True, switch=True, help="reuse cached prompt blocks (default)"
    )
    prefix_aware_admission: bool = setting(
        True,
        switch=True,
        help="count cached blocks when admitting (default); --no-prefix-aware-admission admits "
        "as if nothing were cached (only to measure what awareness brings)",
    )
    global_cache_hit_threshold: float = setting(0.0)
    seed: int = setting(0)
    # torch threads on CPU (None: torch's default; `pdpool serve` passes cpu_threads.py's)
    cpu_threads: Optional[int] = setting(
        None,
        type=int,
        help="torch threads on CPU (default: $OMP_NUM_THREADS if set, else every usable "
        "core but one, which the HTTP server keeps; a cgroup CPU limit counts)",
    )
    # torch threads for steps computing many prompt tokens (None: cpu_threads)
    cpu_prefill_threads: Optional[int] = setting(
        None,
        type=int,
        help="torch threads on CPU for steps that compute 256 or more prompt tokens, while "
        "they compute faster than --cpu-threads (measured as the steps come: other busy "
        "processes can make more threads slower) (default: --cpu-threads if given, else "
        "$OMP_NUM_THREADS if set, else every usable core with the engine in its own "
        "process, one fewer without)",
    )
    # KV connector (P/D transfer)
    kv_connector: str = setting("none", choices=("none", "nixl"))
    kv_role: str = setting("both", choices=("producer", "consumer", "both"))
    kv_host: str = setting(
        "127.0.0.1", help="address advertised to peers for KV transfer (the pod IP)"
    )
    kv_port: int = setting(0, help="KV handshake port (0: pick one)")
    kv_peer_allowlist: list[str] = setting(
        default_factory=list,
        parse=comma_list,
        help="comma-separated hosts or CIDRs this engine may pull KV from",
    )
    kv_pull_threshold: int = setting(
        0, help="pull a remote prefix only when it saves at least this many tokens"
    )
    kv_load_failure_policy: str = setting("recompute", choices=("recompute", "fail"))
    # How long a lease holds KV for a peer unless renewed (the peer's queued request
    # renews it) or released (the peer's read, or a router that will not pull).
    kv_producer_timeout: float = setting(
        10.0,
        help="seconds a lease holds KV for a peer unless the peer renews it "
        "(its request is queued) or releases it (read done, or no pull)",
    )
    # The pool's shared secret for signing kv_transfer_params (else $PDPOOL_KV_SECRET_FILE
    # or $PDPOOL_KV_SECRET); without one, loads are checked by content alone.
    kv_secret_file: Optional[str] = setting(
        None,
        help="the pool's secret for signing and checking kv_transfer_params and the "
        "shared offload tier's records (else $PDPOOL_KV_SECRET_FILE or $PDPOOL_KV_SECRET; "
        "without one, loads are checked by content alone; the shared tier refuses to start)",
    )
    kv_load_timeout: float = setting(
        30.0, help="seconds a consumer waits for a READ before computing locally"
    )
    # HTTP server: bodies above this are refused with 413 while they arrive.
    max_body_bytes: int = setting(
        DEFAULT_MAX_BODY_BYTES,
        parse=size,
        help="request bodies above this size (bytes, or e.g. 64MiB) get 413, checked while "
        "they arrive (default %(default)s: a 10 MB prompt fits)",
    )
    max_body_bytes_in_flight: int = setting(
        DEFAULT_MAX_BODY_BYTES_IN_FLIGHT, parse=size, help=IN_FLIGHT_HELP
    )
    # /ready fails when the engine loop has work and has not ticked for this long.
    ready_max_stall_s: float = setting(
        30.0,
        help="/ready answers 503 when the engine loop has work and has not "
        "ticked for this long (/health is liveness only)",
    )
    # Structured outputs: spec caps checked in the HTTP process (structured/limits.py), and
    # the core's grammar compiles (structured/compile_jobs.py, structured/grammar.py).
    structured_limits: StructuredLimits = setting(
        default_factory=StructuredLimits, nested=StructuredLimits, prefix="structured-"
    )
    structured_compile_timeout_s: float = setting(
        30.0,
        help="a guided request whose grammar has not compiled in this time gets 400 (the "
        "compile runs on unattended; see --structured-max-overrun-compiles)",
    )
    structured_max_compiles: int = setting(
        2, help="grammar compiles at once; more wait for a slot (default %(default)s)"
    )
    structured_max_overrun_compiles: int = setting(
        2,
        help="compiles past their deadline that may run on; while that many do, new guided "
        "requests get 503 (default %(default)s)",
    )
    structured_cache_bytes: int = setting(
        256 << 20,
        parse=size,
        help="memory for compiled grammars (bytes, or e.g. 1GiB), least recently used leave "
        "first (default %(default)s)",
    )
    # vLLM's --kv-events-config (JSON): publish KV cache events over ZeroMQ.
    kv_events_config: Optional[str] = setting(
        None,
        help="vLLM's KV cache events config (JSON), e.g. '{\"enable_kv_cache_events\":"
        ' true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": "tcp://*:5558"}\'',
    )
    # KV offload tier below the pool (engine/kv/offload/): vLLM's --kv-offloading-size (GiB;
    # None: no tier) and --kv-offloading-backend (native, host memory; disk, a directory of
    # this engine; shared, a directory every engine of the pool mounts), the directory, and
    # whether each record is fsynced (off: a torn record is detected on read, recomputed).
    kv_offloading_size: Optional[float] = setting(
        None,
        type=float,
        help="vLLM's: GiB of KV offload tier below the block pool (off unless given); "
        "blocks are written through to it and a prefix it holds is loaded, not recomputed",
    )
    kv_offloading_backend: str = setting(
        "native",
        choices=OFFLOAD_BACKENDS,
        help="native (vLLM's default): host memory; disk: a directory of this engine's (an "
        "emptyDir); shared: a directory every engine of the pool mounts (a PVC), so one "
        "engine's prefix is a hit for all",
    )
    kv_offloading_path: Optional[str] = setting(None, help="the offload tier's directory")
    kv_offloading_fsync: bool = setting(
        False,
        switch=True,
        help="fsync each record (durable across power loss; off by default: every read "
        "checks the record's digest, so a torn one is a miss)",
    )
    # LoRA (vLLM's flags): adapters named at start (name=path or vLLM's JSON form), how
    # many distinct adapters one step may batch, the largest rank, how many stay in memory;
    # runtime loads (VLLM_ALLOW_RUNTIME_LORA_UPDATING) only from --lora-allowed-dir.
    enable_lora: bool = setting(False, name="--enable-lora", help="serve LoRA adapters")
    lora_modules: list[str] = setting(
        default_factory=list,
        repeat="extend",
        metavar="NAME=PATH",
        help="adapters to serve, as name=path or vLLM's JSON "
        '\'{"name": "a", "path": "/adapters/a"}\' (repeatable); requests pick one by `model`',
    )
    max_loras: int = setting(1, help="distinct adapters in one step's batch")
    max_lora_rank: int = setting(16, help="the largest adapter rank")
    max_cpu_loras: Optional[int] = setting(
        None, type=int, help="adapters kept in memory (default: --max-loras)"
    )
    lora_allowed_dirs: list[str] = setting(
        default_factory=list,
        name="--lora-allowed-dir",
        repeat="append",
        help="a folder /v1/load_lora_adapter may load adapters from (repeatable; runtime "
        "loads need VLLM_ALLOW_RUNTIME_LORA_UPDATING=true and at least one)",
    )

    def validate(self) -> None:
        """Raises ValueError, naming the flag, for the first setting that makes no sense."""
        self._check_memory()
        self._check_batching()
        self.global_cache_hit_threshold = (
            validate_threshold(self.global_cache_hit_threshold, "--global-cache-hit-threshold")
            or 0.0
        )
        self._check_kv_transfer()
        self._check_offload()
        self._check_server()
        self._check_structured()
        self._check_lora()

    def _check_memory(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("--num-kv-blocks must be >= 1")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError("--kv-cache-memory must be positive")

    def _check_batching(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("--max-num-batched-tokens must be >= 1")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError("--cpu-threads must be >= 1")
        if self.cpu_prefill_threads is not None and self.cpu_prefill_threads < 1:
            raise ValueError("--cpu-prefill-threads must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("--max-num-seqs must be >= 1")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"--scheduling-policy must be fcfs or priority, got {self.scheduling_policy!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("--max-model-len must be >= 2")
        if (
            not self.enable_chunked_prefill
            and self.max_model_len
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ValueError(
                "without chunked prefill, --max-num-batched-tokens must be >= --max-model-len"
            )

    def _check_kv_transfer(self) -> None:
        if self.kv_connector not in ("none", "nixl"):
            raise ValueError(f"--kv-connector must be none or nixl, got {self.kv_connector!r}")
        if self.kv_role not in ("producer", "consumer", "both"):
            raise ValueError("--kv-role must be producer, consumer or both")
        if self.kv_host in ("0.0.0.0", "::", ""):
            raise ValueError(
                "--kv-host must be an address peers can reach (the pod IP), not a wildcard"
            )
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError("--kv-load-failure-policy must be recompute or fail")
        if self.kv_producer_timeout <= 0 or self.kv_load_timeout <= 0:
            raise ValueError("--kv-producer-timeout and --kv-load-timeout must be > 0")
        if self.kv_connector == "nixl":
            from pdpool.engine.connector.lease_token import load_secret

            load_secret(self.kv_secret_file)  # a bad secret stops the start, not a request
        if self.kv_pull_threshold < 0:
            raise ValueError("--kv-pull-threshold must be >= 0")

    def _check_offload(self) -> None:
        if self.kv_offloading_backend not in OFFLOAD_BACKENDS:
            raise ValueError(
                f"--kv-offloading-backend must be one of {', '.join(OFFLOAD_BACKENDS)}, "
                f"got {self.kv_offloading_backend!r}"
            )
        if self.kv_offloading_size is None:
            return
        size = self.kv_offloading_size
        if not isinstance(size, (int, float)) or not size > 0 or size > 1 << 20:
            raise ValueError(f"--kv-offloading-size must be > 0 GiB (and sane), got {size!r}")
        if self.kv_offloading_backend != "native" and not self.kv_offloading_path:
            raise ValueError(
                f"--kv-offloading-backend {self.kv_offloading_backend} needs "
                "--kv-offloading-path (the tier's directory)"
            )
        if not self.enable_prefix_caching:
            raise ValueError("--kv-offloading-size needs prefix caching (blocks are found by hash)")
        if self.kv_offloading_backend == "shared":
            from pdpool.engine.connector.lease_token import load_secret

            if load_secret(self.kv_secret_file) is None:
                raise ValueError(
                    "--kv-offloading-backend shared needs the pool's secret (--kv-secret-file, "
                    "$PDPOOL_KV_SECRET_FILE or $PDPOOL_KV_SECRET): without it, anyone who can "
                    "write the directory could plant KV records the engines accept"
                )

    @property
    def kv_offloading_bytes(self) -> int:
        return int((self.kv_offloading_size or 0) * (1 << 30))

    def _check_server(self) -> None:
        if self.max_body_bytes < 1024:
            raise ValueError("--max-body-bytes must be at least 1KiB")
        check_budget(self.max_body_bytes_in_flight, self.max_body_bytes)
        if self.kv_events_config:
            from pdpool.kv_events import KVEventsConfig

            KVEventsConfig.parse(self.kv_events_config)  # a bad config stops the start
        if self.ready_max_stall_s <= 0:
            raise ValueError("--ready-max-stall-s must be > 0")

    def _check_structured(self) -> None:
        self.structured_limits.validate()
        if self.structured_compile_timeout_s <= 0:
            raise ValueError("--structured-compile-timeout-s must be > 0")
        if self.structured_max_compiles < 1 or self.structured_max_overrun_compiles < 1:
            raise ValueError(
                "--structured-max-compiles and --structured-max-overrun-compiles must be >= 1"
            )
        if self.structured_cache_bytes < 1 << 20:
            raise ValueError("--structured-cache-bytes must be at least 1MiB")

    def _check_lora(self) -> None:
        if not self.enable_lora:
            if self.lora_modules:
                raise ValueError("--lora-modules needs --enable-lora")
            return
        if self.max_loras < 1:
            raise ValueError("--max-loras must be >= 1")
        if not 1 <= self.max_lora_rank <= 512:
            raise ValueError("--max-lora-rank must be in [1, 512]")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ValueError("--max-cpu-loras must be >= --max-loras")
        from pdpool.engine.lora.registry import parse_lora_module

        for text in self.lora_modules:
            parse_lora_module(text)  # a malformed entry stops the start
